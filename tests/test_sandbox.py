"""The sandbox provider with real boxes: real namespaces, cgroups, Xvfb and the session launcher.
(What a box holds back from an agent is tests/security's.)"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from osfarm.config import FarmSettings
from osfarm.providers import make_provider
from osfarm.providers.base import DesktopHandle, DesktopSpec, ProviderError
from osfarm.providers.sandbox import SandboxProvider
from osfarm.testing.boxes import box_processes

# the shared-network path: X display numbers must not clash
SPEC = DesktopSpec(width=1024, height=768, private_network=False)
REPO = Path(__file__).resolve().parent.parent


def new_state_dir() -> Path:
    # Short and outside pytest's deep tmp_path: guest socket paths must fit in 107 bytes.
    return Path(tempfile.mkdtemp(prefix="osf-", dir="/tmp"))


def dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def wait_no_box_processes(state_dir: Path, timeout: float = 5.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := box_processes(state_dir)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return left


async def sh(handle: DesktopHandle, command: str) -> str:
    """Run a shell command inside the box through the guest's /execute route."""
    async with handle.endpoint.client(timeout=30) as c:
        r = await c.post("/execute", json={"command": command, "shell": True})
    r.raise_for_status()
    return r.json()["output"]


@pytest.fixture
async def provider():
    sd = new_state_dir()
    # warm: the reset tests below check a warm reset and a dead box's cold restart (every other
    # test's farm runs the default, cold)
    p = SandboxProvider(FarmSettings(state_dir=sd, start_timeout_s=45, reset_mode="warm"))
    yield p
    await p.stop_all()
    await p.close()
    assert not await wait_no_box_processes(sd)
    shutil.rmtree(sd, ignore_errors=True)


def test_missing_tools_are_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    settings = FarmSettings(state_dir=tmp_path / "st")
    with pytest.raises(ProviderError,
                       match=r"missing unshare, setpriv, nsenter, Xvfb: apt-get install util-linux xvfb"):
        make_provider(settings)
    for tool in ("unshare", "setpriv", "nsenter"):
        (tmp_path / tool).symlink_to(shutil.which(tool, path="/usr/bin:/bin"))
    with pytest.raises(ProviderError, match=r"missing Xvfb: apt-get install xvfb"):
        make_provider(settings)


def test_unprivileged_farm_is_told_it_needs_root(tmp_path):
    """The sandbox needs root (uid ranges, cgroups, mounts): without it, a clear error."""
    tmp_path.chmod(0o777)
    code = ("from osfarm.config import FarmSettings; from osfarm.providers import make_provider\n"
            f"make_provider(FarmSettings(state_dir='{tmp_path}/st'))")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                       capture_output=True, text=True, cwd=str(REPO), timeout=60)
    assert r.returncode != 0
    assert "the sandbox provider needs root" in r.stderr and "--provider docker" in r.stderr, r.stderr


def test_state_dir_too_long_for_sockets(tmp_path):
    with pytest.raises(ProviderError, match="too long for unix socket paths"):
        SandboxProvider(FarmSettings(state_dir=tmp_path / ("x" * 90)))


async def test_one_farm_per_state_dir(provider):
    with pytest.raises(ProviderError, match="another osfarm process is using state_dir"):
        SandboxProvider(FarmSettings(state_dir=provider.state_dir))


async def test_start_stop_leaves_no_process(provider):
    t0 = time.monotonic()
    h = await provider.start("t1", SPEC)
    print(f"\nsandbox start-to-ready: {time.monotonic() - t0:.3f}s")
    async with h.endpoint.client() as c:
        health = (await c.get("/v1/health")).json()
    assert health["screen"] == {"width": 1024, "height": 768}
    assert await provider.alive(h) is None

    pids = provider.pids(h)
    names = {psutil.Process(p).name() for p in pids}
    assert {"unshare", "Xvfb"} <= names
    rss = sum(psutil.Process(p).memory_info().rss for p in pids)
    print(f"idle desktop: {len(pids)} processes, summed RSS {rss / 2**20:.0f} MiB")
    # Everything but the outer unshare lives in the box's own pid namespace.
    ours = os.readlink("/proc/self/ns/pid")
    inner = [p for p in pids if p != h.pid]
    assert inner and all(os.readlink(f"/proc/{p}/ns/pid") != ours for p in inner)
    assert (await sh(h, "hostname")).strip() == "osfarm-t1"
    assert (await sh(h, "echo $HOME; id -un 2>/dev/null || true")).splitlines()[0] == "/home/user"
    assert (await sh(h, "grep CapEff /proc/self/status")).split()[1] == "0000000000000000"
    assert (await sh(h, "touch /usr/osf-x 2>&1 || echo ro")).strip().endswith("ro")
    assert "Permission denied" in await sh(h, "ls -A /root 2>&1")
    token = Path(h.info["dir"]) / "run" / "token"
    assert token.stat().st_mode & 0o777 == 0o400 and token.stat().st_uid == int(h.info["guest_uid"])
    # The farm's state dir (other boxes' tokens) is not in the box at all.
    assert "No such file" in await sh(h, f"ls -A {provider.state_dir} 2>&1")
    # The cgroup limits are set and the box is in them.
    assert "memory limit" not in (await provider.alive(h) or "")

    await provider.stop(h)
    assert all(dead(p) for p in pids)
    assert not box_processes(provider.state_dir)
    assert not Path(h.info["dir"]).exists()
    assert await provider.alive(h) is not None
    await provider.stop(h)  # idempotent


async def test_reset_gives_fresh_home_and_tmp_is_private(provider):
    marker = Path(tempfile.mkstemp(prefix="osf-host-marker-", dir="/tmp")[1])
    try:
        h = await provider.start("t2", SPEC)
        assert sorted((await sh(h, "ls ~")).split()) == [
            "Desktop", "Documents", "Downloads", "Music", "Pictures", "Public", "Templates", "Videos",
        ]  # fmt: skip
        await sh(h, "echo secret > ~/Desktop/note.txt; echo inside > /tmp/osf-inside.txt")
        assert (await sh(h, "cat ~/Desktop/note.txt")) == "secret\n"
        assert not Path("/tmp/osf-inside.txt").exists()
        assert (await sh(h, f"test -e {marker} && echo yes || echo no")).strip() == "no"

        t0 = time.monotonic()
        h2 = await provider.reset(h)
        print(f"\nsandbox reset: {time.monotonic() - t0:.3f}s {h2.info.get('reset_mode')}")
        # reset_mode warm (the fixture's): the same box put back (a cold restart, a new box: below)
        assert h2.id == h.id and h2.info["reset_mode"] == "warm" and "reset_fallback" not in h2.info, h2.info
        assert h2.pid == h.pid
        assert h2.endpoint.token != h.endpoint.token
        assert (await sh(h2, "ls -A ~/Desktop; ls /tmp/osf-inside.txt 2>&1 || true")).strip().endswith(
            "No such file or directory"
        )
        # The previous lessee's token no longer opens the desktop.
        async with h.endpoint.client() as c:
            assert (await c.get("/v1/health")).status_code == 401
        await provider.stop(h2)
    finally:
        marker.unlink()


async def test_dead_box_is_restarted_cold_without_a_warm_attempt(provider):
    """A box whose X server died is reset cold at once (fallback kind ``dead``), not sent a warm
    reset that would wait for warm_reset_timeout_s; the new box takes its own baseline, so the
    next reset is warm again."""
    h = await provider.start("t9", SPEC)
    assert h.info.get("warm_digest"), h.info  # the first start took the baseline (after_cold_start)
    provider._xvfb[h.id].kill()
    deadline = time.monotonic() + 10
    while await provider.alive(h) is None:
        assert time.monotonic() < deadline, "the box's death was not seen"
        await asyncio.sleep(0.05)
    h2 = await provider.reset(h)
    assert h2.info["reset_mode"] == "cold" and h2.info["reset_fallback_kind"] == "dead", h2.info
    assert h2.pid != h.pid and h2.info.get("warm_digest") and await provider.alive(h2) is None
    assert (await sh(h2, "echo ok")).strip() == "ok"
    h3 = await provider.reset(h2)
    assert h3.info["reset_mode"] == "warm" and h3.pid == h2.pid, h3.info
    await provider.stop(h3)


async def test_private_network_has_only_loopback(provider):
    h = await provider.start("t3", DesktopSpec(width=1024, height=768, private_network=True))
    lines = (await sh(h, "cat /proc/net/dev")).splitlines()[2:]
    assert [ln.split(":")[0].strip() for ln in lines] == ["lo"]
    async with h.endpoint.client() as c:
        assert (await c.get("/v1/health")).status_code == 200  # the unix socket still reaches it
    await provider.stop(h)


FARM_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from osfarm.config import FarmSettings
    from osfarm.providers.base import DesktopSpec
    from osfarm.providers.sandbox import SandboxProvider

    class Detached(SandboxProvider):
        # Simulates a box that did not die with its farm (the case reap_orphans is for).
        def box_argv(self, desktop_id, spec):
            argv = super().box_argv(desktop_id, spec)
            return [a for a in argv[argv.index("--") + 1:] if a != "--kill-child=SIGKILL"]

    async def main():
        cls = Detached if sys.argv[2] == "detached" else SandboxProvider
        p = cls(FarmSettings(state_dir=sys.argv[1], start_timeout_s=45))
        h = await p.start("k1", DesktopSpec(width=1024, height=768, private_network=False))
        print(json.dumps({"pids": p.pids(h)}), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


async def _farm_then_kill9(state_dir: Path, mode: str) -> list[int]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FARM_SCRIPT, str(state_dir), mode,
        stdout=asyncio.subprocess.PIPE, cwd=str(REPO),
    )  # fmt: skip
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        pids = json.loads(line)["pids"]
        assert len(pids) > 3
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    return pids


async def test_box_dies_with_killed_farm_and_dir_is_reaped():
    sd = new_state_dir()
    try:
        await _farm_then_kill9(sd, "normal")
        assert not await wait_no_box_processes(sd), "box survived kill -9 of its farm"
        p = SandboxProvider(FarmSettings(state_dir=sd))  # the lock died with the farm
        try:
            assert await p.reap_orphans() == 0
            assert list((sd / "sandbox").iterdir()) == []  # stale desktop dir deleted
        finally:
            await p.close()
    finally:
        shutil.rmtree(sd, ignore_errors=True)


async def test_reap_orphans_kills_surviving_box():
    sd = new_state_dir()
    try:
        pids = await _farm_then_kill9(sd, "detached")
        assert box_processes(sd), "the detached box should have outlived its farm"
        p = SandboxProvider(FarmSettings(state_dir=sd))
        try:
            assert await p.reap_orphans() == 1
            assert not await wait_no_box_processes(sd, timeout=1.0)
            # reap_orphans returns once every process of the box is gone, daemons included.
            assert [x for x in pids if not dead(x)] == []
            assert list((sd / "sandbox").iterdir()) == []
        finally:
            await p.close()
    finally:
        for proc in box_processes(sd):  # never leave the orphan behind, even on failure
            proc.kill()
        shutil.rmtree(sd, ignore_errors=True)
