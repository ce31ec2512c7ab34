"""The dashboard without a browser: run dirs read through confinement (symlinks, '..', FIFOs),
hostile text escaped in every page, the action marks, the Wilson interval, comparisons, the
static export, and the standalone ``/ui`` app's login, cookies, CSRF and file serving over HTTP.

The browser tests (a real farm, real eval runs, Chromium) are in test_dashboard_browser.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from osfarm.dashboard import pages
from osfarm.dashboard.app import create_ui_app
from osfarm.dashboard.compare import compare
from osfarm.dashboard.confined import ConfinedDir, Refused
from osfarm.dashboard.export import export_site
from osfarm.dashboard.links import ServerLinks
from osfarm.dashboard.marks import marks_of
from osfarm.dashboard.runs import RunsRoot
from osfarm.dashboard.stats import wilson
from osfarm.testing.dashboard_runs import XSS, PNG_1x1, make_run

# -- confinement ----------------------------------------------------------------------------------


def test_confined_dir_refuses_every_way_out(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    (root / "run" / "sub").mkdir(parents=True)
    (root / "run" / "ok.txt").write_text("fine")
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    (root / "run" / "link.txt").symlink_to(secret)
    (root / "run" / "dirlink").symlink_to(tmp_path)
    (root / "run" / "inner.txt").symlink_to(root / "run" / "ok.txt")  # even a link that stays inside
    os.mkfifo(root / "run" / "fifo.png")
    d = ConfinedDir(root)
    assert d.read_text("run/ok.txt", 100) == "fine"
    for bad in ("run/link.txt", "run/dirlink/secret.txt", "run/inner.txt", "../secret.txt", "run/../../secret.txt",
                "/etc/passwd", "run/sub", "run/fifo.png", "run/missing", "run/ok.txt\x00"):
        with pytest.raises(Refused):
            d.read_bytes(bad, 1000)
    with pytest.raises(Refused, match="more than"):
        d.read_bytes("run/ok.txt", 2)
    names = {e.name for e in d.entries("run")}
    assert names == {"ok.txt", "sub"}  # symlinks and the FIFO are not listed


def test_runs_root_finds_runs_and_survives_broken_ones(tmp_path: Path) -> None:
    make_run(tmp_path / "a", "replay", {"t1": ("os", "success"), "t2": ("calc", "failure")})
    make_run(tmp_path / "team" / "b", "noop", {"t1": ("os", "failure"), "t2": ("calc", "infra_error")}, started=1.8e9)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results.json").write_text('{"tasks": [{"task_id": 5}]')  # truncated
    (tmp_path / "wrongtype").mkdir()
    (tmp_path / "wrongtype" / "results.json").write_text('{"tasks": "nope"}')
    (tmp_path / "elsewhere").symlink_to(tmp_path / "a")  # a symlinked run dir is not followed
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metrics.jsonl").write_text(
        '{"version": 1, "reward": 0.5}\nnot json\n{"version": 2, "reward": 0.75, "loss": 1e400}\n')
    root = RunsRoot(tmp_path)
    runs = {r.key: r for r in root.eval_runs()}
    assert set(runs) == {"a", "team/b", "broken", "wrongtype"}
    assert runs["broken"].error and "results.json unreadable" in runs["broken"].error
    assert runs["wrongtype"].error and "tasks" in runs["wrongtype"].error
    b = runs["team/b"]
    assert (b.summary.overall.successes, b.summary.overall.n, b.summary.infra_errors) == (0, 2, 1)
    assert runs["a"].summary.by_group["OS"].n == 1 and runs["a"].summary.by_group["Office"].n == 1
    [t] = root.training_runs()
    assert [r["version"] for r in t.rows] == [1, 2] and t.skipped_lines == 1
    data = pages.training_data(t.rows, t.eval_rows)
    reward = next(c for c in data["charts"] if c["key"] == "reward")
    assert reward["lines"][0]["points"] == [[1, 0.5], [2, 0.75]]
    json.dumps(data, allow_nan=False)  # the infinite loss is left out, the page's JSON stays valid
    with pytest.raises(Refused):
        root.eval_run("../" + tmp_path.name)
    with pytest.raises(Refused):
        root.episode("a", "no-such-episode")


def test_run_in_progress_reads_its_records(tmp_path: Path) -> None:
    make_run(tmp_path / "r", "replay", {"t1": ("os", "success"), "t2": ("os", "failure")})
    (tmp_path / "r" / "results.json").unlink()
    with (tmp_path / "r" / "episodes.jsonl").open("a") as f:
        f.write('{"schema": "osfarm.episode/9", "episode_id": "x"}\n{broken\n')
    run = RunsRoot(tmp_path).eval_run("r")
    assert run.in_progress and run.summary.overall.n == 2 and run.summary.overall.successes == 1
    assert run.error == "2 unreadable episode record(s)"


# -- what pages show ------------------------------------------------------------------------------


def test_wilson_interval() -> None:
    lo, hi = wilson(5, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.2366, 0.7634)
    assert wilson(0, 3)[0] == 0.0 and round(wilson(0, 3)[1], 4) == 0.5615
    assert wilson(3, 3)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)


def test_marks_of_computer13_and_pyautogui() -> None:
    c13 = marks_of([{"action_type": "MOVE_TO", "parameters": {"x": 5, "y": 6}},
                    {"action_type": "DRAG_TO", "parameters": {"x": 50, "y": 60}},
                    {"action_type": "CLICK", "parameters": {"button": "right"}},
                    {"action_type": "TYPING", "parameters": {"text": "hi"}},
                    {"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "s"]}}])
    assert [(m.kind, m.label) for m in c13] == [("point", "move"), ("drag", "drag"), ("point", "right click"),
                                                 ("text", "type “hi”"), ("keys", "keys ctrl+s")]
    assert (c13[1].x, c13[1].y, c13[1].x2, c13[1].y2) == (5, 6, 50, 60)
    assert (c13[2].x, c13[2].y) == (50, 60)  # a click without coordinates lands where the pointer is
    code = marks_of(["import pyautogui\npyautogui.click(100, 200)\npyautogui.dragTo(x=300, y=400, duration=1)\n"
                     "pyautogui.write('ls -l\\n')\npyautogui.hotkey('ctrl', 'c')\n"
                     "for i in range(3): pyautogui.press(k)\n",
                     "DONE"])
    assert [(m.kind, m.label) for m in code] == [("point", "click"), ("drag", "drag"), ("text", "type “ls -l⏎”"),
                                                  ("keys", "keys ctrl+c"), ("special", "DONE")]
    assert marks_of(["this is not python ((("]) == []
    marks_of(["pyautogui.click(" + "1" * 5000 + ", 2)", "pyautogui.click(" * 400])  # no crash on odd code


def test_compare_counts_flips_on_common_tasks_only(tmp_path: Path) -> None:
    make_run(tmp_path / "a", "x", {"t1": ("os", "success"), "t2": ("os", "failure"), "t3": ("calc", "success"),
                                   "t4": ("calc", "success")})
    make_run(tmp_path / "b", "y", {"t1": ("os", "failure"), "t2": ("os", "success"), "t3": ("calc", "success"),
                                   "t5": ("calc", "success")})
    root = RunsRoot(tmp_path)
    c = compare(root.eval_run("a"), root.eval_run("b"))
    assert c.common == 3 and [f.task_id for f in c.gained] == ["t2"] and [f.task_id for f in c.lost] == ["t1"]
    assert c.only_a == ["t4"] and c.only_b == ["t5"]
    assert {d.domain: (d.n, d.delta) for d in c.domains} == {"calc": (1, 0.0), "os": (2, 0.0)}


def test_every_page_escapes_hostile_text(tmp_path: Path) -> None:
    """Task ids, domains, agent names, errors and model responses come from run dirs: none of it
    may become markup, in the served pages or the exported site."""
    task = 'x"><script>alert(1)</script>'
    make_run(tmp_path / "evil", XSS, {task: ("<b>os</b>", "success"), "t2": ("os", "infra_error")},
             response="</pre><script>alert(2)</script>",
             actions=[{"action_type": "TYPING", "parameters": {"text": XSS}}])
    make_run(tmp_path / "other", "y", {task: ("<b>os</b>", "failure")})
    (tmp_path / "train").mkdir()
    row = {"version": 1, "</script><script>alert(3)//": 1.0}
    (tmp_path / "train" / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    root = RunsRoot(tmp_path)
    frame = pages.Frame(ServerLinks(), has_runs=True)
    eid = root.eval_run("evil").rows[0].episode_id
    html = [pages.leaderboard(root, frame), pages.run_page(root, frame, "evil"),
            pages.episode_page(root, frame, "evil", eid), pages.compare_page(root, frame, "evil", "other"),
            pages.training_page(root, frame, "train")]
    for h in html:
        assert "<script>alert" not in h and "<img src=x" not in h and "<b>os</b>" not in h
        # the only script elements are ours (src under /ui/static) or inert JSON data
        for tag in re.findall(r"<script[^>]*>", h):
            assert 'src="/ui/static/' in tag or 'type="application/json"' in tag, tag
    assert "&lt;script&gt;alert" in html[2]  # shown as text
    data = re.search(r'<script type="application/json" id="training-data">(.*?)</script>', html[4], re.S)
    assert data is not None and "</script" not in data.group(1)
    assert json.loads(data.group(1))["charts"]
    report = export_site(tmp_path, tmp_path.parent / "site")
    for p in (tmp_path.parent / "site").rglob("*.html"):
        text = p.read_text()
        assert "<script>alert" not in text and "<img src=x" not in text, p
    assert report.pages >= 6


def test_export_copies_only_confined_files(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    ids = make_run(runs / "r", "replay", {"t1": ("os", "success")})
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"host file")
    # a hostile run: its traj.jsonl names a symlinked "screenshot" and a path out of the run
    (runs / "r" / "os" / "t1" / "evil.png").symlink_to(secret)
    (runs / "r" / "os" / "t1" / "traj.jsonl").write_text(
        json.dumps({"step_num": 1, "screenshot_file": "evil.png"}) + "\n"
        + json.dumps({"step_num": 2, "screenshot_file": "../../../../secret.png"}) + "\n")
    site = tmp_path / "site"
    report = export_site(runs, site)
    copied = [p for p in site.rglob("*") if p.is_file()]
    assert not any(p.is_symlink() for p in site.rglob("*"))
    assert all(p.read_bytes() != b"host file" for p in copied)
    assert any("evil.png" in s for s in report.skipped)
    assert all(p.suffix in (".html", ".css", ".js", ".png", ".txt", ".mp4") for p in copied)
    assert ids["t1"]  # the episode page was still written
    assert len(list((site / "runs").glob("*/episodes/*.html"))) == 1


# -- the standalone app over HTTP -----------------------------------------------------------------


class _Server:
    def __init__(self, app: Any):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    log_config=None, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the dashboard did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    runs = tmp_path_factory.mktemp("uiruns")
    make_run(runs / "r1", "replay", {"t1": ("os", "success"), "t2": ("os", "infra_error")})
    (tmp_path_factory.getbasetemp() / "outside.png").write_bytes(b"secret")
    (runs / "r1" / "os" / "t1" / "leak.png").symlink_to(tmp_path_factory.getbasetemp() / "outside.png")
    (runs / "r1" / "os" / "t1" / "page.html").write_text("<script>alert(1)</script>")
    token = "ui-test-token-0123456789"
    with _Server(create_ui_app(runs, token=token)) as url:
        yield url, token, runs


def test_ui_needs_a_login_and_sets_a_strict_cookie(ui: tuple[str, str, Path]) -> None:
    url, token, _ = ui
    with httpx.Client(base_url=url) as c:
        r = c.get("/ui/runs", headers={"Accept": "text/html"})
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/login?next=")
        assert c.get("/ui/runs").status_code == 401  # a script gets the API's 401
        assert c.get("/ui/static/ui.css").status_code == 200  # public: the login page needs it
        assert c.get("/ui/static/app.py").status_code == 404  # only the packaged assets
        bad = c.post("/ui/login", data={"token": "wrong", "next": "/ui/runs"})
        assert bad.status_code == 401 and "unknown token" in bad.text
        foreign = c.post("/ui/login", data={"token": token}, headers={"Origin": "http://evil.example"})
        assert foreign.status_code == 403
        ok = c.post("/ui/login", data={"token": token, "next": "//evil.example/x"})
        assert ok.status_code == 303 and ok.headers["location"] == "/ui/"  # no open redirect
        cookie = ok.headers["set-cookie"]
        for attr in ("HttpOnly", "SameSite=Strict", "Path=/ui"):
            assert attr in cookie
        page = c.get("/ui/runs")
        assert page.status_code == 200 and "r1" in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
        assert csrf is not None
        assert c.post("/ui/logout", data={"csrf": "0" * 40}).status_code == 403
        out = c.post("/ui/logout", data={"csrf": csrf.group(1)})
        assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]
    # the cookie is accepted under /ui only: not as a credential elsewhere
    with httpx.Client(base_url=url, cookies={"osfarm_ui": token}) as c:
        assert c.get("/ui/runs").status_code == 200
        assert c.get("/v1/pool").status_code == 401 and c.get("/docs").status_code == 401
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
        assert c.get("/ui/run", params={"r": "r1"}).status_code == 200  # scripts use the header


def test_ui_serves_run_files_confined(ui: tuple[str, str, Path]) -> None:
    url, token, runs = ui
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
        ok = c.get("/ui/file", params={"r": "r1", "p": "os/t1/step_1_x.png"})
        assert ok.status_code == 200 and ok.headers["content-type"] == "image/png" and ok.content == PNG_1x1
        assert ok.headers["x-content-type-options"] == "nosniff" and "sandbox" in ok.headers["content-security-policy"]
        part = c.get("/ui/file", params={"r": "r1", "p": "os/t1/step_1_x.png"}, headers={"Range": "bytes=0-7"})
        assert part.status_code == 206 and part.content == PNG_1x1[:8]
        for key, rel in (("r1", "os/t1/leak.png"), ("r1", "../../outside.png"), ("..", "outside.png"),
                         ("r1", "/etc/passwd"), ("/etc", "passwd")):
            r = c.get("/ui/file", params={"r": key, "p": rel})
            assert r.status_code == 404 and b"secret" not in r.content, (key, rel, r.text)
        html = c.get("/ui/file", params={"r": "r1", "p": "os/t1/page.html"})
        assert html.status_code == 403  # never HTML from a run dir
        a11y_path = next((runs / "r1" / "blobs").rglob("*.xml")).relative_to(runs / "r1").as_posix()
        a11y = c.get("/ui/file", params={"r": "r1", "p": a11y_path})
        assert a11y.headers["content-type"].startswith("text/plain") and b"<script>" in a11y.content
        assert c.get("/ui/run", params={"r": "../x"}).status_code == 404
        assert c.get("/ui/episode", params={"r": "r1", "e": "nope"}).status_code == 404


def test_report_export_command(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from osfarm.cli import app

    make_run(tmp_path / "runs" / "a", "replay", {"t1": ("os", "success")})
    res = CliRunner().invoke(app, ["report", "export", str(tmp_path / "runs"), "--out", str(tmp_path / "site")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "static" / "ui.js").is_file()
    inside = CliRunner().invoke(app, ["report", "export", str(tmp_path / "runs"), "--out",
                                      str(tmp_path / "runs" / "s")])
    assert inside.exit_code == 2 and "inside the runs dir" in inside.output
    missing = CliRunner().invoke(app, ["report", "export", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no such directory" in missing.output
    shutil.rmtree(tmp_path / "site")


def test_take_over_input_is_mouse_and_keyboard_only() -> None:
    from osfarm.dashboard.control import control_actions
    from osfarm.schema.actions import ActionError

    ok = control_actions([{"action_type": "MOVE_TO", "parameters": {"x": 5, "y": 6}},
                          {"action_type": "TYPING", "parameters": {"text": "hi"}},
                          {"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "c"]}}], (100, 100))
    assert [a["action_type"] for a in ok] == ["MOVE_TO", "TYPING", "HOTKEY"]
    for bad in (["import os; os.system('id')"], [{"code": "print(1)"}], [{"action_type": "DONE"}],
                [{"action_type": "CLICK", "parameters": {"x": 500, "y": 5}}],  # off the 100x100 screen
                [{"action_type": "PRESS", "parameters": {"key": "nosuchkey"}}], [], "MOVE_TO",
                [{"action_type": "MOVE_TO", "parameters": {"x": 1, "y": 1}}] * 201):
        with pytest.raises(ActionError):
            control_actions(bad, (100, 100))


def test_websockets_need_a_token_too(ui: tuple[str, str, Path]) -> None:
    """The auth middleware refuses a WebSocket handshake without a token (before any route)."""
    import asyncio

    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    url, _token, _ = ui

    async def handshake(headers: dict[str, str]) -> int:
        try:
            async with connect(url.replace("http", "ws") + "/ui/desktops/d1/live", additional_headers=headers):
                return 101
        except InvalidStatus as e:
            return e.response.status_code

    assert asyncio.run(handshake({})) == 403
    assert asyncio.run(handshake({"Cookie": "osfarm_ui=wrong"})) == 403
    assert asyncio.run(handshake({"Authorization": "Bearer wrong"})) == 403
    # (an accepted handshake with a token is covered on a real farm: test_dashboard_browser.py)


def test_a_farm_serves_the_dashboard_through_its_dependencies(tmp_path: Path) -> None:
    """The farm app with ``farm_ui``: the dashboard's routers find their state on ``app.state``
    (pages, the token table of the login form, the farm's pool for the SSE stream and the live
    view's WebSocket) and answer HTML error pages, not the farm's JSON. The app runs without its
    lifespan: the farm is "starting" (no pool), and no desktop is started."""
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from osfarm.config import FarmSettings
    from osfarm.dashboard.app import farm_ui
    from osfarm.farm.api import create_app

    token = "farm-ui-test-token-0123456789"
    app = create_app(FarmSettings(token=token, state_dir=tmp_path / "state"), ui=farm_ui(None))
    with _Server(app) as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
            home = c.get("/ui/")
            assert home.status_code == 200 and "script-src 'self'" in home.headers["content-security-policy"]
            assert c.get("/ui/pool").status_code == 200
            none = c.get("/ui/runs")  # a farm without ui_runs_dir has no run pages
            assert none.status_code == 404 and "no runs root" in none.text
            assert none.headers["content-type"].startswith("text/html") and none.headers["x-frame-options"] == "DENY"
            gone = c.get("/ui/desktops/d1")
            assert gone.status_code == 404 and "no desktop &#39;d1&#39; you may watch" in gone.text
            with c.stream("GET", "/ui/pool/events") as events:  # the pool is not up: the stream says so and ends
                assert events.headers["content-type"].startswith("text/event-stream")
                assert "event: error" in events.read().decode()
            assert not any(path.startswith("/ui") for path in c.get("/openapi.json").json()["paths"])
        with httpx.Client(base_url=url) as c:  # the login form checks the farm's own token table
            assert c.post("/ui/login", data={"token": "wrong"}).status_code == 401
            assert c.post("/ui/login", data={"token": token}).status_code == 303

    # The live view's WebSocket gets the farm's state through the same dependencies. Closed before
    # it is accepted, over uvicorn it is a bare 403 (like a missing token), so the close code that
    # says why is read in process, on the same app (no lifespan: still no pool).
    with pytest.raises(WebSocketDisconnect) as closed:
        with TestClient(app).websocket_connect("/ui/desktops/d1/live",
                                               headers={"Authorization": f"Bearer {token}"}) as ws:
            ws.receive()
    assert closed.value.code == 4404 and "no desktop 'd1'" in closed.value.reason


def test_control_is_of_one_lease() -> None:
    """Control taken over lease A ends with A: when the desktop serves lease B, nobody controls
    it, another admin may take it, and A's span is closed."""
    from osfarm.dashboard.control import ControlRefused, ControlRegistry
    from osfarm.farm.pool import Lease
    from osfarm.providers.base import GuestEndpoint

    def lease(lid: str) -> Lease:
        return Lease(id=lid, desktop_id="d1", owner=None, created_at=0, expires_at=1e12, ttl_s=60,
                     endpoint=GuestEndpoint(base_url="http://x", token="t"), screen=(100, 100), wait_s=0)

    reg, alice, bob = ControlRegistry(), object(), object()
    a, b = lease("A"), lease("B")
    with pytest.raises(ControlRefused, match="leased"):
        reg.take("d1", None, "alice", alice)
    reg.take("d1", a, "alice", alice)
    with pytest.raises(ControlRefused, match="alice controls"):
        reg.take("d1", a, "bob", bob)
    assert reg.lease_of("d1") == "A" and a.control[0].ended_at is None
    reg.take("d1", b, "bob", bob)  # A ended, the desktop now serves B
    assert a.control[0].ended_at is not None and reg.holder("d1") == "bob" and reg.lease_of("d1") == "B"
    assert not reg.held_by("d1", alice) and not reg.release("d1", alice)
    assert reg.release("d1", bob) and b.control[0].ended_at is not None and reg.holder("d1") is None


def test_a_take_over_is_in_the_episode_record(tmp_path: Path) -> None:
    """What TaskEnv read from the lease at release reaches the record and the results row."""
    from osfarm.runner.episode import EpisodeResult
    from osfarm.runner.results import write_task
    from osfarm.schema.episode import check_record
    from osfarm.schema.lease import ControlInfo
    from osfarm.stream.blobs import LocalBlobStore
    from osfarm.tasks.model import parse_task

    task = parse_task({"id": "t1", "instruction": "x", "config": [], "evaluator": {"func": "infeasible"}}, file="t")
    spans = [{"by": "admin", "started_at": 10.0, "ended_at": 25.0}]
    res = EpisodeResult(task=task, status="success", score=1.0, error=None, episode_id="e1", attempt=1,
                        infra_retries=0, steps=[], started_at=1.0, finished_at=30.0, agent="replay",
                        controlled_by=[ControlInfo.model_validate(s) for s in spans])
    records: list[dict[str, Any]] = []
    row = write_task(tmp_path, res, "run", LocalBlobStore(tmp_path), emit=records.append)
    assert check_record(records[0])["controlled_by"] == spans and row["controlled_by"] == ["admin"]
    assert pages.takeovers(records[0]) == [("admin", "15 s")]
