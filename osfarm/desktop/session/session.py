"""One desktop session: the X display, the desktop's processes and environment, the state file,
and the clean stop. Driven by :mod:`osfarm.desktop.launch.launcher` (``osfarm desktop run``).

Start order, without waiting on anything but Xvfb's own readiness pipe:

1. Xvfb (:class:`osfarm.desktop.x11.xserver.Xvfb`),
2. a private D-Bus session bus, the window manager (openbox), the panel (tint2) and the AT-SPI
   bus launcher, all in parallel (the launcher does 1-2 in a thread while it imports the server
   stack, which takes longer),
3. the guest HTTP server (:mod:`osfarm.desktop.guest.guest_server`), in this process.

Apps launched later (through the guest) inherit the desktop environment set here: DISPLAY,
DBUS_SESSION_BUS_ADDRESS, the accessibility switches, HOME, XDG_RUNTIME_DIR. On stop every
descendant is killed (:func:`osfarm.desktop.box.process_tree.kill_tree`) and the socket, the X lock
and the state file are removed: no process or file of the session survives it.

Standard library only: the launcher imports this before the server stack, so that the stack's
import overlaps Xvfb's start.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from osfarm.desktop.box.agent_world import AgentWorld
from osfarm.desktop.box.process_tree import kill_tree
from osfarm.desktop.session import gnome
from osfarm.desktop.session.a11y_enable import A11Y_ENV, enable_dbus_send, enable_gio, launcher_runtime_dir
from osfarm.desktop.session.home_settings import DEFAULT_APPS, HOME_FILES, TOTEM_VIDEO_TYPES, home_files, write_missing
from osfarm.desktop.x11.xserver import Xvfb
from osfarm.errors import InfraError

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# Also the names of home_settings and a11y_enable that the providers and tests import from here.
__all__ = ["A11Y_ENV", "ASSETS", "DEFAULT_APPS", "HOME_FILES", "TOTEM_VIDEO_TYPES", "Session", "SessionConfig",
           "SessionError", "SessionState", "home_files"]


class SessionError(InfraError, RuntimeError):
    """The desktop could not be started; the message says what failed."""


@dataclass(frozen=True)
class SessionConfig:
    """What to start and where to serve (the launcher's options, see ``osfarm desktop run -h``)."""

    socket: str | None  # the guest listens on this unix socket ...
    port: int | None  # ... or on this TCP port of ``host`` (0 = any free)
    host: str = "127.0.0.1"
    width: int = 1920
    height: int = 1080
    depth: int = 24
    display: int | None = None  # None: the first free display
    state_file: str | None = None
    run_dir: str | None = None  # None: a new temp dir, removed on stop
    home: str = "/root"
    desktop: str = "light"  # gnome: OSWorld's Ubuntu GNOME (osfarm.desktop.session.gnome); light: openbox + tint2
    no_wm: bool = False
    no_panel: bool = False
    xvfb: str = "Xvfb"
    atspi_launcher: str = "/usr/libexec/at-spi-bus-launcher"
    grace: float = 2.0  # seconds between SIGTERM and SIGKILL on stop
    log_level: str = "warning"  # uvicorn's


class SessionState(TypedDict):
    """The state file, written once the guest listens (read by the providers)."""

    display: str  # ":N"
    width: int
    height: int
    pid: int  # the launcher's
    pids: dict[str, int]  # xvfb, openbox, tint2, dbus, atspi (those started)
    socket: str | None
    host: str | None  # None on a unix socket
    port: int | None
    dbus_address: str
    run_dir: str
    home: str
    # ms since the session's start: import_ms (the server stack's import, while Xvfb starts),
    # xvfb_ready_ms, desktop_spawned_ms (WM, panel, buses started), dbus_ready_ms, ready_ms (the
    # guest listens; the file is written then), and later (the file is written again):
    # wm_ready_ms, panel_ready_ms, a11y_ready_ms (the AT-SPI registry runs)
    timings_ms: dict[str, float]
    t0_monotonic: float  # the session's start on the monotonic clock (the host's too)
    box_monotonic: dict[str, float]  # a box's init steps (osfarm.desktop.box.box_init), same clock


class Session:
    def __init__(self, config: SessionConfig, token: str):
        self.config = config
        self.token = token
        self.t0 = time.monotonic()
        self.xvfb = Xvfb(config.xvfb, config.width, config.height, config.depth)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.display = ""
        self.dbus_address = ""
        self.env: dict[str, str] = {}
        self.run_dir: Path | None = None
        self._own_run_dir = False
        self.port: int | None = None  # the guest's TCP port once it listens (None on a socket)
        self.exit_reason = ""
        self.exit_code = 0
        self.timings: dict[str, float] = {}
        try:  # a box's init steps (osfarm.desktop.box.box_init.TIMES_VAR); not passed on to the desktop
            self.box_times: dict[str, float] = json.loads(os.environ.pop("OSFARM_BOX_TIMES", "") or "{}")
        except ValueError:
            self.box_times = {}
        self._state_lock = threading.Lock()
        # held while the agent's buses and shell are (re)started, so the shell's watcher never
        # starts a shell in the middle of a warm reset's restart (osfarm/desktop/warm/warm.py)
        self._agent_procs_lock = threading.RLock()
        self._published = False  # the state file is written: later marks write it again
        self.stopping = False
        # Set by a box's init (osfarm.desktop.box.box_init): the agent's processes (apps, the buses
        # they use) run there, as the agent's user; None on a plain workstation.
        self.agent = AgentWorld.from_env()

    # ---- startup

    def mark(self, what: str) -> None:
        """Record the time since start under ``what`` (the state file's ``timings_ms``)."""
        self.timings[what] = round((time.monotonic() - self.t0) * 1000, 1)
        if self._published:
            try:
                self.write_state()
            except OSError as e:
                log.warning("cannot write the state file: %s", e)

    def prepare_dirs(self) -> None:
        if self.config.run_dir:
            self.run_dir = Path(self.config.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.run_dir = Path(tempfile.mkdtemp(prefix="osfarm-run-"))
            self._own_run_dir = True
        os.chmod(self.run_dir, 0o700)

    def start_xvfb(self) -> None:
        """Launch Xvfb; :meth:`wait_xvfb` waits for it."""
        self.xvfb.start(self.config.display)
        assert self.xvfb.proc is not None
        self.procs["xvfb"] = self.xvfb.proc

    def wait_xvfb(self) -> None:
        self.xvfb.wait_ready()
        assert self.xvfb.proc is not None
        self.procs["xvfb"] = self.xvfb.proc  # a retry in auto mode started another one
        self.display = self.xvfb.name
        self.mark("xvfb_ready_ms")

    def prepare_home(self) -> None:
        """App settings OSWorld's VM image has and its tasks rely on, written only where the
        home lacks them (a fresh sandbox home always does)."""
        write_missing(Path(self.config.home), self.config.desktop)

    def build_env(self) -> None:
        env = dict(os.environ)
        env.update(A11Y_ENV)
        env["DISPLAY"] = self.display
        env["HOME"] = self.config.home
        assert self.run_dir is not None
        env["XDG_RUNTIME_DIR"] = str(self.run_dir)
        env.pop("OSFARM_GUEST_TOKEN", None)  # apps must not see the guest's secret
        env.pop("WAYLAND_DISPLAY", None)
        # OSWorld's guest is Ubuntu GNOME: with this set, xdg-open and xdg-mime go through gio
        # and type files as it does (a .csv opens in Calc, not in the text editor).
        env.setdefault("XDG_CURRENT_DESKTOP", "GNOME")
        # An X11 session, said the way apps check it (pyautogui.screenshot() needs it to use scrot).
        env["XDG_SESSION_TYPE"] = "x11"
        # OSWorld's names for our apps (google-chrome -> chromium) come first on PATH.
        env["PATH"] = f"{ASSETS / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        # For assets/bin/osfarm-settle (a box may name a wrapper that finds osfarm's packages).
        env["OSFARM_PYTHON"] = os.environ.get("OSFARM_PYTHON") or sys.executable
        if self.config.desktop == "gnome":
            env = gnome.session_env(env)
        self.env = env
        # The guest runs its subprocesses with os.environ, so make this process's env the
        # desktop env too (key by key, never empty: the main thread may be importing meanwhile).
        for key in [k for k in os.environ if k not in env]:
            os.environ.pop(key, None)
        os.environ.update(env)

    def _spawn(self, name: str, cmd: list[str], pass_fds: tuple[int, ...] = (),
               as_agent: bool = False, agent_root: bool = False) -> subprocess.Popen[bytes] | None:
        """Start one of the desktop's processes: the guest's own, or (``as_agent``, in a box)
        one of the agent's session (its buses: they run the services its apps activate; GNOME
        Shell), as the agent's root with ``agent_root`` (the GNOME desktop's system bus)."""
        exe = shutil.which(cmd[0], path=self.env.get("PATH"))
        if exe is None:
            log.warning("%s not found; %s not started", cmd[0], name)
            return None
        argv, env = [exe, *cmd[1:]], self.env
        if as_agent and self.agent is not None:
            cwd = "/" if agent_root else self.agent.home
            argv, env = self.agent.command(argv, cwd, root=agent_root), self.agent.env(self.env)
            if name == "atspi":
                # The AT-SPI bus listens in <XDG_RUNTIME_DIR>/at-spi/, and the guest must reach it:
                # the agent's runtime dir exists only in the agent's mounts (and is 0700), so the
                # launcher gets a dir in /tmp whose at-spi/ the guest made beforehand, sticky and
                # open to all (at-spi-bus-launcher keeps an existing dir as it is).
                env = {**env, "XDG_RUNTIME_DIR": launcher_runtime_dir()}
        proc = subprocess.Popen(argv, env=env, pass_fds=pass_fds,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.procs[name] = proc
        return proc

    def start_dbus(self, timeout: float = 5.0, link_wait: bool = True) -> subprocess.Popen[bytes] | None:
        """The agent's session bus; its address linked where Ubuntu has it (``link_wait`` False:
        the link's process is returned, for :meth:`_wait_link`)."""
        rfd, wfd = os.pipe()
        # In a box the bus is the agent's and the guest reaches it from another uid: our config
        # lets it in (ANONYMOUS); on a workstation the standard session bus.
        config = f"--config-file={ASSETS / 'dbus' / 'session.conf'}" if self.agent else "--session"
        proc = self._spawn("dbus", ["dbus-daemon", config, "--nofork", "--nopidfile",
                                    f"--print-address={wfd}"], pass_fds=(wfd,), as_agent=True)
        os.close(wfd)
        if proc is None:
            os.close(rfd)
            return None
        buf = b""
        deadline = time.monotonic() + timeout
        try:
            while b"\n" not in buf and time.monotonic() < deadline:
                ready, _, _ = select.select([rfd], [], [], 0.2)
                if ready:
                    chunk = os.read(rfd, 512)
                    if not chunk:
                        break
                    buf += chunk
        finally:
            os.close(rfd)
        addr = buf.decode().strip()
        if not addr:
            log.warning("dbus-daemon gave no address; apps run without a session bus")
            return None
        self.dbus_address = addr
        self.env["DBUS_SESSION_BUS_ADDRESS"] = addr
        os.environ["DBUS_SESSION_BUS_ADDRESS"] = addr
        link = self._link_user_bus(addr)
        if link_wait and link is not None:
            self._wait_link(link)
        if not self._published:  # a cold start's figure (not a warm reset's restart)
            self.mark("dbus_ready_ms")
        return link

    def _link_user_bus(self, addr: str) -> subprocess.Popen[bytes] | None:
        """Make the bus reachable where Ubuntu's systemd puts the user's: ``$XDG_RUNTIME_DIR/bus``
        (``/run/user/1000/bus``; OSWorld tasks export that address before ``gsettings``). Returns
        the process making the link (:meth:`_wait_link` waits for it)."""
        if self.agent is None or not addr.startswith("unix:path="):
            return None
        sock = addr.split(",", 1)[0].removeprefix("unix:path=")
        link = f"{self.agent.runtime_dir}/bus"
        try:
            return subprocess.Popen(self.agent.command(["ln", "-sfn", sock, link]), env=self.agent.env(self.env),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except OSError as e:
            log.warning("cannot link the session bus at %s: %s", link, e)
            return None

    @staticmethod
    def _wait_link(proc: subprocess.Popen[bytes]) -> None:
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log.warning("linking the session bus timed out")
            return
        if proc.returncode != 0:
            log.warning("cannot link the session bus: %s", err.decode(errors="replace").strip())

    def start_desktop(self) -> None:
        """WM, panel, D-Bus and AT-SPI; none of them delays the guest server."""
        if self.config.desktop == "gnome":
            self.check_gnome()
            self.start_agent_buses()
            self.start_gnome()
            self.mark("desktop_spawned_ms")
            # the guest answers once the shell is up: a task's first app must open beside the dock
            if gnome.wait_shell_ready(self.display, stop=lambda: self.stopping):
                self.mark("wm_ready_ms")
            elif not self.stopping:
                log.warning("GNOME Shell's top bar and dock did not come up in %.0f s", gnome.SHELL_READY_S)
            threading.Thread(target=self._watch_shell, daemon=True, name="shell-watch").start()
            return
        if not self.config.no_wm:
            self._spawn("openbox", ["openbox", "--config-file", str(ASSETS / "openbox-rc.xml")])
        if not self.config.no_panel:
            self._spawn("tint2", ["tint2", "-c", str(ASSETS / "tint2rc")])
        self.start_agent_buses()
        self.mark("desktop_spawned_ms")

    def check_gnome(self) -> None:
        """The GNOME desktop runs in a box (the shell is the agent's) with GNOME installed."""
        if self.agent is None:
            raise SessionError("the GNOME desktop runs in a box (sandbox, docker or libvirt provider): its shell "
                               "and system bus are the agent's; use --desktop light for a bare session")
        missing = gnome.missing_parts()
        if missing:
            raise SessionError(f"the GNOME desktop needs {', '.join(missing)}: install GNOME "
                               "(scripts/system-packages.txt) or use --desktop light")

    def start_gnome(self) -> None:
        """The box's system bus (the agent's root), GNOME Shell and the settings daemons (the
        agent's user), once the session bus runs (osfarm.desktop.session.gnome)."""
        if not self.dbus_address:
            raise SessionError("GNOME Shell needs the session bus, which did not start")
        self._spawn("system-bus", gnome.system_bus_command(), as_agent=True, agent_root=True)
        self._start_shell()
        for name, cmd in gnome.settings_daemon_commands().items():
            self._spawn(name, cmd, as_agent=True)

    def _start_shell(self) -> None:
        # the shell connects to the system bus as it starts: wait for its socket (the agent's /run)
        wait_bus = (f"i=0; while [ ! -S {gnome.SYSTEM_BUS_SOCKET} ] && [ $i -lt 250 ]; do sleep 0.02; "
                    "i=$((i+1)); done; exec \"$0\" \"$@\"")
        self._spawn("gnome-shell", ["/bin/sh", "-c", wait_bus, *gnome.shell_command()], as_agent=True)

    def _watch_shell(self) -> None:
        """Start GNOME Shell again when it exits, as Ubuntu's gnome-session does: without it the
        screen has no top bar, dock or window management, and nothing else would notice (the shell
        is the agent's process: it may be killed or crash; a health check failing on it would let
        an agent turn its own failures into infra errors). A shell that dies while the session bus
        is gone too is a warm reset's kill, whose restart starts the shell itself; the shell must be
        seen dead twice in a row, so the kill rounds' order cannot fool the check. Restarts back off
        (``gnome.SHELL_RESPAWN_BACKOFF_S``) so a shell that keeps dying costs little."""
        seen_dead = 0
        restarts: list[float] = []
        while not self.stopping:
            time.sleep(gnome.SHELL_WATCH_S)
            with self._agent_procs_lock:
                shell, bus = self.procs.get("gnome-shell"), self.procs.get("dbus")
                if self.stopping or shell is None or shell.poll() is None or bus is None or bus.poll() is not None:
                    seen_dead = 0
                    continue
                seen_dead += 1
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < gnome.SHELL_RESPAWN_WINDOW_S]
                wait_s = gnome.shell_respawn_wait_s(len(restarts))
                if seen_dead < 2 or (restarts and now - restarts[-1] < wait_s):
                    continue
                log.warning("GNOME Shell exited (code %s): starting it again", shell.returncode)
                restarts.append(now)
                seen_dead = 0
                gnome.clear_workarea(self.display)
                self._start_shell()
                self.write_state()  # the shell's new pid

    def restart_agent_buses(self) -> dict[str, float]:
        """Start the agent's buses anew once a warm reset killed them (osfarm/desktop/warm/warm.py):
        no process of the agent's survives a reset, not even one a task could have tampered with.
        Returns when the accessibility registry runs, with the ms each step took since the start."""
        with self._agent_procs_lock:
            return self._restart_agent_buses()

    def _restart_agent_buses(self) -> dict[str, float]:
        t0 = time.perf_counter()
        steps: dict[str, float] = {}

        def mark(what: str) -> None:
            steps[what] = round((time.perf_counter() - t0) * 1000, 1)

        for name in ("atspi", "dbus", "system-bus", "gnome-shell", *gnome.SETTINGS_DAEMONS):
            proc = self.procs.pop(name, None)
            if proc is not None:
                try:
                    proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self.dbus_address = ""
        # the old AT-SPI bus is gone: its address must not reach the new buses' services
        self.env.pop("AT_SPI_BUS_ADDRESS", None)
        os.environ.pop("AT_SPI_BUS_ADDRESS", None)
        link = self.start_dbus(link_wait=False)
        mark("dbus")
        if self.config.desktop == "gnome":
            gnome.clear_workarea(self.display)
            self.start_gnome()
            mark("gnome")
        if self.dbus_address:
            launcher = self.config.atspi_launcher
            if os.path.exists(launcher):
                self._spawn("atspi", [launcher, "--launch-immediately", "--a11y=1"], as_agent=True)
                if not enable_gio(self.dbus_address, self.env, mark, stop=lambda: self.stopping):
                    self._enable_a11y(poll_s=0.01)  # without gi: dbus-send, looked at more often
                    mark("registry")
            else:
                log.warning("%s not found; no accessibility tree", launcher)
        if link is not None:
            self._wait_link(link)
        mark("link")
        if self.config.desktop == "gnome":
            gnome.wait_shell_ready(self.display, stop=lambda: self.stopping)
            mark("shell")
        return steps

    def start_agent_buses(self) -> None:
        """The agent's D-Bus session bus and AT-SPI bus (the registry is started in the background)."""
        self.start_dbus()
        if self.dbus_address:
            launcher = self.config.atspi_launcher
            if os.path.exists(launcher):
                self._spawn("atspi", [launcher, "--launch-immediately", "--a11y=1"], as_agent=True)
                threading.Thread(target=self._enable_a11y, daemon=True, name="a11y-enable").start()
            else:
                log.warning("%s not found; no accessibility tree", launcher)

    def _enable_a11y(self, poll_s: float = 0.05) -> None:
        """Switch the AT-SPI bus on and start its registry (osfarm.desktop.session.a11y_enable), with
        ``dbus-send``; marks ``a11y_ready_ms`` once done."""
        if enable_dbus_send(self.env, stop=lambda: self.stopping, poll_s=poll_s):
            self.mark("a11y_ready_ms")

    # ---- running

    def xvfb_alive(self) -> bool:
        return self.xvfb.alive()

    def where(self) -> str:
        """Where the guest listens, for log lines."""
        return f"unix:{self.config.socket}" if self.config.socket else f"{self.config.host}:{self.port}"

    def state(self) -> SessionState:
        return {
            "display": self.display,
            "width": self.config.width,
            "height": self.config.height,
            "pid": os.getpid(),
            "pids": {name: p.pid for name, p in self.procs.items()},
            "socket": self.config.socket,
            "host": None if self.config.socket else self.config.host,
            "port": self.port,
            "dbus_address": self.dbus_address,
            "run_dir": str(self.run_dir),
            "home": self.config.home,
            "timings_ms": dict(self.timings),
            "t0_monotonic": self.t0,
            "box_monotonic": self.box_times,
        }

    def write_state(self) -> None:
        if not self.config.state_file:
            return
        with self._state_lock:
            path = Path(self.config.state_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.state(), indent=1))
            os.replace(tmp, path)
            self._published = True

    def on_signal(self, sig: int) -> None:
        """A stop signal arrived: remember why (the first reason wins)."""
        if not self.exit_reason:
            self.exit_reason = f"signal {signal.Signals(sig).name}"
        self.stopping = True

    # ---- shutdown

    def stop(self) -> None:
        self.stopping = True
        survivors = kill_tree(grace_s=self.config.grace)
        if survivors:
            log.error("processes survived SIGKILL: %s", survivors)
        if self.config.socket:
            try:
                Path(self.config.socket).unlink()
            except OSError:
                pass
        self.xvfb.release()
        if self._own_run_dir and self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.config.state_file:
            Path(self.config.state_file).unlink(missing_ok=True)
