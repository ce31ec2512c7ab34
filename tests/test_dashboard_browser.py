"""The dashboard in a real browser: Debian's Chromium (no browser download) driven by Playwright
against a real farm of sandbox desktops serving /ui, and run dirs written by real ``osfarm eval``
runs on suites/mini.

Covered: log in; the pool page with live thumbnails; a desktop's live view changing after an
agent's step; an admin taking control and typing a task's solution into its terminal (the text
arrives: the file exists and the task scores 1), the take-over in the lease info and in the
TaskEnv's ``controlled_by``; a viewer cannot take control; the leaderboard sorted; a run, an
episode with its screenshots, a comparison, training charts; an XSS probe and a path-traversal
probe; pages at phone width. Screenshots of each page go to the test's tmp dir (``ui-shots``)
and, when OSFARM_UI_SHOTS names a folder, there too (to look at them after the run)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from osfarm.dashboard.app import mount
from osfarm.dashboard.state import Dashboard
from osfarm.env import SyncTaskEnv
from osfarm.farm.server import FarmServer
from osfarm.tasks.filecache import suite_cache
from osfarm.tasks.suite import load_suite
from osfarm.testing.dashboard_runs import XSS, make_run
from osfarm.testing.farms import TOKEN, running_farm
from osfarm.trainer.metrics import TrainMetrics

playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")

CHROMIUM = Path("/usr/bin/chromium")
VIEWER_TOKEN = "viewer-token-for-the-ui-tests-0001"
MINI = Path(__file__).resolve().parent.parent / "suites" / "mini"
HELLO = "5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0a01"  # type a line into the terminal
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed "
                                "(scripts/system-packages.txt)")


def wait_for(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("uiruns")


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("ui-shots")
    yield d
    keep = os.environ.get("OSFARM_UI_SHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for p in d.glob("*.png"):
            shutil.copy2(p, Path(keep) / p.name)


@pytest.fixture(scope="module")
def dash(runs_dir: Path) -> Dashboard:
    return Dashboard.for_runs(runs_dir)


@pytest.fixture(scope="module")
def ui_farm(dash: Dashboard) -> Iterator[FarmServer]:
    with running_farm("osfui", ui=mount(dash), pool_min=1, pool_max=2,
                      tokens=f"watcher:viewer:{VIEWER_TOKEN}") as server:
        yield server


@pytest.fixture(scope="module")
def evals(ui_farm: FarmServer, runs_dir: Path) -> dict[str, Path]:
    """Two real eval runs of suites/mini on the farm (replay solves all three, noop none), a
    training run's metrics written by the trainer's own logger, and a hostile hand-made run."""
    osfarm = Path(sys.executable).parent / "osfarm"
    out = {}
    for name, extra in (("noop-mini", ["--agent", "noop", "--max-steps", "1"]), ("replay-mini", ["--agent", "replay"])):
        out[name] = runs_dir / name
        res = subprocess.run([str(osfarm), "eval", "--suite", str(MINI), "--out", str(out[name]), "--url", ui_farm.url,
                              "--token", TOKEN, "--no-progress", *extra], capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout + res.stderr
    metrics = TrainMetrics(runs_dir / "train-demo", console=Console(file=io.StringIO()), tensorboard=False)
    for v in range(1, 7):
        metrics.log({"version": v, "reward": 0.1 * v, "success_rate": 0.1 * v, "staleness_max": v % 2,
                     "staleness_mean": 0.5, "loss": 1.0 / v, "kl": 0.01 * v, "entropy": 5 - 0.3 * v, "episodes": 8})
    metrics.close()
    (runs_dir / "train-demo" / "eval.jsonl").write_text(
        "".join(json.dumps({"version": v, "success_rate": 0.08 * v, "episodes": 4}) + "\n" for v in (2, 4, 6)))
    make_run(runs_dir / "hostile", XSS, {"t-xss": ("os", "failure")},
             response='</pre><img src=x onerror="window.__xss=1"><script>window.__xss=2</script>',
             actions=[{"action_type": "TYPING", "parameters": {"text": '<svg onload="window.__xss=3">'}}])
    return out


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM))
        yield b
        b.close()


def login(browser: Any, url: str, token: str, viewport: dict[str, int] = DESKTOP) -> Any:
    ctx = browser.new_context(viewport=viewport, base_url=url)
    page = ctx.new_page()
    page.on("dialog", lambda d: pytest.fail(f"a dialog opened: {d.message}"))  # an XSS alert() would
    page.goto("/ui/pool")
    assert "/ui/login" in page.url  # not logged in: sent to the login page, which remembers where to go
    page.fill("input[name=token]", token)
    page.click("button[type=submit]")
    page.wait_for_url("**/ui/pool")
    return page


def canvas_picture(page: Any) -> str:
    return page.evaluate("() => document.getElementById('screen').toDataURL('image/png')")


def frames(page: Any) -> int:
    return int(page.get_attribute("#screen", "data-frames") or 0)


def test_live_view_take_control_and_viewer(ui_farm: FarmServer, dash: Dashboard, browser: Any, shots: Path,
                                           tmp_path: Path) -> None:
    suite = load_suite(MINI)
    api = httpx.Client(base_url=ui_farm.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    page = login(browser, ui_farm.url, TOKEN)
    page.wait_for_selector(".desk .thumb img:not([hidden])", timeout=30_000)  # a live thumbnail arrived
    page.screenshot(path=str(shots / "01-pool.png"))
    with SyncTaskEnv(ui_farm.url, TOKEN, cache=suite_cache(suite, MINI, None, tmp_path, True), max_steps=5) as env:
        env.reset(suite[HELLO])  # a terminal is open and focused
        desktop, lease = env.desktop.desktop_id, env.desktop.id
        wait_for(lambda: page.locator(f".desk[data-id='{desktop}'] dd.state.leased").count(), what="leased state")
        page.click(f".desk[data-id='{desktop}'] a.thumb")
        page.wait_for_url(f"**/ui/desktops/{desktop}")
        wait_for(lambda: frames(page) > 0, what="a first frame")
        before = canvas_picture(page)
        env.step([{"action_type": "TYPING", "parameters": {"text": "echo step-seen-live"}},
                  {"action_type": "PRESS", "parameters": {"key": "enter"}}])
        wait_for(lambda: canvas_picture(page) != before, what="the live view to change after a step")

        # a viewer watches but cannot take control (no button, and the socket refuses)
        viewer = login(browser, ui_farm.url, VIEWER_TOKEN)
        viewer.goto(f"/ui/desktops/{desktop}")
        wait_for(lambda: frames(viewer) > 0, what="the viewer's first frame")
        assert viewer.locator("#take-control").count() == 0
        refused = viewer.evaluate("""(path) => new Promise(resolve => {
            const ws = new WebSocket(location.origin.replace('http', 'ws') + path);
            ws.onmessage = ev => { if (typeof ev.data === 'string') { const m = JSON.parse(ev.data);
                if (m.type === 'hello') ws.send(JSON.stringify({type: 'control', on: true}));
                if (m.type === 'error') { resolve(m.detail); ws.close(); } } };
            setTimeout(() => resolve('no answer'), 10000); })""", f"/ui/desktops/{desktop}/live")
        assert refused == "only an admin can take control"
        viewer.screenshot(path=str(shots / "03-desktop-viewer.png"))
        viewer.context.close()

        # the admin takes control and types the task's solution into the terminal
        page.click("#take-control")
        page.wait_for_selector("#take-control:text('Release control')")
        box = page.locator("#screen").bounding_box()
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.keyboard.type("echo 'hello osfarm' > ~/Desktop/hello.txt")
        page.keyboard.press("Enter")
        info = api.get(f"/v1/desktops/{lease}").json()
        assert [c["by"] for c in info["control"]] == ["admin"] and info["control"][0]["ended_at"] is None

        def typed() -> bool:
            r = api.post(f"/v1/desktops/{lease}/guest/execute",
                         json={"command": "cat /home/user/Desktop/hello.txt 2>/dev/null", "shell": True})
            return "hello osfarm" in r.json().get("output", "")

        wait_for(typed, what="the typed line to run in the desktop's terminal")
        time.sleep(0.5)  # the next frames reach the page
        page.screenshot(path=str(shots / "02-desktop-control.png"))
        page.click("#take-control")  # hand it back
        page.wait_for_selector("#take-control:text('Take control')")
        wait_for(lambda: api.get(f"/v1/desktops/{lease}").json()["control"][0]["ended_at"], what="control handed back")
        assert env.evaluate() == 1.0
    assert [c.by for c in env.controlled_by] == ["admin"]
    assert (env.controlled_by[0].ended_at or 0) >= env.controlled_by[0].started_at
    assert dash.hub is not None and dash.hub.capturing()  # the pool page is open: its thumbnails
    page.context.close()
    wait_for(lambda: not dash.hub.capturing(), what="capture to stop once nobody watches")
    before = dash.hub.captured
    time.sleep(2)
    assert dash.hub.captured == before  # nothing is captured while nobody watches
    api.close()


def test_runs_leaderboard_episode_compare_training(ui_farm: FarmServer, evals: dict[str, Path], browser: Any,
                                                   shots: Path) -> None:
    page = login(browser, ui_farm.url, TOKEN)
    page.goto("/ui/runs")
    rows = page.locator("#leaderboard tbody tr")
    assert rows.count() == 3  # noop, replay, hostile
    success = page.locator("#leaderboard th", has_text="success")
    success.click()  # numbers sort descending first
    assert page.locator("#leaderboard tbody tr").first.locator("td").first.inner_text().startswith("replay-mini")
    success.click()
    assert page.locator("#leaderboard tbody tr").last.locator("td").first.inner_text().startswith("replay-mini")
    page.screenshot(path=str(shots / "04-leaderboard.png"), full_page=True)

    page.click("#leaderboard a:text('replay-mini')")
    page.wait_for_selector("#tasks tbody tr")
    assert page.locator("#tasks tbody tr").count() == 3
    page.fill("[data-filter-text]", "0a02")
    assert page.locator("#tasks tbody tr:not([hidden])").count() == 1
    page.fill("[data-filter-text]", "")
    page.screenshot(path=str(shots / "05-run.png"), full_page=True)

    page.click(f"#tasks a:text('{HELLO}')")
    page.wait_for_selector("section.step img")
    imgs = page.locator("section.step .shot-frame img")
    assert imgs.count() == 2
    for i in range(imgs.count()):
        imgs.nth(i).scroll_into_view_if_needed()
        wait_for(lambda i=i: imgs.nth(i).evaluate("img => img.complete && img.naturalWidth === 1024"),
                 what="a step screenshot to load")
    assert "type “echo 'hello osfarm' > ~/Desktop/hello.txt”" in page.locator("section.step").first.inner_text()
    assert page.locator("video.recording").count() == 0  # this run was not recorded
    page.screenshot(path=str(shots / "06-episode.png"), full_page=True)

    page.goto("/ui/runs")
    page.select_option("select[name=a]", "noop-mini")
    page.select_option("select[name=b]", "replay-mini")
    page.click("form.compare button")
    page.wait_for_selector("#flipped")
    assert page.locator("#flipped tbody tr.gained").count() == 3 and page.locator("#flipped tbody tr.lost").count() == 0
    assert "+100.0" in page.locator("#domain-deltas").inner_text()
    page.screenshot(path=str(shots / "07-compare.png"), full_page=True)

    page.goto("/ui/runs")
    page.click("#training-runs a:text('train-demo')")
    page.wait_for_selector(".chart svg path")
    titles = page.locator(".chart h3").all_inner_texts()
    assert titles[:6] == ["reward", "success", "staleness", "loss", "KL", "entropy"]
    assert "held-out success" in page.locator(".chart[data-metric=success] .legend").inner_text()
    page.locator(".chart[data-metric=reward] svg").hover()
    assert "reward" in page.locator(".chart[data-metric=reward] .tip").inner_text()
    page.screenshot(path=str(shots / "08-training.png"), full_page=True)
    page.context.close()


def test_xss_and_path_traversal_probes(ui_farm: FarmServer, evals: dict[str, Path], browser: Any, shots: Path,
                                       runs_dir: Path, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.png"
    secret.write_bytes(b"HOST-SECRET")
    hostile = runs_dir / "hostile"
    (hostile / "os" / "t-xss" / "leak.png").symlink_to(secret)
    (hostile / "blobs" / "evil").symlink_to(tmp_path)
    page = login(browser, ui_farm.url, TOKEN)
    page.goto("/ui/runs")
    page.click("#leaderboard a:text('hostile')")
    page.click("#tasks a:text('t-xss')")
    page.wait_for_selector("section.step")
    assert page.evaluate("() => window.__xss") is None  # no payload ran
    assert "window.__xss=2" in page.locator("pre.response").inner_text()  # shown as text
    page.screenshot(path=str(shots / "09-xss-probe.png"), full_page=True)
    for params in ({"r": "hostile", "p": "os/t-xss/leak.png"}, {"r": "hostile", "p": "blobs/evil/host-secret.png"},
                   {"r": "hostile", "p": "../../host-secret.png"}, {"r": "..", "p": "host-secret.png"},
                   {"r": "hostile", "p": "/etc/passwd"}, {"r": "/etc", "p": "passwd"}):
        r = page.request.get("/ui/file", params=params)
        assert r.status == 404 and b"HOST-SECRET" not in r.body() and b"root:" not in r.body(), params
    page.context.close()


def test_pages_fit_a_phone(ui_farm: FarmServer, evals: dict[str, Path], browser: Any, shots: Path) -> None:
    page = login(browser, ui_farm.url, TOKEN, viewport=PHONE)
    page.wait_for_selector(".desk")
    for name, path in (("pool", "/ui/pool"), ("leaderboard", "/ui/runs"), ("run", "/ui/run?r=replay-mini")):
        page.goto(path)
        page.wait_for_load_state("load")
        width = page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= PHONE["width"] + 1, f"{name} is {width}px wide on a {PHONE['width']}px screen"
        page.screenshot(path=str(shots / f"10-phone-{name}.png"), full_page=True)
    page.click(f"#tasks a:text('{HELLO}')")
    page.wait_for_selector("section.step img")
    assert page.evaluate("() => document.documentElement.scrollWidth") <= PHONE["width"] + 1
    page.screenshot(path=str(shots / "10-phone-episode.png"), full_page=True)
    page.context.close()
