"""Suite-wide checks: every test run must leave no process of ours behind."""

from __future__ import annotations

import os
import time

import psutil
import pytest

def _is_ours(p: psutil.Process) -> bool:
    """Sandbox boxes carry OSFARM_SANDBOX_DIR in their environment (set by the provider)."""
    try:
        env = p.environ()
    except psutil.Error:
        env = {}
    if any(k.startswith("OSFARM_SANDBOX") for k in env):
        return True
    return False


def _leftovers() -> list[str]:
    me = psutil.Process()
    found: dict[int, str] = {}
    for p in me.children(recursive=True):
        found[p.pid] = " ".join(p.cmdline()[:4]) if p.is_running() else ""
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        if p.pid == me.pid:
            continue
        try:
            if _is_ours(p):
                found[p.pid] = " ".join((p.info["cmdline"] or [])[:4])
        except psutil.Error:
            pass
    alive = []
    for pid, cmd in found.items():
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {cmd}")
        except psutil.Error:
            pass
    return alive


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("OSFARM_SKIP_LEAK_CHECK"):
        return
    deadline = time.monotonic() + 10
    left = _leftovers()
    while left and time.monotonic() < deadline:  # processes being torn down get a moment to exit
        time.sleep(0.2)
        left = _leftovers()
    if left:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = "processes left behind by the test run:\n  " + "\n  ".join(left)
        if tr:
            tr.write_line("LEAK CHECK FAILED: " + msg, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
