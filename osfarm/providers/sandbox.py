"""The embedded default provider: one sandbox box per desktop, made with Linux namespaces.

A box is new mount, PID, IPC and UTS namespaces (and, by default, an empty network namespace)
whose PID 1 is :mod:`osfarm.desktop.box.box_init`: it joins the desktop's cgroups, builds the box's
file system (:mod:`osfarm.providers.sandbox_layout`: only what a desktop needs, read-only, with
size-capped tmpfs for the home and /tmp), makes the agent's world
(:mod:`osfarm.desktop.box.agent_world`) and becomes the session launcher as the box's guest uid. The
agent's processes run as ``user`` in their own user namespace, where ``sudo`` with OSWorld's
password gives them a root that is not the host's.

``sandbox_start: fork`` (opt-in) starts the same box without a new interpreter: forked from a box
template that imported the guest's server stack once (:mod:`osfarm.providers.box_template`,
:mod:`osfarm.desktop.launch.box_zygote`); the provider then holds a :class:`ForkedBox` in place of the
``unshare`` process.

Host side, per desktop (``<state_dir>/sandbox/<id>/``, the farm's; none of it is in the box but
``run``):

* ``run/``      -> the box's ``/run/osfarm``: the token, the guest's socket, the state file
                   (the guest's uid, 0700)
* ``guest.sock`` the guest's socket once the farm has claimed it (moved out of ``run/``)
* ``session.log`` the box's output; ``box.json`` the plan; ``etc-guest/``; ``root/``

Limits (cgroups, :mod:`osfarm.providers.cgroups`): ``sandbox_memory``, ``sandbox_pids``,
``sandbox_cpu_weight``; hitting one ends the desktop: :meth:`SandboxProvider.alive` names the limit,
and the pool replaces the desktop. Disk: ``sandbox_home_size``, ``sandbox_tmp_size`` (tmpfs, so
their pages count against the memory limit too).

Reset is kill + start: SIGKILL to the box's PID 1 makes the kernel kill every process in it.
The sandbox needs root (user namespaces with many ids, cgroups, mounts); CI and our machines
run the farm as root. Every method must be called from the event loop thread: boxes get a
parent-death signal, which fires when the *thread* that spawned them exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from osfarm.config import FarmSettings
from osfarm.desktop.box.box_init import BoxPlan
from osfarm.desktop.box.process_tree import children, descendants
from osfarm.providers.base import (
    DesktopHandle,
    DesktopSpec,
    GuestEndpoint,
    ProviderError,
    tree_cpu_seconds,
)
from osfarm.providers.box_template import BoxTemplate, ForkedBox, TemplateError
from osfarm.providers.boxes import (
    SOCKET_PATH_MAX,
    SocketClaim,
    check_desktop_id,
    discarded_on_failure,
    log_tail,
    remove_stale_dirs,
    take_farm_lock,
    wait_guest_ready,
    wait_pids_gone,
)
from osfarm.providers.cgroups import CgroupRoot, DesktopCgroup, Limits, parse_size
from osfarm.providers.sandbox_layout import BOX_OSFARM, BOX_PYTHON, BOX_RUN, Templates, box_plan
from osfarm.providers.slots import Slot, SlotPool
from osfarm.providers.warm_reset import WarmResets

log = logging.getLogger("osfarm.providers.sandbox")

# Bump when the template's content changes so old templates are not reused.
TEMPLATE_VERSION = 2
TEMPLATE_DIRS = (
    "Desktop",
    "Documents",
    "Downloads",
    "Music",
    "Pictures",
    "Public",
    "Templates",
    "Videos",
    ".cache",
    ".config",
    ".local/share",
)
USER_DIRS = """\
XDG_DESKTOP_DIR="$HOME/Desktop"
XDG_DOCUMENTS_DIR="$HOME/Documents"
XDG_DOWNLOAD_DIR="$HOME/Downloads"
XDG_MUSIC_DIR="$HOME/Music"
XDG_PICTURES_DIR="$HOME/Pictures"
XDG_PUBLICSHARE_DIR="$HOME/Public"
XDG_TEMPLATES_DIR="$HOME/Templates"
XDG_VIDEOS_DIR="$HOME/Videos"
"""

STOP_WAIT_S = 3.0
SHM_SIZE = "256m"
# Host environment passed to the box's init and its guest; everything else (the farm's token,
# API keys) stays out.
PASSED_ENV = ("LANG", "LC_ALL", "TZ")
SANDBOX_ENV = "OSFARM_SANDBOX_DIR"
BOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS = ("unshare", "setpriv", "nsenter", "Xvfb")


class SandboxProvider:
    """Provider protocol implementation with namespaces and cgroups (see module doc).

    ``launcher`` replaces the command run as the guest in the box (default: the osfarm session
    launcher with osfarm's interpreter in the box); it receives the session arguments appended.
    """

    name = "sandbox"

    def __init__(self, settings: FarmSettings, launcher: list[str] | None = None):
        self.settings = settings
        if os.geteuid() != 0:
            raise ProviderError(
                "the sandbox provider needs root: it gives each desktop a user namespace with its own "
                "range of ids, cgroup limits and mounts. Run the farm as root, or use --provider docker"
            )
        found = {t: shutil.which(t) for t in TOOLS}
        missing = [t for t, path in found.items() if path is None]
        if missing:
            pkg = {"Xvfb": "xvfb"}
            raise ProviderError(f"missing {', '.join(missing)}: apt-get install "
                                f"{' '.join(sorted({pkg.get(m, 'util-linux') for m in missing}))}")
        self.tools: dict[str, str] = {t: path for t, path in found.items() if path is not None}
        try:
            self.limits = Limits(parse_size(settings.sandbox_memory), settings.sandbox_pids,
                                 settings.sandbox_cpu_weight)
            self.home_size = parse_size(settings.sandbox_home_size)
            self.tmp_size = parse_size(settings.sandbox_tmp_size)
        except ValueError as e:
            raise ProviderError(f"sandbox settings: {e}") from None
        self.state_dir = Path(settings.state_dir).expanduser().absolute()
        self.root = self.state_dir / "sandbox"
        self.template = self.state_dir / "templates" / f"home-v{TEMPLATE_VERSION}"
        self.launcher = launcher or [BOX_PYTHON, "-m", "osfarm.desktop.launch.launcher"]
        longest = self.root / ("x" * 12) / "run" / "guest.sock"
        if len(os.fsencode(longest)) > SOCKET_PATH_MAX:
            raise ProviderError(
                f"state_dir {self.state_dir} is too long for unix socket paths "
                f"({len(os.fsencode(longest))} > {SOCKET_PATH_MAX} bytes): set a shorter OSFARM_STATE_DIR"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        self._lock_fd = self._take_lock()
        try:
            self.cgroups = CgroupRoot.detect()
            self.slots = SlotPool(settings.sandbox_uid_base)
            self._probe()
            self._build_template()
            self.templates = Templates(self.state_dir / "templates", self.template)
        except BaseException:
            os.close(self._lock_fd)  # a failed construction must not keep the state_dir locked
            raise
        if self.templates.agent_python_note:
            log.warning("%s", self.templates.agent_python_note)
        if self.templates.bytecode_note:
            log.warning("%s", self.templates.bytecode_note)
        self._procs: dict[str, asyncio.subprocess.Process | ForkedBox] = {}
        self._template: BoxTemplate | None = None  # sandbox_start fork: started on the first start
        self._template_lock = asyncio.Lock()
        self.start_fallbacks = 0  # fork starts that failed and were started by exec instead
        self._slots: dict[str, Slot] = {}
        self._cgroups: dict[str, DesktopCgroup] = {}
        self._xvfb: dict[str, psutil.Process] = {}  # found once per start: alive() stays cheap
        self.warm = WarmResets(settings)
        self._closed = False

    # -- setup ------------------------------------------------------------------------------

    def _take_lock(self) -> int:
        return take_farm_lock(self.state_dir / "sandbox.lock", f"state_dir {self.state_dir}",
                              "stop it or set a different OSFARM_STATE_DIR")

    def _probe(self) -> None:
        """Fail at construction, with the reason, when namespaces cannot be made here."""
        proc = subprocess.run(
            [self.tools["unshare"], "--mount", "--pid", "--ipc", "--uts", "--net", "--fork", "--", "true"],
            capture_output=True, text=True, timeout=30, check=False,
        )
        if proc.returncode != 0:
            raise ProviderError(
                f"cannot create namespaces here: {proc.stderr.strip() or proc.returncode} "
                "(in a container, allow unshare and mount: e.g. --privileged)"
            )

    def _build_template(self) -> None:
        """Build the template home once (a rename makes it appear atomically)."""
        self.template.parent.mkdir(parents=True, exist_ok=True)
        if self.template.is_dir():
            return
        tmp = self.template.with_name(f".{self.template.name}.{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        for d in TEMPLATE_DIRS:
            (tmp / d).mkdir(parents=True, exist_ok=True)
        (tmp / ".config" / "user-dirs.dirs").write_text(USER_DIRS)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(self.template)
        except OSError:  # built concurrently by someone else
            shutil.rmtree(tmp, ignore_errors=True)

    # -- paths ------------------------------------------------------------------------------

    def desktop_dir(self, desktop_id: str) -> Path:
        return self.root / desktop_id

    def _fresh_dirs(self, ddir: Path, slot: Slot, token: str) -> None:
        """An empty host dir for the desktop: ``run`` (the guest's, with its token) and ``root``
        (the box's mount point); whatever an earlier box left is moved aside and deleted."""
        if ddir.exists():
            trash = ddir.with_name(f".trash-{ddir.name}-{secrets.token_hex(4)}")
            ddir.rename(trash)
            asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, trash, True)
        ddir.mkdir(mode=0o700)
        (ddir / "root").mkdir(mode=0o755)
        run = ddir / "run"
        run.mkdir(mode=0o700)
        fd = os.open(run / "token", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        os.chown(run / "token", slot.guest_uid, slot.guest_uid)
        os.chown(run, slot.guest_uid, slot.guest_uid)
        # The box's init (root, after joining the box's namespaces) must reach run/ and root/;
        # nobody else on the host needs to.
        os.chmod(ddir, 0o711)

    # -- protocol ---------------------------------------------------------------------------

    @property
    def template_tag(self) -> str:
        """On the box template's command line (and so on every forked box's): orphan reaping
        finds them by it, as it finds exec'd boxes by their plan's path."""
        return f"{self.root}/.box-template"

    async def box_template(self) -> BoxTemplate:
        """The running box template (``sandbox_start: fork``), started (again) if need be."""
        async with self._template_lock:
            old = self._template
            if old is not None and old.alive():
                return old
            if old is not None:
                log.warning("sandbox box template exited (pid=%s code=%s): starting a new one", old.pid,
                            old.proc.returncode if old.proc else None)
                await old.close()
            env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
            env.setdefault("LANG", "C.UTF-8")
            env.update(PATH=BOX_PATH, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
            binds = [*self.templates.guest_paths["binds"], (str(self.templates.osfarm_bin), f"{BOX_OSFARM}/bin")]
            template = BoxTemplate(self.template_tag, binds, env, BOX_PYTHON, self.state_dir / "box-template.log")
            self._template = template
            await template.start()
            log.info("sandbox box template ready pid=%s threads=%s", template.pid, template.info.get("threads"))
            return template

    async def _spawn(self, desktop_id: str, spec: DesktopSpec, log_path: Path,
                     fork: bool) -> asyncio.subprocess.Process | ForkedBox:
        """Start the box's processes: forked from the box template, or ``box_argv`` exec'd."""
        plan_file = self.desktop_dir(desktop_id) / "box.json"
        with open(log_path, "wb") as logf:
            if fork:
                template = await self.box_template()
                return await template.fork(str(plan_file), logf.fileno(), spec.private_network)
            env = {k: os.environ[k] for k in (*PASSED_ENV, "PATH", "PYTHONPATH") if k in os.environ}
            return await asyncio.create_subprocess_exec(
                *self.box_argv(desktop_id, spec),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    def box_argv(self, desktop_id: str, spec: DesktopSpec) -> list[str]:
        """The host command of a box: namespaces by ``unshare`` (its child is the box's PID 1),
        a parent-death signal so that a box never outlives its farm."""
        plan_file = self.desktop_dir(desktop_id) / "box.json"
        argv = [self.tools["setpriv"], "--pdeathsig", "KILL", "--", self.tools["unshare"],
                "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child=SIGKILL"]
        if spec.private_network:
            argv.append("--net")
        return [*argv, "--", sys.executable, "-m", "osfarm.desktop.box.box_init", str(plan_file)]

    def _plan(self, desktop_id: str, spec: DesktopSpec, slot: Slot, cgroup: DesktopCgroup) -> BoxPlan:
        ddir = self.desktop_dir(desktop_id)
        hostname = f"osfarm-{desktop_id}"
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.setdefault("LANG", "C.UTF-8")
        env.update(
            PATH=BOX_PATH, HOME="/home/user", USER="osfarm-guest", PYTHONUNBUFFERED="1",
            OSFARM_PYTHON=BOX_PYTHON,
            # The guest's own caches and settings (gi, fontconfig): not in the agent's home.
            XDG_CACHE_HOME=f"{BOX_RUN}/cache", XDG_CONFIG_HOME=f"{BOX_RUN}/config",
            **{SANDBOX_ENV: str(ddir)},
        )  # fmt: skip
        env.update(spec.extra_env)
        args = [
            "--width", str(spec.width), "--height", str(spec.height), "--depth", str(spec.depth),
            "--desktop", spec.desktop,
            "--display", ":0", "--home", "/home/user",
            "--socket", f"{BOX_RUN}/guest.sock", "--token-file", f"{BOX_RUN}/token",
            "--state-file", f"{BOX_RUN}/state.json",
        ]  # fmt: skip
        plan = box_plan(
            ddir=ddir, slot=slot, templates=self.templates,
            guest_etc=self.templates.guest_etc(ddir / "etc-guest", slot, hostname,
                                               spec.timezone if spec.desktop == "gnome" else None),
            hostname=hostname, desktop=spec.desktop,
            launcher_args=args, env=env, cgroup_procs=cgroup.procs_files,
            home_size=str(self.home_size), tmp_size=str(self.tmp_size), shm_size=SHM_SIZE,
        )  # fmt: skip
        if spec.private_network:
            plan = dataclasses.replace(plan, loopback_up=True)
        if self.launcher[:3] != [BOX_PYTHON, "-m", "osfarm.desktop.launch.launcher"]:
            plan = dataclasses.replace(plan, launcher=[*self.launcher, *args])
        return plan

    async def reap_orphans(self) -> int:
        """Kill boxes left by an earlier farm with this state_dir and delete their dirs.

        Boxes die with their farm (parent-death signal), so this matters only when that failed.
        Matches processes whose command line names our sandbox dir (the box's ``unshare`` and
        init) and any process whose environment carries OSFARM_SANDBOX_DIR under it (a guest
        process that escaped the box's process tree).
        """
        ours = {p.pid for p in self._procs.values()}
        if self._template is not None and self._template.alive() and self._template.pid:
            ours.add(self._template.pid)
        for pid in list(ours):
            ours.update(_descendants(pid))
        prefix = f"{self.root}/"
        victims: dict[int, str] = {}
        for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
            if p.pid in ours or p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = p.info["cmdline"] or []
            hit = next((a for a in cmd if a.startswith(prefix)), None)
            if hit is None:
                with contextlib.suppress(psutil.Error):
                    env_dir = p.environ().get(SANDBOX_ENV, "")
                    if env_dir.startswith(prefix):
                        hit = env_dir
            if hit is not None:
                victims[p.pid] = hit[len(prefix) :].split("/")[0]
        # The box's own daemons (D-Bus, AT-SPI) need not carry our dir in their command line or
        # environment; they die with the box's PID namespace, but not at once: wait for them too.
        for pid, box in list(victims.items()):
            for child in _descendants(pid):
                victims.setdefault(child, box)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await wait_pids_gone(list(victims), STOP_WAIT_S)
        boxes = set(victims.values())
        stale = await remove_stale_dirs(self.root, self._procs)
        if victims or stale:
            log.warning(
                "reaped orphans boxes=%d processes=%d stale_dirs=%d state_dir=%s",
                len(boxes), len(victims), stale, self.state_dir,
            )  # fmt: skip
        return len(boxes)

    async def start(self, desktop_id: str, spec: DesktopSpec) -> DesktopHandle:
        """A new box: exec'd, or with ``sandbox_start: fork`` forked from the box template; a
        forked start that fails is done again by exec, once (logged, counted in
        ``start_fallbacks`` and the handle's ``info["start_fallback"]``)."""
        if self._closed:
            raise ProviderError("sandbox provider is closed")
        check_desktop_id(desktop_id)
        old = self._procs.get(desktop_id)
        if old is not None and old.returncode is None:
            raise ProviderError(f"desktop {desktop_id} is already running")
        if self.settings.sandbox_start != "fork":
            return await self._start(desktop_id, spec, fork=False)
        try:
            return await self._start(desktop_id, spec, fork=True)
        except (TemplateError, ProviderError) as e:
            if self._closed:
                raise
            self.start_fallbacks += 1
            log.warning("sandbox fork start failed, starting it by exec (fallback %d) id=%s: %s",
                        self.start_fallbacks, desktop_id, str(e)[:2000])
        handle = await self._start(desktop_id, spec, fork=False)
        handle.info["start_fallback"] = "fork"
        return handle

    async def _start(self, desktop_id: str, spec: DesktopSpec, fork: bool) -> DesktopHandle:
        await self._kill(desktop_id, self._procs.get(desktop_id))  # a crashed box: forget it
        t0 = time.monotonic()
        slot = self._slots.get(desktop_id) or self.slots.acquire()
        self._slots[desktop_id] = slot
        ddir = self.desktop_dir(desktop_id)
        token = secrets.token_urlsafe(24)
        self._fresh_dirs(ddir, slot, token)
        cgroup = await asyncio.to_thread(self.cgroups.make, f"osfarm-slot-{slot.index}", self.limits)
        self._cgroups[desktop_id] = cgroup
        plan = self._plan(desktop_id, spec, slot, cgroup)
        fd = os.open(ddir / "box.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(plan.to_json())
        log_path = ddir / "session.log"
        proc = await self._spawn(desktop_id, spec, log_path, fork)
        self._procs[desktop_id] = proc
        endpoint = GuestEndpoint(base_url="http://guest", token=token, uds=str(ddir / "guest.sock"))
        handle = DesktopHandle(
            id=desktop_id,
            provider=self.name,
            spec=spec,
            endpoint=endpoint,
            pid=proc.pid,
            info={"dir": str(ddir), "log": str(log_path), "slot": str(slot.index),
                  "guest_uid": str(slot.guest_uid), "agent_uid": str(slot.agent_id(1000)),
                  "start": "fork" if fork else "exec"},
        )
        claim = SocketClaim(ddir / "run" / "guest.sock", ddir / "guest.sock", slot.guest_uid,
                            ready=ddir / "run" / "state.json")
        async with discarded_on_failure(desktop_id, lambda: self._kill(desktop_id, proc)):
            await self._wait_ready(handle, proc, t0, claim)
        handle.info["start_s"] = f"{time.monotonic() - t0:.3f}"
        for pid in _descendants(proc.pid):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.name() == "Xvfb":
                    self._xvfb[desktop_id] = p
        await self.warm.after_cold_start(handle, lambda: self._kill(desktop_id, proc))
        log.info("sandbox ready id=%s pid=%d start_s=%s", desktop_id, proc.pid, handle.info["start_s"])
        return handle

    async def _wait_ready(self, handle: DesktopHandle, proc: asyncio.subprocess.Process | ForkedBox, t0: float,
                          claim: SocketClaim) -> None:
        cgroup = self._cgroups.get(handle.id)

        async def launcher_exited() -> str | None:
            hit = cgroup.limit_hit() if cgroup is not None else None
            if hit is not None:
                return hit
            return None if proc.returncode is None else f"the box exited with code {proc.returncode}"

        async def session_log() -> str:
            return f"log {handle.info['log']}:\n{log_tail(handle.info['log'])}"

        await wait_guest_ready(handle, t0 + self.settings.start_timeout_s, self.settings.start_timeout_s,
                               box_gone=launcher_exited, box_log=session_log, claim=claim)

    async def _kill(self, desktop_id: str, proc: asyncio.subprocess.Process | ForkedBox | None) -> None:
        """Kill the box: SIGKILL its PID 1 so the kernel kills every process in it.

        The launcher's own SIGTERM cleanup buys nothing here (home and /tmp are thrown away)
        and costs time on every reset. Killing PID 1 first keeps ``unshare`` alive to reap it,
        so no zombie is left to the host's init. The cgroup is emptied too.
        """
        self._procs.pop(desktop_id, None)
        self._xvfb.pop(desktop_id, None)
        cgroup = self._cgroups.pop(desktop_id, None)
        if proc is not None and proc.returncode is None:
            pids = [proc.pid, *_descendants(proc.pid)]
            for child in children(proc.pid):  # the box's PID 1
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            try:
                await asyncio.wait_for(proc.wait(), STOP_WAIT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), STOP_WAIT_S)
            left = await wait_pids_gone(pids, STOP_WAIT_S)
            if left:
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                log.error("sandbox processes survived stop id=%s pids=%s", desktop_id, left)
        if cgroup is not None:
            await asyncio.to_thread(cgroup.remove)

    async def stop(self, handle: DesktopHandle) -> None:
        proc = self._procs.get(handle.id)
        if proc is not None and proc.pid == handle.pid:
            await self._kill(handle.id, proc)
        elif proc is None and handle.pid and _is_our_box(handle.pid, self.root):
            # A handle from before a provider restart: kill by pid (checked to be our box).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(handle.pid, signal.SIGKILL)
            await wait_pids_gone([handle.pid], STOP_WAIT_S)
        ddir = self.desktop_dir(handle.id)
        if handle.id not in self._procs:
            if ddir.exists():
                await asyncio.to_thread(shutil.rmtree, ddir, True)
            slot = self._slots.pop(handle.id, None)
            if slot is not None:
                SlotPool.release(slot)
        log.info("sandbox stopped id=%s", handle.id)

    async def reset(self, handle: DesktopHandle) -> DesktopHandle:
        """``reset_mode`` warm: a warm reset (:class:`~osfarm.providers.warm_reset.WarmResets`),
        falling back to a cold restart (counted in ``info["reset_fallback"]``) on a fingerprint
        mismatch, an error, its deadline, every ``cold_every`` resets, or at once where the box is
        not :meth:`alive` (Xvfb or the session gone, a limit hit); cold: kill the box and start a
        new one."""
        return await self.warm.reset(handle, await self.alive(handle), self._cold_reset)

    async def _cold_reset(self, handle: DesktopHandle) -> DesktopHandle:
        await self._kill(handle.id, self._procs.get(handle.id))
        return await self.start(handle.id, handle.spec)

    async def alive(self, handle: DesktopHandle) -> str | None:
        proc = self._procs.get(handle.id)
        if proc is None or proc.pid != handle.pid:
            return "sandbox is not running (stopped or owned by another provider)"
        cgroup = self._cgroups.get(handle.id)
        hit = cgroup.limit_hit() if cgroup is not None else None
        if hit is not None:
            return f"sandbox {hit}"
        if proc.returncode is not None:
            return f"sandbox exited with code {proc.returncode}: {log_tail(handle.info.get('log', ''), 3)}"
        xvfb = self._xvfb.get(handle.id)
        if xvfb is not None and not _running(xvfb):
            return "Xvfb exited"
        return None

    def cpu_seconds(self, handle: DesktopHandle) -> float | None:
        """CPU-seconds of the box since it started: its cgroup's accounting (every process that
        ever ran in it), else its process tree."""
        cgroup = self._cgroups.get(handle.id)
        used = cgroup.cpu_seconds() if cgroup is not None else None
        return used if used is not None else tree_cpu_seconds(self.pids(handle))

    def pids(self, handle: DesktopHandle) -> list[int]:
        proc = self._procs.get(handle.id)
        if proc is None or proc.returncode is not None:
            return []
        return [proc.pid, *_descendants(proc.pid)]

    async def stop_all(self) -> None:
        """Stop every box this provider started (not part of the protocol: tests, shutdown)."""
        for desktop_id, proc in list(self._procs.items()):
            await self._kill(desktop_id, proc)
            await asyncio.to_thread(shutil.rmtree, self.desktop_dir(desktop_id), True)
        for desktop_id in list(self._slots):
            SlotPool.release(self._slots.pop(desktop_id))

    async def close(self) -> None:
        """Release the state_dir lock. Boxes still running are not stopped (the pool does
        that), but they die with this process anyway (parent-death signal)."""
        if self._closed:
            return
        self._closed = True
        if self._template is not None:
            await self._template.close()  # its boxes die with it
            self._template = None
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


def _descendants(pid: int) -> list[int]:
    """From the kernel's per-thread children lists (a few reads per process of the box), not
    psutil's scan of every process on the host (~35 ms with 400 processes, twice on the path of
    every cold reset: the kill before and the Xvfb lookup after)."""
    return descendants(pid)


def _running(p: psutil.Process) -> bool:
    """is_running also notices a reused pid (it compares create times)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _is_our_box(pid: int, root: Path) -> bool:
    try:
        p = psutil.Process(pid)
        return any(a.startswith(f"{root}/") for a in p.cmdline())
    except psutil.Error:
        return False
