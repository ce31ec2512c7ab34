"""The Python clients and the ``osfarm`` CLI against a real farm (uvicorn on a loopback port,
real sandbox desktops). CLI commands run as subprocesses, as a user would run them."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image
from typer.testing import CliRunner

from osfarm.cli import app
from osfarm.client import (
    AsyncFarm,
    AuthError,
    Farm,
    FarmUnreachableError,
    ForeignLeaseError,
    InvalidRequestError,
    LeaseGoneError,
    UnknownDesktopError,
    screenshot_bytes,
    screenshot_image,
)
from osfarm.farm.server import FarmServer
from osfarm.schema.actions import Click, ClickParams
from osfarm.schema.observation import ObserveOptions
from osfarm.testing.farms import H, W

OSFARM = [sys.executable, "-m", "osfarm.cli"]


def cli_env(farm: FarmServer | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OSFARM_")}
    if farm is not None:
        env.update(OSFARM_URL=farm.url, OSFARM_TOKEN=farm.token)
    env.update(extra)
    return env


def osfarm(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*OSFARM, *args], env=env, capture_output=True, text=True, timeout=timeout)


# ---- sync client ------------------------------------------------------------------------------


def test_sync_client_end_to_end(farm: FarmServer) -> None:
    with Farm(farm.url, farm.token) as f:
        assert f.healthz().status == "ok"
        assert f.pool().pool_max == farm.settings.pool_max
        with f.lease(owner="carol", ttl_s=60) as desk:
            assert desk.screen == (W, H)
            res = desk.step(Click(action_type="CLICK", parameters=ClickParams(x=200, y=150)),
                            observe={"format": "jpeg", "scale": 0.5})  # fmt: skip
            assert res.results[0].ok and res.observation is not None
            img = screenshot_image(res.observation)
            assert img.format == "JPEG" and img.size == (W // 2, H // 2)
            obs = desk.observe(screenshot=False)
            assert obs.cursor == (200, 150) and obs.screenshot is None
            with pytest.raises(ValueError):
                screenshot_bytes(obs)
            obs = desk.observe(format="png", scale=0.25)
            assert screenshot_image(obs).size == (W // 4, H // 4)
            png = desk.screenshot()
            assert Image.open(io.BytesIO(png)).size == (W, H)
            res = desk.step(["import pyautogui", {"action_type": "MOVE_TO", "parameters": {"x": 9, "y": 8}}],
                            observe=ObserveOptions(screenshot=False))  # fmt: skip
            assert [r.ok for r in res.results] == [True, True] and res.observation.cursor == (9, 8)
            before = desk.info.expires_at
            assert desk.heartbeat(ttl_s=90).expires_at > before
            out = desk.guest("POST", "/execute", json={"command": ["echo", "via guest"]}).json()
            assert out["output"] == "via guest\n"

            with pytest.raises(InvalidRequestError) as e:
                desk.step({"action_type": "CLICK", "parameters": {"x": W + 1, "y": 0}})
            assert e.value.status == 422 and "actions.0.parameters.x" in e.value.detail
            with pytest.raises(ForeignLeaseError):
                f.desktop(desk.id, owner="mallory")
            lease_id = desk.id
        # closed by the context manager: the lease is gone, closing again is fine
        with pytest.raises(LeaseGoneError) as e:
            f.desktop(lease_id)
        assert e.value.status == 410 and "released" in e.value.detail
        desk.close()
        with pytest.raises(UnknownDesktopError):
            f.desktop("nope")
    with Farm(farm.url, "bad-token") as bad, pytest.raises(AuthError) as e:
        bad.pool()
    assert e.value.detail == "invalid token"
    with Farm("http://127.0.0.1:9", "x") as dead, pytest.raises(FarmUnreachableError):
        dead.pool()


def test_sync_background_heartbeat_keeps_lease(farm: FarmServer) -> None:
    with Farm(farm.url, farm.token) as f:
        desk = f.lease(ttl_s=1.0, heartbeat=0.2)
        try:
            end = time.monotonic() + 2.5  # well past the 1 s TTL
            while time.monotonic() < end:
                assert f.desktop(desk.id).id == desk.id
                time.sleep(0.1)
        finally:
            desk.close()
        assert desk._hb_thread is None


# ---- async client -----------------------------------------------------------------------------


async def test_async_client_end_to_end(farm: FarmServer) -> None:
    async with AsyncFarm(farm.url, farm.token) as f:
        assert (await f.pool()).pool_min == farm.settings.pool_min
        async with await f.lease(ttl_s=1.0, heartbeat=0.2) as desk:
            res = await desk.step({"action_type": "MOVE_TO", "parameters": {"x": 300, "y": 301}}, observe=True)
            assert res.results[0].ok
            assert screenshot_image(res.observation).size == (W, H)
            obs = await desk.observe(screenshot=False, windows=True)
            assert obs.cursor == (300, 301) and obs.windows is not None
            jpeg = await desk.screenshot("jpeg", 0.5)
            assert Image.open(io.BytesIO(jpeg)).size == (W // 2, H // 2)
            r = await desk.guest("GET", "/platform")
            assert r.text == "Linux"
            # background heartbeat keeps the 1 s lease alive
            await asyncio.sleep(1.5)
            assert (await f.desktop(desk.id)).id == desk.id
            with pytest.raises(InvalidRequestError) as e:
                await desk.step({"action_type": "JUMP"})
            assert "actions.0.action_type" in e.value.detail
            lease_id = desk.id
        with pytest.raises(LeaseGoneError):
            await f.desktop(lease_id)


# ---- CLI --------------------------------------------------------------------------------------

COMMANDS = [
    [], ["serve"], ["demo"], ["desktop"], ["desktop", "ls"], ["desktop", "lease"],
    ["desktop", "screenshot"], ["desktop", "exec"], ["desktop", "release"], ["desktop", "run"],
]  # fmt: skip


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "osfarm")
def test_help_on_every_command(cmd: list[str]) -> None:
    r = CliRunner().invoke(app, [*cmd, "--help"])
    assert r.exit_code == 0, r.output
    assert "usage" in r.output.lower()


def test_console_script_is_installed() -> None:
    exe = Path(sys.executable).parent / "osfarm"
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "serve" in r.stdout


def test_cli_desktop_commands(farm: FarmServer, tmp_path: Path) -> None:
    env = cli_env(farm)
    r = osfarm("desktop", "ls", env=env)
    assert r.returncode == 0, r.stderr
    assert "pool_max" in r.stdout and "state" in r.stdout

    r = osfarm("desktop", "lease", "--ttl", "60", "--owner", "dave", env=env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    lid = info["id"]
    assert info["owner"] == "dave" and info["screen"] == {"width": W, "height": H}

    shot = tmp_path / "shots" / "s.jpg"
    r = osfarm("desktop", "screenshot", lid, "-o", str(shot), "--format", "jpeg", "--scale", "0.5", "--owner", "dave",
               env=env)
    assert r.returncode == 0, r.stderr
    img = Image.open(shot)
    assert img.format == "JPEG" and img.size == (W // 2, H // 2)

    r = osfarm("desktop", "exec", lid, "--owner", "dave", "--", "sh", "-c", "echo out; echo err >&2; exit 3", env=env)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "out\n" and "err" in r.stderr
    r = osfarm("desktop", "exec", lid, "--owner", "dave", "--shell", "--", "echo", "$HOME", env=env)
    assert r.returncode == 0 and r.stdout == "/home/user\n", r.stderr

    r = osfarm("desktop", "exec", lid, "--owner", "eve", "--", "true", env=env)
    assert r.returncode == 1 and "403" in r.stderr and "another owner" in r.stderr

    r = osfarm("desktop", "release", lid, env=env)
    assert r.returncode == 0, r.stderr
    r = osfarm("desktop", "release", lid, env=env)
    assert r.returncode == 1 and "410" in r.stderr and "Traceback" not in r.stderr

    r = osfarm("desktop", "ls", env=cli_env(None, OSFARM_URL=farm.url))
    assert r.returncode == 1 and "token" in r.stderr and "Traceback" not in r.stderr
    r = osfarm("desktop", "ls", "--url", farm.url, "--token", "wrong", env=cli_env(None))
    assert r.returncode == 1 and "invalid token" in r.stderr


def test_cli_takes_lease_ids_that_begin_with_dash(
    farm: FarmServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every command that takes a lease id takes any id, also one that begins with '-' (older farms
    made one in 64 so): written in place as any other id, or after '--'. The farm runs in this
    process, so the next lease id is pinned here to one that starts with '-'."""
    from osfarm.farm import pool as farm_pool

    env = cli_env(farm)
    for lid in ("-Ao" + "x" * 21, "--Shell" + "y" * 17):  # looks like a short option; like a long one
        monkeypatch.setattr(farm_pool, "new_lease_id", lambda lid=lid: lid)
        with Farm(farm.url, farm.token) as f:
            assert f.lease(owner="dash", ttl_s=60).id == lid
        shot = tmp_path / f"{lid}.png"
        r = osfarm("desktop", "screenshot", lid, "--owner", "dash", "-o", str(shot), env=env)
        assert r.returncode == 0, r.stderr
        assert Image.open(shot).size == (W, H)
        r = osfarm("desktop", "screenshot", "--owner", "dash", "-o", str(shot), "--", lid, env=env)
        assert r.returncode == 0, r.stderr
        r = osfarm("desktop", "exec", lid, "--owner", "dash", "--", "echo", "-n", "in place", env=env)
        assert (r.returncode, r.stdout) == (0, "in place"), r.stderr
        r = osfarm("desktop", "exec", "--owner", "dash", "--", lid, "echo", "after --", env=env)
        assert (r.returncode, r.stdout) == (0, "after --\n"), r.stderr
        r = osfarm("desktop", "release", lid, "--owner", "dash", env=env)
        assert r.returncode == 0 and f"released {lid}" in r.stdout, r.stderr
        r = osfarm("desktop", "release", "--", lid, env=env)
        assert r.returncode == 1 and "410" in r.stderr, r.stderr
    # An id the farm never made reaches it as written: its 404 names the id.
    r = osfarm("desktop", "release", "-Zz9", env=env)
    assert r.returncode == 1 and "404" in r.stderr and "'-Zz9'" in r.stderr, r.stderr
    assert "No such option" not in r.stderr


@pytest.mark.parametrize(
    "text,line,needle",
    [
        ("host: 127.0.0.1\nport: 8000\npool_min: -1\n", 3, "pool_min"),
        ("# farm\nwidth: 1024\nbogus_key: 1\n", 3, "unknown setting 'bogus_key'"),
        ("port: 8000\npool_max: [1\n", 3, "invalid YAML"),
    ],
)  # fmt: skip
def test_serve_bad_config_prints_file_line(tmp_path: Path, text: str, line: int, needle: str) -> None:
    cfg = tmp_path / "farm.yaml"
    cfg.write_text(text)
    r = osfarm("serve", "--config", str(cfg), env=cli_env(None), timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"{cfg}:{line}:" in r.stderr and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_serve_refuses_remote_host_and_bad_env(tmp_path: Path) -> None:
    r = osfarm("serve", "--host", "0.0.0.0", env=cli_env(None), timeout=60)
    assert r.returncode == 2 and "--allow-remote" in r.stderr and "Traceback" not in r.stderr
    r = osfarm("serve", env=cli_env(None, OSFARM_POOL_MAX="zero"), timeout=60)
    assert r.returncode == 2 and "pool_max" in r.stderr and "OSFARM_POOL_MAX" in r.stderr


def test_serve_without_box_tools_says_how_to_fix(tmp_path: Path) -> None:
    env = cli_env(None, PATH=str(tmp_path), OSFARM_STATE_DIR=str(tmp_path / "s"))
    r = osfarm("serve", "--port", "0", env=env, timeout=60)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "missing unshare" in r.stderr and "apt-get install util-linux xvfb" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_runs_and_stops_cleanly() -> None:
    with tempfile.TemporaryDirectory(prefix="osfs") as d:
        env = cli_env(None, OSFARM_PRIVATE_NETWORK="true")
        proc = subprocess.Popen(
            [*OSFARM, "serve", "--port", "0", "--pool-size", "1", "--pool-max", "1", "--state-dir", d,
             "--token", "serve-tok"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            url = None
            assert proc.stdout is not None
            for line in proc.stdout:  # the banner prints the URL before serving
                if "export OSFARM_URL=" in line:
                    url = line.split("OSFARM_URL=")[1].split()[0]
                    assert "OSFARM_TOKEN=serve-tok" in line
                    break
            assert url, "no URL printed"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, "serve did not come up"
                time.sleep(0.05)
            with Farm(url, "serve-tok") as f:
                with f.lease(wait_s=60) as desk:
                    assert len(desk.screenshot()) > 1000
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
        assert proc.returncode == 0, err
        assert "level=info" in err and "lease granted" in err  # structured logs


def test_demo_produces_png(tmp_path: Path) -> None:
    """The main job as a new user runs it: on the default desktop (GNOME), in Ubuntu's terminal."""
    with tempfile.TemporaryDirectory(prefix="osfd") as d:
        env = cli_env(None, OSFARM_STATE_DIR=d, OSFARM_PRIVATE_NETWORK="true", OSFARM_WIDTH=str(W),
                      OSFARM_HEIGHT=str(H))
        r = osfarm("demo", "--out", str(tmp_path / "runs"), env=env, timeout=240)
    assert r.returncode == 0, (r.stdout, r.stderr)
    pngs = list((tmp_path / "runs").glob("*/screenshot.png"))
    assert len(pngs) == 1
    img = Image.open(pngs[0])
    assert img.format == "PNG" and img.size == (W, H)
    timings = json.loads((pngs[0].parent / "timings.json").read_text())
    assert {"lease a desktop", "launch gnome-terminal", "screenshot", "release", "total"} <= set(timings)
    assert "screenshot:" in r.stdout
