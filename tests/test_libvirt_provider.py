"""The libvirt provider with real VMs: real libvirtd, qemu (KVM, or TCG where KVM cannot boot
our kernel), the VM disk built from the desktop image, and the guest server inside the VM.

The VM disk is built once per machine (``osfarm image build-vm``, cached by image id) by the
``vm_disk`` fixture; libvirtd must be running (``scripts/setup-libvirt.sh``).
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from osfarm.config import FarmSettings
from osfarm.images.libvirt_disk import (
    BASE_DISK,
    build_libvirt_disk,
    default_image_dir,
    disk_size_bytes,
)
from osfarm.providers import make_provider
from osfarm.providers.base import DesktopHandle, DesktopSpec, ProviderError
from osfarm.providers.libvirt import (
    LibvirtProvider,
    domain_name,
    kernel_cmdline,
    netdev_arg,
    qemu_ids,
    read_metadata,
    vm_plan,
)

SPEC = DesktopSpec(width=1024, height=768)
# Under TCG emulation a desktop VM boots in minutes, not seconds.
START_TIMEOUT_S = 600


# -- pure functions --------------------------------------------------------------------------


def test_disk_size_adds_overhead_and_free_space():
    gib, mib = 1 << 30, 1 << 20
    # 2 GiB of files -> 2.3 GiB (2355.2 MiB) with ext4 overhead, + 4 GiB free, rounded up to a MiB.
    assert disk_size_bytes(2 * gib, 4) == (2356 + 4096) * mib
    assert disk_size_bytes(1, 0) == 1 << 20


def test_kernel_cmdline_and_netdev():
    cmd = kernel_cmdline(DesktopSpec(width=800, height=600, depth=16))
    assert not [a for a in cmd.split() if "token" in a]  # the token goes through fw_cfg (issue 13)
    assert {"osfarm.width=800", "osfarm.height=600", "osfarm.depth=16", "osfarm.port=8000"} <= set(cmd.split())
    # the host forward listens on loopback only; private desktops get no route out
    assert netdev_arg(4321, True) == "user,id=osfarmnet0,restrict=on,hostfwd=tcp:127.0.0.1:4321-:8000"
    assert "restrict=off" in netdev_arg(4321, False)


def test_qemu_runs_unprivileged_where_it_can_reach_its_files():
    """A root farm gives qemu the distribution's qemu account, unless that account cannot reach
    the VM's files (then root, with the reason); a non-root farm's qemu is the farm's uid."""
    with tempfile.TemporaryDirectory(prefix="osfq", dir="/tmp") as d:
        _check_qemu_ids(Path(d))


def _check_qemu_ids(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    (open_dir / "f").write_text("x")
    uid, gid, note = qemu_ids([open_dir / "f"])
    if os.geteuid() != 0:
        assert (uid, gid, note) == (os.getuid(), os.getgid(), "")
        return
    if note.startswith("qemu runs as root: no unprivileged"):
        pytest.skip(note)
    assert uid != 0 and note == "", note
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    (closed / "f").write_text("x")
    uid, _gid, note = qemu_ids([closed / "f"])
    assert uid == 0 and "cannot reach" in note and str(closed / "f") in note


def test_the_token_reaches_the_vm_by_fw_cfg_not_the_command_line(tmp_path, vm_disk):
    p = LibvirtProvider(FarmSettings(state_dir=tmp_path / "st", libvirt_image_dir=vm_disk))
    try:
        xml = p.domain_xml("d1", SPEC, 4321)
        assert "token" not in xml.split("<cmdline>")[1].split("</cmdline>")[0]
        assert "<sysinfo type='fwcfg'>" in xml and "name='opt/org.osfarm/token'" in xml
        if os.geteuid() == 0:
            assert f"<label>+{p.qemu_uid}:+{p.qemu_gid}</label>" in xml
        plan = vm_plan(SPEC)
        assert plan.agent is not None and plan.agent.outside_base > 0 and plan.guest_uid != 0
    finally:
        asyncio.run(p.close())


def test_read_metadata():
    xml = (
        "<domain><name>x</name><metadata><o:desktop xmlns:o='https://osfarm.dev/libvirt/desktop/1'>"
        "<o:id>d1</o:id><o:state-dir>/tmp/s</o:state-dir></o:desktop></metadata></domain>"
    )
    assert read_metadata(xml) == {"id": "d1", "state-dir": "/tmp/s"}
    assert read_metadata("<domain><name>x</name></domain>") is None
    assert read_metadata("not xml") is None
    assert domain_name(Path("/a"), "d1") != domain_name(Path("/b"), "d1")


# -- errors at construction ------------------------------------------------------------------


def test_missing_base_disk_says_how_to_build(tmp_path):
    with pytest.raises(ProviderError, match=r"no VM base disk .*osfarm image build-vm"):
        LibvirtProvider(FarmSettings(state_dir=tmp_path / "s", libvirt_image_dir=tmp_path / "empty"))


def test_daemon_not_running_says_how_to_start(tmp_path, vm_disk):
    uri = f"qemu:///system?socket={tmp_path}/no-libvirtd.sock"
    with pytest.raises(ProviderError, match=r"cannot connect to libvirt.*setup-libvirt\.sh"):
        LibvirtProvider(FarmSettings(state_dir=tmp_path / "s", libvirt_image_dir=vm_disk, libvirt_uri=uri))


def test_one_farm_per_state_dir(tmp_path, vm_disk):
    settings = FarmSettings(state_dir=tmp_path / "s", libvirt_image_dir=vm_disk)
    first = LibvirtProvider(settings)
    try:
        with pytest.raises(ProviderError, match="another osfarm process"):
            LibvirtProvider(settings)
    finally:
        asyncio.run(first.close())


# -- real VMs --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def vm_disk() -> Path:
    """The VM disk of this machine (built from osfarm/desktop once; later runs reuse it).
    A disk in an explicit OSFARM_LIBVIRT_IMAGE_DIR is used as it is."""
    explicit = os.environ.get("OSFARM_LIBVIRT_IMAGE_DIR")
    out = Path(explicit or default_image_dir())
    if not (explicit and (out / BASE_DISK).is_file()):
        build_libvirt_disk(out)
    assert (out / BASE_DISK).is_file()
    return out


def new_state_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="ofv-", dir="/tmp"))


def settings_for(state_dir: Path, vm_disk: Path, reset: str = "boot") -> FarmSettings:
    return FarmSettings(
        provider="libvirt",
        state_dir=state_dir,
        libvirt_image_dir=vm_disk,
        libvirt_reset=reset,
        libvirt_memory_mb=2048,
        libvirt_vcpus=2,
        start_timeout_s=START_TIMEOUT_S,
    )


async def sh(handle: DesktopHandle, command: str) -> str:
    async with handle.endpoint.client(timeout=60) as c:
        r = await c.post("/execute", json={"command": command, "shell": True})
    r.raise_for_status()
    return r.json()["output"]


async def domain_names(provider: LibvirtProvider) -> set[str]:
    doms = await asyncio.to_thread(provider.conn.listAllDomains, 0)
    return {d.name() for d in doms}


async def check_guest(handle: DesktopHandle) -> None:
    """The guest answers: health, a step with an observation, a command."""
    async with handle.endpoint.client(timeout=120) as c:
        health = (await c.get("/v1/health")).json()
        assert health["screen"] == {"width": SPEC.width, "height": SPEC.height}
        r = await c.post(
            "/v1/step",
            json={"actions": [{"action_type": "MOVE_TO", "parameters": {"x": 100, "y": 200}}],
                  "observe": {"format": "png", "scale": 0.5}},
        )  # fmt: skip
        r.raise_for_status()
        step = r.json()
        assert all(res["ok"] for res in step["results"]), step["results"]
        obs = step["observation"]
        assert obs["cursor"] == [100, 200]
        assert base64.b64decode(obs["screenshot"])[:8] == b"\x89PNG\r\n\x1a\n"
        assert (obs["width"], obs["height"]) == (SPEC.width // 2, SPEC.height // 2)
    assert (await sh(handle, "id -un")).strip() == "user"


async def wait_dead(provider: LibvirtProvider, handle: DesktopHandle, timeout: float = 180) -> str | None:
    deadline = time.monotonic() + timeout
    while (why := await provider.alive(handle)) is None and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return why


@pytest.mark.timeout(900)
async def test_a_start_cancelled_while_its_vm_is_created_leaves_no_vm(vm_disk):
    """A farm that stops while a desktop boots cancels the start. The VM libvirt is creating at
    that moment (in a thread, which a cancel does not stop) must not run on without an owner."""
    state = new_state_dir()
    provider = LibvirtProvider(settings_for(state, vm_disk))
    name = domain_name(state, "c1")
    try:
        start = asyncio.create_task(provider.start("c1", SPEC))
        deadline = time.monotonic() + 300
        # Asked on the loop's thread (blocking): the start cannot move on between the answer and
        # the cancel, so the cancel lands while libvirt creates the VM, or just after.
        while name not in {d.name() for d in provider.conn.listAllDomains(0)}:
            assert not start.done(), start
            assert time.monotonic() < deadline, "the VM was never created"
            await asyncio.sleep(0)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        await asyncio.sleep(5)  # a creation the start left behind would have finished by now
        assert name not in await domain_names(provider)
    finally:
        await provider.reap_orphans()  # a VM the test failed on
        await provider.close()
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.timeout(2400)
async def test_boot_reset_then_leaked_vm_is_reaped(vm_disk):
    """Boot-mode reset gives a fresh disk; a farm that dies leaves its VM to the next one."""
    state, other_state = new_state_dir(), new_state_dir()
    settings = settings_for(state, vm_disk)
    provider = make_provider(settings)
    assert isinstance(provider, LibvirtProvider)
    bystander = LibvirtProvider(settings_for(other_state, vm_disk))
    second = None
    try:
        handle = await provider.start("v1", SPEC)
        print("libvirt boot start:", handle.info)
        assert handle.endpoint.base_url.startswith("http://127.0.0.1:")
        assert await provider.alive(handle) is None
        qemu = provider.pids(handle)
        assert qemu and psutil.Process(qemu[0]).name().startswith("qemu")
        await check_guest(handle)
        await sh(handle, "echo dirty > /home/user/left-by-task.txt")

        new = await provider.reset(handle)
        print("libvirt boot reset:", new.info)
        assert await provider.alive(new) is None
        assert "No such file" in await sh(new, "ls /home/user/left-by-task.txt 2>&1 || true")
        assert new.endpoint.token != handle.endpoint.token  # a new boot, a new token
        assert qemu[0] not in provider.pids(new)
        qemu = provider.pids(new)

        await provider.close()  # the farm dies without stopping its desktop
        second = LibvirtProvider(settings)
        # another farm's reaping never touches our VM; ours is found by its metadata
        assert await bystander.reap_orphans() == 0
        assert domain_name(state, "v1") in await domain_names(second)
        assert await second.reap_orphans() == 1
        assert domain_name(state, "v1") not in await domain_names(second)
        assert not psutil.pid_exists(qemu[0]) or psutil.Process(qemu[0]).status() == psutil.STATUS_ZOMBIE
        assert not (state / "libvirt" / "v1").exists()
    finally:
        await provider.close()
        if second is None:
            second = LibvirtProvider(settings)
        await second.reap_orphans()  # whatever failed above, leave no VM behind
        await second.close()
        await bystander.close()
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(other_state, ignore_errors=True)


@pytest.mark.timeout(1800)
async def test_snapshot_reset_reverts_files_and_fixes_clock(vm_disk):
    state = new_state_dir()
    provider = LibvirtProvider(settings_for(state, vm_disk, reset="snapshot"))
    handle = None
    try:
        handle = await provider.start("s1", SPEC)
        rss_mib = psutil.Process(handle.pid).memory_info().rss >> 20
        print("libvirt snapshot start:", handle.info, "qemu RSS MiB:", rss_mib)
        await sh(handle, "echo dirty > /home/user/left-by-task.txt")
        await asyncio.sleep(3)  # the snapshot's clock falls behind the host's

        handle = await provider.reset(handle)
        print("libvirt snapshot reset:", handle.info)
        assert handle.info.get("reset_via") == "snapshot"  # reverted, not rebooted
        assert handle.pid in provider.pids(handle)
        out = await sh(handle, "ls /home/user/left-by-task.txt 2>&1 || true; date +%s")
        assert "No such file" in out
        guest_now = int(out.strip().splitlines()[-1])
        assert abs(guest_now - time.time()) < 5, "the guest clock was not set after the revert"
        await check_guest(handle)

        # revert works again and again
        handle = await provider.reset(handle)
        print("libvirt snapshot reset 2:", handle.info)
        assert handle.info.get("reset_via") == "snapshot"
        await check_guest(handle)

        # a VM that goes away under the farm (qemu killed, or powered off when its session exits)
        # is noticed by alive(). The agent cannot end the session itself any more (it runs apart
        # from the guest, tests/security), so qemu dies from the host.
        os.kill(handle.pid, signal.SIGKILL)
        why = await wait_dead(provider, handle)
        assert why is not None and "VM stopped" in why
    finally:
        if handle is not None:
            await provider.stop(handle)
        names = await domain_names(provider)
        await provider.close()
        shutil.rmtree(state, ignore_errors=True)
    assert domain_name(state, "s1") not in names


@pytest.mark.timeout(900)
async def test_gnome_vm_is_the_ubuntu_screen(vm_disk):
    """desktop: gnome (on request on libvirt): the VM runs GNOME Shell in Ubuntu's session, and
    the guest answers once the shell has laid out its top bar and dock (under TCG that takes over
    a minute; answering earlier started tasks on a black screen)."""
    state = new_state_dir()
    provider = LibvirtProvider(settings_for(state, vm_disk))
    handle = None
    try:
        handle = await provider.start("g1", DesktopSpec(width=SPEC.width, height=SPEC.height, desktop="gnome"))
        print("libvirt gnome start:", handle.info)
        assert (await sh(handle, "echo $XDG_CURRENT_DESKTOP $LANG")).split() == ["ubuntu:GNOME", "en_US.UTF-8"]
        assert "gnome-shell --x11 --mode=ubuntu" in await sh(handle, "ps -eo args")
        # the work area starts right of the dock and below the top bar
        area = (await sh(handle, "xprop -root _NET_WORKAREA")).partition("=")[2].split(",")
        x, y = int(area[0]), int(area[1])
        assert 40 <= x <= 120 and 20 <= y <= 60, area
        await check_guest(handle)
    finally:
        if handle is not None:
            await provider.stop(handle)
        await provider.close()
        shutil.rmtree(state, ignore_errors=True)
