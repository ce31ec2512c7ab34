"""The embedded default provider: one bubblewrap sandbox per desktop.

Each desktop is ``bwrap`` with its own PID, IPC and UTS namespaces (and, optionally, an empty
network namespace) running the session launcher ``python -m osfarm.desktop.launcher``. The host
filesystem is visible read-only; the box gets private ``/tmp``, ``/var/tmp``, ``/run``,
``/dev/shm`` and two host directories bound in:

* ``<state_dir>/sandbox/<id>/run``  -> ``/run/osfarm``: token, guest socket, state file, log
* ``<state_dir>/sandbox/<id>/home`` -> ``/home/user``: a fresh copy of the template home

Reset is kill + fresh home + start: killing the box's PID-namespace init makes the kernel kill
every process in the box at once, so nothing survives and nothing needs a graceful shutdown.

Threading: every method must be called from the event loop thread. Boxes are spawned with
``--die-with-parent``, which is PR_SET_PDEATHSIG, and that fires when the *thread* that spawned
bwrap exits, so spawning from a worker thread would kill the box when that thread ends.
"""

from __future__ import annotations

import asyncio
import contextlib
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

import osfarm
from osfarm.config import FarmSettings
from osfarm.providers.base import DesktopHandle, DesktopSpec, GuestEndpoint, ProviderError
from osfarm.providers.boxes import (
    SOCKET_PATH_MAX,
    abstract_x_displays,
    check_desktop_id,
    discarded_on_failure,
    log_tail,
    remove_stale_dirs,
    take_farm_lock,
    wait_guest_ready,
    wait_pids_gone,
)

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
USER_ARGS = ("--unshare-user", "--uid", "1000", "--gid", "1000")
# /etc/passwd and /etc/group inside a box: the host's accounts stay hidden, "user" resolves.
PASSWD = "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/bash\n"
GROUP = "root:x:0:\nuser:x:1000:\n"
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
# Host environment variables passed into the box; everything else (farm token, API keys) stays out.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "VIRTUAL_ENV")
SANDBOX_ENV = "OSFARM_SANDBOX_DIR"
HIDDEN_DIRS = ("/home", "/root")
HIDDEN_ARGS = [a for d in HIDDEN_DIRS for a in ("--tmpfs", d)]
# Paths replaced inside the box: the host's versions are invisible there.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/run", "/dev", *HIDDEN_DIRS)


def _needed_host_paths(state_dir: Path) -> list[str]:
    """Directories of this Python (prefix, venv, sys.path) that the box's tmpfs mounts would
    hide; they are bound back read-only so the launcher can run."""
    wanted = {sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent)}
    wanted.add(str(Path(osfarm.__file__).resolve().parent.parent))
    wanted.update(p for p in sys.path if p and os.path.isabs(p))
    hidden = [*PRIVATE_DIRS, str(state_dir)]
    out: list[str] = []
    for p in sorted({os.path.realpath(w) for w in wanted}):
        if not os.path.isdir(p) or not any(p.startswith(h.rstrip("/") + "/") for h in hidden):
            continue  # visible anyway, or a private dir itself (binding /tmp back would unshare nothing)
        if any(p.startswith(o.rstrip("/") + "/") for o in out):
            continue  # already inside a bound parent
        out.append(p)
    return out


class SandboxProvider:
    """Provider protocol implementation with bubblewrap (see module doc).

    ``launcher`` replaces the command run inside the box (default: the osfarm session launcher
    with this interpreter); it receives the session arguments appended.
    """

    name = "sandbox"

    def __init__(self, settings: FarmSettings, launcher: list[str] | None = None):
        self.settings = settings
        self.bwrap = shutil.which("bwrap")
        if not self.bwrap:
            raise ProviderError("bubblewrap is not installed: apt-get install bubblewrap")
        if not shutil.which("Xvfb"):
            raise ProviderError("Xvfb is not installed: apt-get install xvfb")
        self.state_dir = Path(settings.state_dir).expanduser().absolute()
        self.root = self.state_dir / "sandbox"
        self.template = self.state_dir / "templates" / f"home-v{TEMPLATE_VERSION}"
        self.launcher = launcher or [sys.executable, "-m", "osfarm.desktop.launcher"]
        longest = self.root / ("x" * 12) / "run" / "guest.sock"
        if len(os.fsencode(longest)) > SOCKET_PATH_MAX:
            raise ProviderError(
                f"state_dir {self.state_dir} is too long for unix socket paths "
                f"({len(os.fsencode(longest))} > {SOCKET_PATH_MAX} bytes): set a shorter OSFARM_STATE_DIR"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        try:
            self._probe_bwrap()
            self._build_template()
        except BaseException:
            os.close(self._lock_fd)  # a failed construction must not keep the state_dir locked
            raise
        self._host_paths = _needed_host_paths(self.state_dir)
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._displays: dict[str, int] = {}
        self._xvfb: dict[str, psutil.Process] = {}  # found once per start: alive() stays cheap
        self._closed = False

    # -- setup ------------------------------------------------------------------------------

    def _take_lock(self) -> int:
        return take_farm_lock(self.state_dir / "sandbox.lock", f"state_dir {self.state_dir}",
                              "stop it or set a different OSFARM_STATE_DIR")

    def _probe_bwrap(self) -> None:
        """Fail at construction, with the reason, when namespaces cannot be made here."""
        proc = subprocess.run(
            [self.bwrap, *USER_ARGS, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--ro-bind", "/", "/",
             "--dev", "/dev", "--proc", "/proc", "--", "true"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if proc.returncode != 0:
            raise ProviderError(
                f"bubblewrap cannot create a sandbox here: {proc.stderr.strip() or proc.returncode} "
                "(needs user namespaces, or run as root; in a container allow unshare/mount)"
            )

    def _build_template(self) -> None:
        """Build the template home once (a rename makes it appear atomically), and the
        passwd/group files every box sees."""
        self.template.parent.mkdir(parents=True, exist_ok=True)
        (self.template.parent / "passwd").write_text(PASSWD)
        (self.template.parent / "group").write_text(GROUP)
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

    def _fresh_dirs(self, ddir: Path) -> None:
        """New empty run dir and a fresh home copied from the template (old ones moved aside)."""
        ddir.mkdir(parents=True, exist_ok=True)
        for sub in ("run", "home"):
            old = ddir / sub
            if old.exists():
                # Rename first (instant) so a big home left by a task never delays the restart.
                trash = ddir / f".trash-{sub}-{secrets.token_hex(4)}"
                old.rename(trash)
                asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, trash, True)
        (ddir / "run").mkdir(mode=0o700)
        shutil.copytree(self.template, ddir / "home", symlinks=True)

    def _pick_display(self, desktop_id: str, spec: DesktopSpec) -> int:
        """The X display number for a box.

        X clients try the abstract socket "@/tmp/.X11-unix/X<n>" before the socket file, and
        abstract names live in the network namespace. With a private network every box owns its
        namespace, so :0 is safe. Without one, all boxes and the host share the names: each box
        gets a number no X server on this host holds (Xvfb binds the abstract name too, so other
        servers started later skip it).
        """
        if spec.private_network:
            return 0
        taken = set(abstract_x_displays())
        taken.update(n for d, n in self._displays.items() if d != desktop_id)
        return next(n for n in range(100, 10000) if n not in taken)

    # -- protocol ---------------------------------------------------------------------------

    def bwrap_argv(self, desktop_id: str, spec: DesktopSpec) -> list[str]:
        ddir = self.desktop_dir(desktop_id)
        argv = [
            self.bwrap,
            "--die-with-parent",
            # The desktop's processes run as OSWorld's user (uid 1000, "user") in their own user
            # namespace; on the host they stay the farm's uid. Apps that refuse root (VLC) run.
            *USER_ARGS,
            "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--hostname", f"osfarm-{desktop_id}",
        ]  # fmt: skip
        if spec.private_network:
            argv.append("--unshare-net")
        argv += [
            # Root here has every capability; the box needs none (its / is read-only anyway)
            # and must not be able to remount or reach the host through them.
            "--cap-drop", "ALL",
            "--ro-bind", "/", "/",
            "--dev", "/dev",
            "--proc", "/proc",
            "--perms", "1777", "--tmpfs", "/dev/shm",
            "--perms", "1777", "--tmpfs", "/tmp",
            "--perms", "1777", "--tmpfs", "/var/tmp",
            "--tmpfs", "/run",
            # Hide other users' homes, root's secrets and the farm's state (other desktops'
            # tokens and homes) from the box ...
            *HIDDEN_ARGS,
            "--tmpfs", str(self.state_dir),
        ]  # fmt: skip
        # ... but keep the Python that runs the launcher (a venv or source tree may live there).
        for path in self._host_paths:
            argv += ["--ro-bind", path, path]
        argv += [
            "--bind", str(ddir / "run"), "/run/osfarm",
            "--bind", str(ddir / "home"), "/home/user",
            "--ro-bind", str(self.template.parent / "passwd"), "/etc/passwd",
            "--ro-bind", str(self.template.parent / "group"), "/etc/group",
            "--clearenv",
        ]  # fmt: skip
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        # Tasks run `python3 -c "import pyautogui ..."`: the farm's interpreter has it.
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
        env.setdefault("LANG", "C.UTF-8")
        env.update(
            HOME="/home/user",
            USER="user",
            LOGNAME="user",
            PYTHONUNBUFFERED="1",
            **{SANDBOX_ENV: str(ddir)},
        )
        env.update(spec.extra_env)
        for k, v in env.items():
            argv += ["--setenv", k, v]
        argv += ["--chdir", "/home/user", "--"]
        argv += self.launcher + [
            "--width", str(spec.width),
            "--height", str(spec.height),
            "--depth", str(spec.depth),
            "--display", f":{self._displays.get(desktop_id, 0)}",
            "--socket", "/run/osfarm/guest.sock",
            "--token-file", "/run/osfarm/token",
            "--state-file", "/run/osfarm/state.json",
        ]  # fmt: skip
        return argv

    async def reap_orphans(self) -> int:
        """Kill boxes left by an earlier farm with this state_dir and delete their dirs.

        Boxes die with their farm (--die-with-parent), so this matters only when that failed
        (e.g. the farm spawned from a thread that lived on). Matches bwrap processes whose
        command line names our sandbox dir and any process whose environment carries
        OSFARM_SANDBOX_DIR under it (a process that escaped the box's process tree).
        """
        ours = {p.pid for p in self._procs.values()}
        for pid in list(ours):
            ours.update(_descendants(pid))
        prefix = f"{self.root}/"
        victims: dict[int, str] = {}
        for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
            if p.pid in ours or p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = p.info["cmdline"] or []
            hit = next((a for a in cmd if a.startswith(prefix)), None) if p.info["name"] == "bwrap" else None
            if hit is None:
                with contextlib.suppress(psutil.Error):
                    env_dir = p.environ().get(SANDBOX_ENV, "")
                    if env_dir.startswith(prefix):
                        hit = env_dir
            if hit is not None:
                victims[p.pid] = hit[len(prefix) :].split("/")[0]
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
        if self._closed:
            raise ProviderError("sandbox provider is closed")
        check_desktop_id(desktop_id)
        old = self._procs.get(desktop_id)
        if old is not None and old.returncode is None:
            raise ProviderError(f"desktop {desktop_id} is already running")
        await self._kill(desktop_id, old)  # a crashed box: forget it
        t0 = time.monotonic()
        ddir = self.desktop_dir(desktop_id)
        self._fresh_dirs(ddir)
        run = ddir / "run"
        token = secrets.token_urlsafe(24)
        fd = os.open(run / "token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        self._displays[desktop_id] = self._pick_display(desktop_id, spec)
        log_path = run / "session.log"
        with open(log_path, "wb") as logf:
            proc = await asyncio.create_subprocess_exec(
                *self.bwrap_argv(desktop_id, spec),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._procs[desktop_id] = proc
        endpoint = GuestEndpoint(base_url="http://guest", token=token, uds=str(run / "guest.sock"))
        handle = DesktopHandle(
            id=desktop_id,
            provider=self.name,
            spec=spec,
            endpoint=endpoint,
            pid=proc.pid,
            info={"dir": str(ddir), "log": str(log_path)},
        )
        async with discarded_on_failure(desktop_id, lambda: self._kill(desktop_id, proc)):
            await self._wait_ready(handle, proc, t0)
        handle.info["start_s"] = f"{time.monotonic() - t0:.3f}"
        for pid in _descendants(proc.pid):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.name() == "Xvfb":
                    self._xvfb[desktop_id] = p
        log.info("sandbox ready id=%s pid=%d start_s=%s", desktop_id, proc.pid, handle.info["start_s"])
        return handle

    async def _wait_ready(self, handle: DesktopHandle, proc: asyncio.subprocess.Process, t0: float) -> None:
        async def launcher_exited() -> str | None:
            return None if proc.returncode is None else f"session launcher exited with code {proc.returncode}"

        async def session_log() -> str:
            return f"log {handle.info['log']}:\n{log_tail(handle.info['log'])}"

        await wait_guest_ready(handle, t0 + self.settings.start_timeout_s, self.settings.start_timeout_s,
                               box_gone=launcher_exited, box_log=session_log)

    async def _kill(self, desktop_id: str, proc: asyncio.subprocess.Process | None) -> None:
        """Kill the box: SIGKILL its PID-namespace init so the kernel kills every process in it.

        The launcher's own SIGTERM cleanup buys nothing here (home and /tmp are thrown away)
        and costs time on every reset. Killing init first also keeps the outer bwrap alive to
        reap it, so no zombie is left to the host's init.
        """
        self._procs.pop(desktop_id, None)
        self._xvfb.pop(desktop_id, None)
        self._displays.pop(desktop_id, None)
        if proc is None or proc.returncode is not None:
            return
        pids = [proc.pid, *_descendants(proc.pid)]
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children():  # the box's pid 1 (inner bwrap)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
        try:
            await asyncio.wait_for(proc.wait(), STOP_WAIT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), STOP_WAIT_S)
        left = await wait_pids_gone(pids, STOP_WAIT_S)
        if left:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            log.error("sandbox processes survived stop id=%s pids=%s", desktop_id, left)

    async def stop(self, handle: DesktopHandle) -> None:
        proc = self._procs.get(handle.id)
        if proc is not None and proc.pid == handle.pid:
            await self._kill(handle.id, proc)
        elif proc is None and handle.pid and _is_our_box(handle.pid, self.root):
            # A handle from before a provider restart: kill by pid (checked to be our bwrap).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(handle.pid, signal.SIGKILL)
            await wait_pids_gone([handle.pid], STOP_WAIT_S)
        ddir = self.desktop_dir(handle.id)
        if ddir.exists() and handle.id not in self._procs:
            await asyncio.to_thread(shutil.rmtree, ddir, True)
        log.info("sandbox stopped id=%s", handle.id)

    async def reset(self, handle: DesktopHandle) -> DesktopHandle:
        await self._kill(handle.id, self._procs.get(handle.id))
        return await self.start(handle.id, handle.spec)

    async def alive(self, handle: DesktopHandle) -> str | None:
        proc = self._procs.get(handle.id)
        if proc is None or proc.pid != handle.pid:
            return "sandbox is not running (stopped or owned by another provider)"
        if proc.returncode is not None:
            return f"sandbox exited with code {proc.returncode}: {log_tail(handle.info.get('log', ''), 3)}"
        xvfb = self._xvfb.get(handle.id)
        if xvfb is not None and not _running(xvfb):
            return "Xvfb exited"
        return None

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

    async def close(self) -> None:
        """Release the state_dir lock. Boxes still running are not stopped (the pool does
        that), but they die with this process anyway (--die-with-parent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


def _descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _running(p: psutil.Process) -> bool:
    """is_running also notices a reused pid (it compares create times)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _is_our_box(pid: int, root: Path) -> bool:
    try:
        p = psutil.Process(pid)
        return p.name() == "bwrap" and any(a.startswith(f"{root}/") for a in p.cmdline())
    except psutil.Error:
        return False
