"""The desktop session launcher, with real Xvfb, openbox, D-Bus and processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from osfarm.desktop.box.process_tree import descendants
from osfarm.testing.waiting import wait_until

TOKEN = "test-token-session"
ROOT = Path(__file__).resolve().parent.parent




def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


class Desk:
    def __init__(self, proc: subprocess.Popen[bytes], tmp: Path, sock: Path | None, state_file: Path):
        self.proc, self.tmp, self.sock, self.state_file = proc, tmp, sock, state_file
        self.state: dict = {}

    def client(self) -> httpx.Client:
        if self.sock is not None:
            return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)), base_url="http://guest",
                                headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        return httpx.Client(base_url=f"http://127.0.0.1:{self.state['port']}",
                            headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

    def log(self) -> str:
        p = self.tmp / "session.log"
        return p.read_text() if p.exists() else ""


def start(tmp: Path, *extra: str, socket: bool = True, wait: bool = True) -> Desk:
    sock = tmp / "g.sock" if socket else None
    state_file = tmp / "state.json"
    env = dict(os.environ, OSFARM_GUEST_TOKEN=TOKEN)
    args = [sys.executable, "-m", "osfarm.desktop.launch.launcher", "--width", "1280", "--height", "800",
            "--state-file", str(state_file), "--home", str(tmp), "--run-dir", str(tmp / "run"), *extra]
    args += ["--socket", str(sock)] if sock else ["--port", "0"]
    log = open(tmp / "session.log", "wb")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    desk = Desk(proc, tmp, sock, state_file)
    if wait:
        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"session exited with {proc.returncode}:\n{desk.log()}")
            return state_file.exists()

        wait_until(ready, 60, "the state file")
        desk.state = json.loads(state_file.read_text())
    return desk


def stop(desk: Desk, sig: int = signal.SIGTERM) -> int:
    if desk.proc.poll() is None:
        desk.proc.send_signal(sig)
    try:
        return desk.proc.wait(20)
    except subprocess.TimeoutExpired:
        for pid in descendants(desk.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        desk.proc.kill()
        desk.proc.wait()
        raise


@pytest.fixture
def tmp() -> Path:  # short: unix socket paths are limited to 107 bytes
    d = Path(tempfile.mkdtemp(prefix="of", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_start_health_double_fork_and_clean_stop(tmp: Path) -> None:
    desk = start(tmp)
    try:
        st = desk.state
        assert st["display"].startswith(":")
        assert st["socket"] == str(tmp / "g.sock")
        assert st["dbus_address"].startswith("unix:")
        assert st["pid"] == desk.proc.pid
        for name in ("xvfb", "openbox", "tint2", "dbus", "atspi"):
            assert alive(st["pids"][name]), name
        ready = st["timings_ms"]["ready_ms"] - st["timings_ms"].get("import_ms", 0)
        print(f"\nsession start-to-ready: {st['timings_ms']} (excluding imports ~{ready:.0f} ms)")
        assert ready < 5000

        with desk.client() as c:
            h = c.get("/v1/health")
            assert h.status_code == 200, h.text
            body = h.json()
            assert body["screen"] == {"width": 1280, "height": 800}
            assert body["display"] == st["display"] and body["pid"] == desk.proc.pid
            # No token: 401 with a message
            r = httpx.Client(transport=httpx.HTTPTransport(uds=str(desk.sock)), base_url="http://guest").get("/v1/health")
            assert r.status_code == 401 and "bearer" in r.json()["detail"]

            # An app that double-forks: sh exits at once, its sleep child is orphaned.
            marker = f"{tmp}/marker"
            r = c.post("/setup/launch", json={"command": f"sh -c 'sleep 300 & echo $! > {marker}'", "shell": True})
            assert r.status_code == 200 and "launched successfully" in r.text
            wait_until(lambda: Path(marker).exists() and Path(marker).read_text().strip(), 10, "the marker")
            sleep_pid = int(Path(marker).read_text())
            # The orphan is reparented to the launcher (subreaper), not to init.
            wait_until(lambda: _ppid(sleep_pid) == desk.proc.pid, 10, "reparenting to the subreaper")
            assert sleep_pid in descendants(desk.proc.pid)
            # An orphan that exits is reaped by the launcher (no zombie pile-up).
            r = c.post("/setup/launch", json={"command": f"sh -c 'sleep 0.3 & echo $! > {marker}2'", "shell": True})
            assert r.status_code == 200
            wait_until(lambda: Path(marker + "2").exists() and Path(marker + "2").read_text().strip(), 10, "marker 2")
            short = int(Path(marker + "2").read_text())
            wait_until(lambda: not Path(f"/proc/{short}").exists(), 10, "the exited orphan to be reaped")
        before = descendants(desk.proc.pid)
        assert len(before) >= 6
        assert stop(desk) == 0
        survivors = [p for p in before if alive(p)]
        assert survivors == [], survivors
        assert not (tmp / "g.sock").exists()
        assert not Path(f"/tmp/.X{st['display'][1:]}-lock").exists()
        assert not desk.state_file.exists()
        assert "stopped: signal SIGTERM" in desk.log()
    finally:
        if desk.proc.poll() is None:
            stop(desk)


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2:].split()[1])


def _free_display() -> int:
    for n in range(60, 200):
        if not Path(f"/tmp/.X{n}-lock").exists() and not Path(f"/tmp/.X11-unix/X{n}").exists():
            return n
    raise AssertionError("no free display number")


def test_stale_x_lock_is_removed(tmp: Path) -> None:
    n = _free_display()
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = Path(f"/tmp/.X{n}-lock")
    lock.write_text(f"{dead.pid:>10}\n")
    try:
        desk = start(tmp, "--display", f":{n}", "--no-panel")
        try:
            assert desk.state["display"] == f":{n}"
            # The lock now belongs to the new Xvfb.
            assert int(lock.read_text()) == desk.state["pids"]["xvfb"]
            with desk.client() as c:
                assert c.get("/v1/health").status_code == 200
        finally:
            assert stop(desk) == 0
        assert not lock.exists()
    finally:
        lock.unlink(missing_ok=True)


def test_lock_of_live_non_x_process_is_stale(tmp: Path) -> None:
    """Pids are reused: a lock naming a live process that is not an X server is stale."""
    n = _free_display()
    lock = Path(f"/tmp/.X{n}-lock")
    lock.write_text(f"{os.getpid():>10}\n")  # pytest's python, alive and not X
    try:
        desk = start(tmp, "--display", f":{n}", "--no-wm", "--no-panel")
        try:
            assert desk.state["display"] == f":{n}"
        finally:
            stop(desk)
    finally:
        lock.unlink(missing_ok=True)


def test_xvfb_death_stops_the_session(tmp: Path) -> None:
    desk = start(tmp, "--no-panel")
    try:
        before = descendants(desk.proc.pid)
        os.kill(desk.state["pids"]["xvfb"], signal.SIGKILL)
        t0 = time.monotonic()
        rc = desk.proc.wait(15)
        took = time.monotonic() - t0
        assert rc == 1
        assert took < 5, took
        assert "Xvfb exited" in desk.log()
        assert [p for p in before if alive(p)] == []
        assert not (tmp / "g.sock").exists()
    finally:
        if desk.proc.poll() is None:
            stop(desk)


def test_tcp_loopback_port_and_sigint(tmp: Path) -> None:
    desk = start(tmp, "--no-wm", "--no-panel", socket=False)
    try:
        assert desk.state["host"] == "127.0.0.1" and desk.state["port"] > 0
        with desk.client() as c:
            assert c.get("/v1/health").json()["screen"]["width"] == 1280
            assert c.get("/v1/health", headers={"Authorization": "Bearer wrong"}).status_code == 401
    finally:
        assert stop(desk, signal.SIGINT) == 0


@pytest.mark.parametrize(
    "args, env_token, message",
    [
        (["--port", "8000", "--host", "0.0.0.0"], TOKEN, "not a loopback address"),
        (["--socket", "/tmp/x.sock"], "", "bearer token is required"),
        ([], TOKEN, "give --socket PATH or --port N"),
        (["--socket", "/tmp/" + "x" * 120], TOKEN, "unix sockets allow"),
        (["--socket", "/tmp/x.sock", "--display", "foo"], TOKEN, "--display must be"),
    ],
)
def test_bad_arguments_are_refused(args: list[str], env_token: str, message: str) -> None:
    env = dict(os.environ, OSFARM_GUEST_TOKEN=env_token)
    r = subprocess.run([sys.executable, "-m", "osfarm.desktop.launch.launcher", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert message in r.stderr


def test_token_file(tmp: Path) -> None:
    (tmp / "token").write_text(TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if k != "OSFARM_GUEST_TOKEN"}
    sock = tmp / "g.sock"
    proc = subprocess.Popen([sys.executable, "-m", "osfarm.desktop.launch.launcher", "--socket", str(sock),
                             "--token-file", str(tmp / "token"), "--no-wm", "--no-panel",
                             "--width", "800", "--height", "600", "--state-file", str(tmp / "s.json")],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    desk = Desk(proc, tmp, sock, tmp / "s.json")
    try:
        wait_until(lambda: proc.poll() is not None or desk.state_file.exists(), 60, "the state file")
        with desk.client() as c:
            assert c.get("/v1/health").json()["screen"] == {"width": 800, "height": 600}
    finally:
        assert stop(desk) == 0
