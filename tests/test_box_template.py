"""``sandbox_start: fork``: sandbox boxes forked from the box template (osfarm/desktop/launch/box_zygote.py,
osfarm/providers/box_template.py), with real namespaces, cgroups, Xvfb and the launcher."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from test_sandbox import SPEC, _farm_then_kill9, dead, new_state_dir, sh, wait_no_box_processes

from osfarm.config import FarmSettings
from osfarm.desktop.box.box_init import PLAN_MAX_BYTES, read_plan
from osfarm.desktop.box.process_tree import children, descendants
from osfarm.desktop.warm.fingerprint_diff import differences
from osfarm.providers.base import DesktopHandle
from osfarm.providers.box_template import TemplateError
from osfarm.providers.sandbox import SandboxProvider

RANDOM = "import random, secrets; print(random.random(), secrets.token_hex(8))"


@pytest.fixture
async def forking():
    sd = new_state_dir()
    p = SandboxProvider(FarmSettings(state_dir=sd, start_timeout_s=45, reset_mode="cold", sandbox_start="fork"))
    yield p
    await p.stop_all()
    await p.close()
    assert not await wait_no_box_processes(sd)
    shutil.rmtree(sd, ignore_errors=True)


def _box_init(p: SandboxProvider, h: DesktopHandle) -> int:
    """The box's PID 1 (the launcher), seen from the host."""
    (pid,) = children(p._procs[h.id].pid)
    return pid


def _ns(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


async def test_forked_desktop_works(forking: SandboxProvider) -> None:
    h = await forking.start("fk1", SPEC)
    assert h.info["start"] == "fork" and "start_fallback" not in h.info
    template = forking._template
    assert template is not None and template.info["threads"] == 1
    assert template.info["session"].startswith("/opt/osfarm/lib/osfarm/desktop/"), template.info
    async with h.endpoint.client(timeout=30) as c:
        health = (await c.get("/v1/health")).json()
        assert health["pid"] == 1 and health["screen"] == {"width": 1024, "height": 768}
        shot = await c.get("/v1/screenshot")
        assert shot.status_code == 200 and shot.content.startswith(b"\x89PNG")
        r = await c.post("/v1/step", json={"actions": [{"action_type": "MOVE_TO", "parameters": {"x": 101, "y": 57}}],
                                           "observe": {"screenshot": True, "a11y": False}})
        assert r.status_code == 200, r.text
        step = r.json()
        assert step["results"][0]["ok"] and step["observation"]["cursor"] == [101, 57]
        assert base64.b64decode(step["observation"]["screenshot"]).startswith(b"\x89PNG")
        # a11y: the registry comes up a little after the guest answers; gi is imported lazily (the
        # first a11y call), from the box's paths
        deadline = time.monotonic() + 20
        while not (await c.get("/v1/health")).json()["a11y_bus"] and time.monotonic() < deadline:
            await asyncio.sleep(0.3)
        obs = (await c.get("/v1/observation", params={"screenshot": False, "a11y": True})).json()
        assert obs["a11y"].startswith("<desktop-frame"), obs["a11y"][:200]
    # the box's processes: PID 1 and every descendant as the guest uid (or the agent's range), in
    # the box's namespaces, not the template's or the host's
    top = forking._procs[h.id]
    init = _box_init(forking, h)
    guest_uid = int(h.info["guest_uid"])
    assert psutil.Process(init).uids() == (guest_uid, guest_uid, guest_uid)
    assert psutil.Process(top.pid).ppid() == template.pid
    for kind in ("pid", "mnt", "ipc", "uts"):
        assert _ns(init, kind) != _ns(template.pid, kind) and _ns(init, kind) != _ns(os.getpid(), kind), kind
    procs = [psutil.Process(p) for p in descendants(init)]
    assert procs and all(_ns(p.pid, "pid") == _ns(init, "pid") for p in procs)
    agent_base = int(h.info["agent_uid"]) - 1000
    assert all(p.uids().real == guest_uid or agent_base <= p.uids().real < agent_base + 65536 for p in procs)
    # module paths are the box's: openbox's rc file (session.ASSETS, from __file__) and the guest's
    wm = next(p for p in procs if p.name() == "openbox")
    rc = wm.cmdline()[wm.cmdline().index("--config-file") + 1]
    assert rc.startswith("/opt/osfarm/lib/osfarm/desktop/assets/"), rc
    assert "osfarm" in (await sh(h, "echo osfarm")), "the agent's shell runs"


async def test_two_forked_boxes_are_separate(forking: SandboxProvider) -> None:
    a, b = await asyncio.gather(forking.start("fka", SPEC), forking.start("fkb", SPEC))
    assert a.endpoint.token != b.endpoint.token
    ia, ib = _box_init(forking, a), _box_init(forking, b)
    for kind in ("pid", "mnt", "ipc", "uts", "net"):
        assert _ns(ia, kind) != _ns(ib, kind) or (kind == "net" and not SPEC.private_network), kind
    # the guests' own random names (tempfile, in the forked launcher's process) differ
    runs = [json.loads((Path(h.info["dir"]) / "run" / "state.json").read_text())["run_dir"] for h in (a, b)]
    assert runs[0] != runs[1], runs


def test_random_is_reseeded_in_a_forked_template_child() -> None:
    """What forked boxes rely on: ``random`` re-seeds itself in a forked child (os.register_at_fork),
    so two boxes of one template draw different numbers, and not the template's next one."""
    code = textwrap.dedent("""
        import os, random, sys
        import osfarm.desktop.launch.box_zygote
        outs = []
        for _ in range(2):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(w, repr(random.random()).encode()); os._exit(0)
            os.close(w); outs.append(os.read(r, 100).decode()); os.close(r); os.waitpid(pid, 0)
        outs.append(repr(random.random()))
        print(" ".join(outs))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert len(set(out)) == 3, out


async def test_box_dies_with_its_pid1_and_provider_sees_it(forking: SandboxProvider) -> None:
    h = await forking.start("fkd", SPEC)
    top = forking._procs[h.id]
    inside = [top.pid, *descendants(top.pid)]
    os.kill(_box_init(forking, h), signal.SIGKILL)
    code = await asyncio.wait_for(top.wait(), 5)
    assert code == -signal.SIGKILL and top.returncode == code
    assert "exited" in (await forking.alive(h) or "")
    assert await wait_dead(inside) == []


async def test_template_death_kills_its_boxes_and_is_restarted(forking: SandboxProvider) -> None:
    """Its boxes die with it (parent-death signals: as an exec'd box dies with its farm); the next
    start starts a new template."""
    h = await forking.start("fkt", SPEC)
    top = forking._procs[h.id]
    inside = [top.pid, *descendants(top.pid)]
    old = forking._template
    assert old is not None
    os.kill(old.pid, signal.SIGKILL)
    assert await asyncio.wait_for(top.wait(), 5) == -signal.SIGKILL
    assert await wait_dead(inside) == []
    await forking.stop(h)
    h2 = await forking.start("fkt", SPEC)
    assert forking._template is not old and forking._template.alive()
    assert h2.info["start"] == "fork" and "start_fallback" not in h2.info
    async with h2.endpoint.client(timeout=30) as c:
        assert (await c.get("/v1/health")).status_code == 200


async def test_orphan_reaping_finds_forked_boxes(forking: SandboxProvider) -> None:
    """A farm that crashed with its boxes still running (its death signal did not fire): the next
    provider's reap_orphans finds the template and its forked boxes by the template's command line."""
    h = await forking.start("fko", SPEC)
    top = forking._procs[h.id]
    template = forking._template
    assert template is not None
    victims = [template.pid, top.pid, *descendants(top.pid)]
    forking._procs.clear()  # forget them, as a new farm would not know them
    forking._template = None
    assert await forking.reap_orphans() >= 1
    assert all(dead(p) for p in victims)
    await template.close()


async def wait_dead(pids: list[int], timeout: float = 10.0) -> list[str]:
    """The processes of ``pids`` still alive after ``timeout`` (name and command line)."""
    deadline = time.monotonic() + timeout
    while (left := [x for x in pids if not dead(x)]) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    out = []
    for x in left:
        with contextlib.suppress(psutil.Error):
            out.append(f"{x} {psutil.Process(x).name()} {' '.join(psutil.Process(x).cmdline())[:200]}")
    return out


async def test_forked_box_dies_with_killed_farm(monkeypatch) -> None:
    """kill -9 of a farm with a forked box: the template and the box die with it (farm -> template
    -> box top -> PID 1, each a parent-death signal); the next provider finds nothing to reap."""
    monkeypatch.setenv("OSFARM_SANDBOX_START", "fork")
    sd = new_state_dir()
    try:
        pids = await _farm_then_kill9(sd, "normal")
        assert (sd / "box-template.log").exists()  # the farm forked its box
        assert not await wait_no_box_processes(sd), "box or template survived kill -9 of its farm"
        # box_processes finds a forked process by its state dir only where it exec'd (Xvfb, the
        # apps): the box's top process and PID 1 carry the template's command line; the kernel
        # may still be tearing the box's PID namespace down
        assert await wait_dead(pids) == [], "box or template survived kill -9 of its farm"
        p = SandboxProvider(FarmSettings(state_dir=sd))
        try:
            assert await p.reap_orphans() == 0
        finally:
            await p.close()
    finally:
        shutil.rmtree(sd, ignore_errors=True)


async def test_fork_start_fingerprint_equals_exec_start_and_warm_reset() -> None:
    """An exec'd box and a forked one are the same to the agent (equal fingerprints), and a warm
    reset of a forked box gives its cold start's fingerprint."""
    sd = new_state_dir()
    p = SandboxProvider(FarmSettings(state_dir=sd, start_timeout_s=45, reset_mode="warm", cold_every=0,
                                     sandbox_start="exec"))
    try:
        h = await p.start("fkf", SPEC)
        assert h.info["start"] == "exec"
        async with h.endpoint.client(timeout=30) as c:
            exec_fp = (await c.get("/v1/session/fingerprint")).json()
        await p.stop(h)
        p.settings = p.settings.model_copy(update={"sandbox_start": "fork"})
        h = await p.start("fkf", SPEC)
        assert h.info["start"] == "fork"
        async with h.endpoint.client(timeout=30) as c:
            fork_fp = (await c.get("/v1/session/fingerprint")).json()
            assert fork_fp["digest"] == exec_fp["digest"], differences(exec_fp, fork_fp)
            await c.post("/v1/pyautogui", json={"code": "open('/tmp/dirt', 'w').write('x')"})
        h = await p.reset(h)
        assert h.info.get("reset_mode") == "warm" and not h.info.get("reset_fallback"), h.info
        async with h.endpoint.client(timeout=30) as c:
            after = (await c.get("/v1/session/fingerprint")).json()
        assert after["digest"] == fork_fp["digest"], differences(fork_fp, after)
    finally:
        await p.stop_all()
        await p.close()
        assert not await wait_no_box_processes(sd)
        shutil.rmtree(sd, ignore_errors=True)


async def test_stuck_template_falls_back_to_exec_once(forking: SandboxProvider, monkeypatch) -> None:
    """A template that does not answer (stopped here): that start is done by exec (counted), the
    template is replaced, and the next start forks again."""
    monkeypatch.setattr("osfarm.providers.box_template.REQUEST_TIMEOUT_S", 1.0)
    template = await forking.box_template()
    os.kill(template.pid, signal.SIGSTOP)
    try:
        h = await forking.start("fks", SPEC)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(template.pid, signal.SIGCONT)
    assert h.info["start"] == "exec" and h.info["start_fallback"] == "fork" and forking.start_fallbacks == 1
    assert not template.alive()
    async with h.endpoint.client(timeout=30) as c:
        assert (await c.get("/v1/health")).status_code == 200
    h2 = await forking.start("fks2", SPEC)
    assert h2.info["start"] == "fork" and forking._template is not template and forking.start_fallbacks == 1


PLANT = ("open('/home/user/httpx.py', 'w').write(\"import os\\n"
         "open('/tmp/planted-ran', 'w').write(str(os.getuid()))\\n\")")


@pytest.mark.parametrize("start", ["exec", "fork"])
async def test_guest_never_imports_from_the_agents_home(start: str) -> None:
    """The launcher runs in the agent's home (its cwd), which ``python -m`` would put first on the
    guest's sys.path: a module the agent plants there must not be what the guest imports later
    (here httpx, imported on the first /setup/download_file)."""
    sd = new_state_dir()
    p = SandboxProvider(FarmSettings(state_dir=sd, start_timeout_s=45, reset_mode="cold", sandbox_start=start))
    try:
        h = await p.start("fkp", SPEC)
        async with h.endpoint.client(timeout=30) as c:
            assert (await c.post("/v1/pyautogui", json={"code": PLANT})).json()["ok"]
            r = await c.post("/setup/download_file", json={"url": "http://127.0.0.1:9/x", "path": "/home/user/x"})
            assert r.status_code == 400 and "non-public address" in r.text, r.text  # refused by osfarm's policy
        assert "No such file" in await sh(h, "cat /tmp/planted-ran 2>&1")
    finally:
        await p.stop_all()
        await p.close()
        shutil.rmtree(sd, ignore_errors=True)


def test_read_plan_refuses_what_the_farm_did_not_write(tmp_path: Path) -> None:
    """The template reads a plan only as the farm writes it: root's regular file, 0600, capped."""
    good = tmp_path / "good.json"
    good.write_text("{}")
    os.chmod(good, 0o600)
    with pytest.raises(TypeError):  # the checks pass; an empty plan lacks its fields
        read_plan(str(good))
    link = tmp_path / "link.json"
    link.symlink_to(good)
    with pytest.raises(OSError):  # O_NOFOLLOW
        read_plan(str(link))
    wide = tmp_path / "wide.json"
    wide.write_text("{}")
    os.chmod(wide, 0o644)
    with pytest.raises(ValueError, match="mode 0600"):
        read_plan(str(wide))
    theirs = tmp_path / "theirs.json"
    theirs.write_text("{}")
    os.chmod(theirs, 0o600)
    os.chown(theirs, 1000, 1000)
    with pytest.raises(ValueError, match="root's"):
        read_plan(str(theirs))
    big = tmp_path / "big.json"
    big.write_text(" " * (PLAN_MAX_BYTES + 1))
    os.chmod(big, 0o600)
    with pytest.raises(ValueError, match="at most"):
        read_plan(str(big))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ValueError, match="regular file"):  # refused, not a blocked read
        read_plan(str(fifo))


async def test_template_answers_bad_requests_and_keeps_forking(forking: SandboxProvider, tmp_path: Path) -> None:
    """A request the template cannot carry out (a plan it refuses, a malformed message) gets an
    error answer or none; the template stays up and the next start forks."""
    h = await forking.start("fkb", SPEC)
    template = forking._template
    assert template is not None
    wide = tmp_path / "wide.json"
    wide.write_text((Path(h.info["dir"]) / "box.json").read_text())
    os.chmod(wide, 0o644)
    with open(os.devnull, "wb") as log:
        for plan in (str(wide), str(tmp_path / "missing.json"), "/proc/self/environ"):
            with pytest.raises(TemplateError, match="could not fork"):
                await template.fork(plan, log.fileno(), False)
        socket.send_fds(template._chan, [b"not json"], [log.fileno()])
        socket.send_fds(template._chan, [b'{"id": 99, "plan": "/nonexistent"}'], [])
    await forking.stop(h)
    h2 = await forking.start("fkb", SPEC)
    assert forking._template is template and template.alive()
    assert h2.info["start"] == "fork" and "start_fallback" not in h2.info
