"""The desktop session launcher: ``python -m osfarm.desktop.session`` (``osfarm desktop run``).

One Python process per desktop. It starts, in this order and without waiting on anything but
Xvfb's own readiness pipe:

1. Xvfb (``-displayfd`` tells us the display number once it accepts clients; stale X locks
   are removed first),
2. a private D-Bus session bus, the window manager (openbox), the panel (tint2) and the AT-SPI
   bus launcher, all in parallel,
3. the guest HTTP server (uvicorn, in this process) on a unix socket or a loopback port.

The state file is written once the server listens. Apps launched later (through the guest)
inherit the desktop environment set here: DISPLAY, DBUS_SESSION_BUS_ADDRESS, the accessibility
switches, HOME, XDG_RUNTIME_DIR.

The launcher is a child subreaper, so apps that double-fork (soffice, chromium) stay its
descendants. On SIGTERM/SIGINT, or when Xvfb dies, it stops the server, SIGTERMs every
descendant, SIGKILLs what is left after a short grace period, removes its socket and the X lock,
and exits: no process of the session survives it.

Import cost matters (a reset is kill + start): this module imports only the standard library at
the top; the server stack (fastapi, uvicorn, PIL) is imported while Xvfb is starting.
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent / "assets"
# Settings from OSWorld's VM image: VLC's HTTP interface on 8080 with password "password"
# (its getters read /requests/status.xml) and no first-run privacy dialog over the player, and
# a graphical default for text files so that /setup/open_file of a .txt opens a window named
# after the file.
HOME_FILES = {
    ".config/vlc/vlcrc": ("[qt]\nqt-privacy-ask=0\n[core]\nextraintf=http\nhttp-port=8080\n"
                          "[lua]\nhttp-password=password\n"),
    # The box has no sound card: ALSA's default device is a sink that discards the samples, so
    # players run at normal speed instead of failing with an "audio output failed" dialog.
    ".asoundrc": "pcm.!default {\n    type null\n}\n",
    ".config/mimeapps.list": (
        "[Default Applications]\ntext/plain=org.xfce.mousepad.desktop\n"
        # text/csv is a kind of text/plain: without this line gio would hand it to the editor.
        "text/csv=libreoffice-calc.desktop\ntext/tab-separated-values=libreoffice-calc.desktop\n"
    ),
    # LibreOffice as a used profile: no Tip of the Day dialog and no "what's new" bar over the
    # first document, which would cover the screen an agent (or a reference solution) sees.
    ".config/libreoffice/4/user/registrymodifications.xcu": (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<oor:items xmlns:oor="http://openoffice.org/2001/registry" '
        'xmlns:xs="http://www.w3.org/2001/XMLSchema" '
        'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">\n'
        '<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="ShowTipOfTheDay" '
        'oor:op="fuse"><value>false</value></prop></item>\n'
        '<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="FirstRun" '
        'oor:op="fuse"><value>false</value></prop></item>\n'
        '<item oor:path="/org.openoffice.Setup/Product"><prop oor:name="ooSetupLastVersion" '
        'oor:op="fuse"><value>7.4</value></prop></item>\n'
        '</oor:items>\n'
    ),
}
PR_SET_CHILD_SUBREAPER = 36

# Environment every app of the desktop gets (accessibility on for GTK, Qt and LibreOffice).
A11Y_ENV = {
    "GTK_MODULES": "gail:atk-bridge",
    "QT_ACCESSIBILITY": "1",
    "QT_LINUX_ACCESSIBILITY_ALWAYS_ON": "1",
    "SAL_USE_VCLPLUGIN": "gtk3",
    "NO_AT_BRIDGE": "0",
}


class SessionError(RuntimeError):
    """The desktop could not be started; the message says what failed."""


class _DisplayBusy(Exception):
    """Xvfb exited before becoming ready (usually: the display is taken)."""


class _Stop(BaseException):
    """Raised from the signal handler while the launcher is still starting up."""


def log(msg: str) -> None:
    sys.stderr.write(f"osfarm-session[{os.getpid()}]: {msg}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- process helpers


def set_child_subreaper() -> bool:
    """Make orphaned descendants reparent to us instead of to init (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children_via_task_files(pid: int) -> list[int] | None:
    """Children of ``pid`` from /proc/<pid>/task/*/children (None if the kernel lacks them)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # thread exited meanwhile
            return None  # kernel built without CONFIG_PROC_CHILDREN
        except (OSError, ValueError):
            continue
    return out


def _ppid_map() -> dict[int, list[int]]:
    """parent -> children for every process, from /proc/*/stat (fallback path)."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may contain spaces and parentheses: fields start after the last ')'.
        fields = stat[stat.rfind(b")") + 2:].split()
        tree.setdefault(int(fields[1]), []).append(int(name))
    return tree


def descendants(root: int | None = None) -> list[int]:
    """Every live descendant pid of ``root`` (default: this process), parents first."""
    root = os.getpid() if root is None else root
    out: list[int] = []
    stack = [root]
    fallback: dict[int, list[int]] | None = None
    while stack:
        pid = stack.pop()
        kids = None if fallback is not None else _children_via_task_files(pid)
        if kids is None:
            if fallback is None:
                fallback = _ppid_map()
            kids = fallback.get(pid, [])
        for k in kids:
            if k not in out:
                out.append(k)
                stack.append(k)
    return out


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")


def reap_all() -> None:
    """Collect every exited child (used only while shutting down)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(grace_s: float = 2.0) -> list[int]:
    """SIGTERM every descendant, wait up to ``grace_s``, SIGKILL the rest. Returns survivors."""
    for pid in descendants():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        reap_all()
        alive = [p for p in descendants() if not _is_zombie(p)]
        if not alive:
            break
        # New processes may have been forked between the walk and the signal: TERM them too.
        for pid in alive:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    for _ in range(50):
        left = descendants()
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
        reap_all()
    reap_all()
    return [p for p in descendants() if not _is_zombie(p)]


class ZombieReaper:
    """Reaps orphans adopted through the subreaper bit.

    ``subprocess`` owns the children it created and reaps them itself; reaping those here would
    make their ``returncode`` wrong. Adopted orphans have no owner, so a zombie child that stays a
    zombie for ``min_age_s`` is collected here. Call :meth:`tick` periodically (one thread).
    """

    def __init__(self, min_age_s: float = 1.0, keep: set[int] | None = None):
        self.min_age_s = min_age_s
        self.keep = keep if keep is not None else set()
        self._seen: dict[int, float] = {}

    def tick(self) -> int:
        now = time.monotonic()
        kids = _children_via_task_files(os.getpid())
        if kids is None:
            kids = _ppid_map().get(os.getpid(), [])
        zombies = {p for p in kids if p not in self.keep and _is_zombie(p)}
        reaped = 0
        for pid in list(self._seen):
            if pid not in zombies:
                del self._seen[pid]
        for pid in zombies:
            first = self._seen.setdefault(pid, now)
            if now - first >= self.min_age_s:
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        reaped += 1
                except ChildProcessError:
                    pass
                self._seen.pop(pid, None)
        return reaped


# --------------------------------------------------------------------------- X display


def _x_lock(n: int) -> Path:
    return Path(f"/tmp/.X{n}-lock")


def _x_socket(n: int) -> Path:
    return Path(f"/tmp/.X11-unix/X{n}")


def _lock_is_stale(lock: Path) -> bool:
    """True if the X lock's owner is gone (or the pid now belongs to something else)."""
    try:
        pid = int(lock.read_text().strip() or "0")
    except (OSError, ValueError):
        return True  # unreadable / garbage lock
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # someone else's live process
    # Pids are reused quickly in small pid namespaces: a live pid that is not an X server
    # does not hold the display.
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return True
    return not (comm.startswith("X") or comm.startswith("Xvfb"))


def clear_stale_x_lock(n: int) -> bool:
    """Remove /tmp/.X<n>-lock and its socket if the lock is stale. Returns True if removed."""
    lock = _x_lock(n)
    if not lock.exists() or not _lock_is_stale(lock):
        return False
    lock.unlink(missing_ok=True)
    try:
        _x_socket(n).unlink()
    except OSError:
        pass
    return True


def clear_all_stale_x_locks() -> list[int]:
    removed = []
    for lock in Path("/tmp").glob(".X*-lock"):
        num = lock.name[2:-5]
        if num.isdigit() and clear_stale_x_lock(int(num)):
            removed.append(int(num))
    return removed


def parse_display(value: str) -> int | None:
    """'auto' -> None, ':N' or 'N' -> N."""
    if value == "auto":
        return None
    v = value[1:] if value.startswith(":") else value
    if not v.isdigit():
        raise argparse.ArgumentTypeError(f"--display must be 'auto' or ':N', got {value!r}")
    return int(v)


# --------------------------------------------------------------------------- the session


class Session:
    def __init__(self, args: argparse.Namespace, token: str):
        self.args = args
        self.token = token
        self.t0 = time.monotonic()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.display_num: int | None = None
        self.display = ""
        self.dbus_address = ""
        self.env: dict[str, str] = {}
        self.run_dir: Path | None = None
        self._own_run_dir = False
        self.server: Any = None
        self.exit_reason = ""
        self.exit_code = 0
        self.timings: dict[str, float] = {}
        self.stopping = False

    # ---- startup

    def _mark(self, what: str) -> None:
        self.timings[what] = round((time.monotonic() - self.t0) * 1000, 1)

    def prepare_dirs(self) -> None:
        if self.args.run_dir:
            self.run_dir = Path(self.args.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.run_dir = Path(tempfile.mkdtemp(prefix="osfarm-run-"))
            self._own_run_dir = True
        os.chmod(self.run_dir, 0o700)

    def start_xvfb(self) -> None:
        """Launch Xvfb on the wanted display, or on the first display that looks free."""
        want = self.args.display
        if want is None:
            clear_all_stale_x_locks()
            self._tried: set[int] = set()
            num = self._next_free_display()
        else:
            if clear_stale_x_lock(want):
                log(f"removed stale X lock for :{want}")
            num = want
        self._launch_xvfb(num)

    def _next_free_display(self) -> int:
        # Xvfb's own -displayfd scan only checks that it can bind the socket; in a /tmp shared
        # with other X servers (other namespaces, -nolisten local) that is not enough, so skip
        # displays with a lock or socket file too.
        for n in range(0, 1000):
            if n in self._tried or _x_lock(n).exists() or _x_socket(n).exists():
                continue
            return n
        raise SessionError("no free X display number below 1000")

    def _launch_xvfb(self, num: int) -> None:
        args = self.args
        rfd, wfd = os.pipe()
        cmd = [
            args.xvfb, f":{num}", "-displayfd", str(wfd),
            "-screen", "0", f"{args.width}x{args.height}x{args.depth}",
            "-nolisten", "tcp", "-noreset", "-dpi", "96",
            "+extension", "RANDR",
        ]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(wfd,), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL)
        except FileNotFoundError:
            os.close(rfd)
            os.close(wfd)
            raise SessionError(f"{args.xvfb}: not found; install the xvfb package") from None
        os.close(wfd)
        self.procs["xvfb"] = proc
        self._xvfb_pipe = rfd
        self._xvfb_num = num

    def wait_xvfb(self, timeout: float = 15.0) -> None:
        """Block until Xvfb writes its display number (it accepts clients from then on).

        In auto mode a display taken meanwhile (Xvfb exits at once) is retried on the next one.
        """
        for _attempt in range(20):
            try:
                return self._wait_xvfb_once(timeout)
            except _DisplayBusy:
                if self.args.display is not None:
                    raise SessionError(f"Xvfb could not start on :{self.args.display} (display in use?)") from None
                self._tried.add(self._xvfb_num)
                self._launch_xvfb(self._next_free_display())
        raise SessionError("Xvfb failed to start on 20 displays in a row")

    def _wait_xvfb_once(self, timeout: float) -> None:
        rfd = self._xvfb_pipe
        proc = self.procs["xvfb"]
        buf = b""
        deadline = time.monotonic() + timeout
        try:
            while not buf.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SessionError(f"Xvfb did not become ready within {timeout:g}s")
                ready, _, _ = select.select([rfd], [], [], min(left, 0.5))
                if ready:
                    chunk = os.read(rfd, 64)
                    if not chunk:
                        proc.wait()
                        raise _DisplayBusy()
                    buf += chunk
                elif proc.poll() is not None:
                    raise _DisplayBusy()
        finally:
            os.close(rfd)
        self.display_num = int(buf.strip())
        self.display = f":{self.display_num}"
        self._write_x_lock()
        self._mark("xvfb_ready_ms")

    def _write_x_lock(self) -> None:
        """Claim /tmp/.X<n>-lock for our Xvfb.

        With -displayfd Xvfb neither checks nor writes lock files; writing one keeps X servers
        started the classic way (``Xvfb :N``, xvfb-run) from picking our display.
        """
        assert self.display_num is not None
        lock = _x_lock(self.display_num)
        if lock.exists() and _lock_is_stale(lock):
            lock.unlink(missing_ok=True)  # not the socket: our Xvfb just created it
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        except OSError:
            return  # held by a live X server for another screen of ours, or /tmp read-only
        with os.fdopen(fd, "w") as f:
            f.write(f"{self.procs['xvfb'].pid:>10}\n")

    def prepare_home(self) -> None:
        """App settings OSWorld's VM image has and its tasks rely on, written only where the
        home lacks them (a fresh sandbox home always does)."""
        home = Path(self.args.home)
        for rel, text in HOME_FILES.items():
            path = home / rel
            if path.exists():
                continue
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            except OSError as e:
                log(f"cannot write {path}: {e.strerror}")

    def build_env(self) -> None:
        env = dict(os.environ)
        env.update(A11Y_ENV)
        env["DISPLAY"] = self.display
        env["HOME"] = self.args.home
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
        env["OSFARM_PYTHON"] = sys.executable  # for assets/bin/osfarm-settle
        self.env = env
        # The guest runs its subprocesses with os.environ, so make this process's env the
        # desktop env too.
        os.environ.clear()
        os.environ.update(env)

    def _spawn(self, name: str, cmd: list[str], **kw: Any) -> subprocess.Popen[bytes] | None:
        exe = shutil.which(cmd[0], path=self.env.get("PATH"))
        if exe is None:
            log(f"{cmd[0]} not found; {name} not started")
            return None
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw.setdefault("stdout", subprocess.DEVNULL)
        proc = subprocess.Popen([exe, *cmd[1:]], env=self.env, **kw)
        self.procs[name] = proc
        return proc

    def start_dbus(self, timeout: float = 5.0) -> None:
        rfd, wfd = os.pipe()
        proc = self._spawn("dbus", ["dbus-daemon", "--session", "--nofork", "--nopidfile",
                                    f"--print-address={wfd}"], pass_fds=(wfd,))
        os.close(wfd)
        if proc is None:
            os.close(rfd)
            return
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
            log("dbus-daemon gave no address; apps run without a session bus")
            return
        self.dbus_address = addr
        self.env["DBUS_SESSION_BUS_ADDRESS"] = addr
        os.environ["DBUS_SESSION_BUS_ADDRESS"] = addr
        self._mark("dbus_ready_ms")

    def start_desktop(self) -> None:
        """WM, panel, D-Bus and AT-SPI; none of them delays the guest server."""
        if not self.args.no_wm:
            self._spawn("openbox", ["openbox", "--config-file", str(ASSETS / "openbox-rc.xml")])
        if not self.args.no_panel:
            self._spawn("tint2", ["tint2", "-c", str(ASSETS / "tint2rc")])
        self.start_dbus()
        if self.dbus_address:
            launcher = self.args.atspi_launcher
            if os.path.exists(launcher):
                self._spawn("atspi", [launcher, "--launch-immediately", "--a11y=1"])
                threading.Thread(target=self._enable_a11y, daemon=True, name="a11y-enable").start()
            else:
                log(f"{launcher} not found; no accessibility tree")

    def _enable_a11y(self) -> None:
        """Set org.a11y.Status.IsEnabled once the bus launcher owns its name.

        ``--a11y=1`` already asks for it; setting the property too covers launcher versions
        that ignore the flag, and GTK apps started later read it at startup.
        """
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not self.stopping:
            r = subprocess.run(
                ["dbus-send", "--session", "--print-reply", "--dest=org.freedesktop.DBus",
                 "/org/freedesktop/DBus", "org.freedesktop.DBus.NameHasOwner", "string:org.a11y.Bus"],
                capture_output=True, text=True, env=self.env,
            )
            if "boolean true" in r.stdout:
                subprocess.run(
                    ["dbus-send", "--session", "--print-reply", "--dest=org.a11y.Bus", "/org/a11y/bus",
                     "org.freedesktop.DBus.Properties.Set", "string:org.a11y.Status",
                     "string:IsEnabled", "variant:boolean:true"],
                    capture_output=True, env=self.env,
                )
                self._start_registry()
                self._mark("a11y_ready_ms")
                return
            time.sleep(0.05)
        if not self.stopping:
            log("AT-SPI bus did not come up; /accessibility will be empty")

    def _start_registry(self) -> None:
        """Start at-spi2-registryd now (it is D-Bus-activated on the a11y bus, normally by the
        first app), so the bus answers health checks and the first tree request is not slowed."""
        r = subprocess.run(
            ["dbus-send", "--session", "--print-reply=literal", "--dest=org.a11y.Bus", "/org/a11y/bus",
             "org.a11y.Bus.GetAddress"], capture_output=True, text=True, env=self.env,
        )
        address = r.stdout.strip()
        if r.returncode != 0 or not address:
            return
        # Apps launched from now on get the bus directly instead of reading it from the X root
        # window, which any client of this display may overwrite.
        self.env["AT_SPI_BUS_ADDRESS"] = address
        os.environ["AT_SPI_BUS_ADDRESS"] = address
        subprocess.run(
            ["dbus-send", f"--bus={address}", "--print-reply", "--dest=org.freedesktop.DBus",
             "/org/freedesktop/DBus", "org.freedesktop.DBus.StartServiceByName",
             "string:org.a11y.atspi.Registry", "uint32:0"], capture_output=True, env=self.env,
        )

    # ---- serving

    def xvfb_alive(self) -> bool:
        p = self.procs.get("xvfb")
        return p is not None and p.poll() is None

    def state(self) -> dict[str, Any]:
        port = None
        if self.server is not None and self.args.socket is None:
            try:
                port = self.server.servers[0].sockets[0].getsockname()[1]
            except (AttributeError, IndexError):
                port = self.args.port
        return {
            "display": self.display,
            "width": self.args.width,
            "height": self.args.height,
            "pid": os.getpid(),
            "pids": {name: p.pid for name, p in self.procs.items()},
            "socket": self.args.socket,
            "host": None if self.args.socket else self.args.host,
            "port": port,
            "dbus_address": self.dbus_address,
            "run_dir": str(self.run_dir),
            "home": self.args.home,
            "timings_ms": self.timings,
        }

    def write_state(self) -> None:
        if not self.args.state_file:
            return
        path = Path(self.args.state_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.state(), indent=1))
        os.replace(tmp, path)

    def serve(self) -> None:
        import asyncio

        import uvicorn

        from osfarm.desktop.guest import create_app

        session = self
        app = create_app(self.token, self.display, home=self.args.home, alive=self.xvfb_alive,
                         work_dir=str(self.run_dir))

        class _Server(uvicorn.Server):
            # uvicorn re-raises captured signals after serving; we must clean up first, so the
            # launcher handles signals itself.
            def capture_signals(self):  # type: ignore[override]
                import contextlib

                return contextlib.nullcontext()

        # Keep idle connections longer than any client does (the farm's 30 s, httpx's 5 s): with
        # uvicorn's 5 s default, a farm connection idle 5-15 s (an agent thinking) was reused
        # just after the guest closed it, and the step failed with a broken pipe.
        kw: dict[str, Any] = dict(log_level=self.args.log_level, lifespan="on", access_log=False,
                                  timeout_graceful_shutdown=1, ws="none", timeout_keep_alive=75)
        if self.args.socket:
            sock = Path(self.args.socket)
            if sock.exists() or sock.is_symlink():
                sock.unlink()
            kw["uds"] = str(sock)
        else:
            kw["host"], kw["port"] = self.args.host, self.args.port
        config = uvicorn.Config(app, **kw)
        self.server = server = _Server(config)

        async def watch() -> None:
            reaper = ZombieReaper(keep={p.pid for p in self.procs.values()})
            while not server.started and not server.should_exit:
                await asyncio.sleep(0.005)
            if server.started:
                session._mark("ready_ms")
                session.write_state()
                where = (f"unix:{self.args.socket}" if self.args.socket
                         else f"{self.args.host}:{session.state()['port']}")
                log(f"ready on {self.display} at {where} in {self.timings['ready_ms']:.0f} ms")
            n = 0
            while not server.should_exit:
                if not session.xvfb_alive():
                    session.exit_reason = f"Xvfb exited (code {session.procs['xvfb'].returncode})"
                    session.exit_code = 1
                    log(session.exit_reason + "; stopping")
                    server.should_exit = True
                    break
                n += 1
                if n % 5 == 0:
                    reaper.keep = {p.pid for p in self.procs.values()}
                    await asyncio.to_thread(reaper.tick)
                await asyncio.sleep(0.2)

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.add_signal_handler(sig, session._on_signal, sig)
            watcher = asyncio.create_task(watch())
            try:
                await server.serve()
            finally:
                watcher.cancel()

        asyncio.run(main())

    def _on_signal(self, sig: int) -> None:
        if not self.exit_reason:
            self.exit_reason = f"signal {signal.Signals(sig).name}"
        self.stopping = True
        if self.server is not None:
            if self.server.should_exit:
                self.server.force_exit = True
            self.server.should_exit = True

    # ---- shutdown

    def stop(self) -> None:
        self.stopping = True
        survivors = kill_tree(grace_s=self.args.grace)
        if survivors:
            log(f"processes survived SIGKILL: {survivors}")
        if self.args.socket:
            try:
                Path(self.args.socket).unlink()
            except OSError:
                pass
        if self.display_num is not None:
            lock = _x_lock(self.display_num)
            xvfb = self.procs.get("xvfb")
            try:
                owner = int(lock.read_text().strip())
            except (OSError, ValueError):
                owner = None
            if xvfb is not None and owner == xvfb.pid:
                lock.unlink(missing_ok=True)
                try:
                    _x_socket(self.display_num).unlink()
                except OSError:
                    pass
        if self._own_run_dir and self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.args.state_file:
            Path(self.args.state_file).unlink(missing_ok=True)


# --------------------------------------------------------------------------- CLI


def is_loopback_host(host: str) -> bool:
    """True for localhost and loopback addresses (the only places our servers may listen)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="osfarm desktop run",
        description="Start a desktop (Xvfb, openbox, tint2, D-Bus, AT-SPI) and its guest server.",
    )
    p.add_argument("--width", type=int, default=1920)
    p.add_argument("--height", type=int, default=1080)
    p.add_argument("--depth", type=int, default=24, choices=[8, 16, 24])
    p.add_argument("--display", type=parse_display, default=None, metavar="auto|:N",
                   help="X display; auto (default) lets Xvfb pick a free one")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", help="unix socket path for the guest server")
    where.add_argument("--port", type=int, default=None, help="TCP port (with --host; 0 = any free)")
    p.add_argument("--host", default="127.0.0.1", help="loopback address for --port")
    p.add_argument("--allow-non-loopback", action="store_true",
                   help="allow a non-loopback --host (VMs whose only network is a host forward)")
    p.add_argument("--token-file", help="file holding the bearer token (else $OSFARM_GUEST_TOKEN)")
    p.add_argument("--state-file", help="JSON written atomically once the guest server is ready")
    p.add_argument("--run-dir", help="private runtime dir (XDG_RUNTIME_DIR); default: a new temp dir")
    p.add_argument("--home", default=os.environ.get("HOME", "/root"), help="HOME for apps (default $HOME)")
    p.add_argument("--no-wm", action="store_true", help="do not start openbox")
    p.add_argument("--no-panel", action="store_true", help="do not start tint2")
    p.add_argument("--xvfb", default="Xvfb", help=argparse.SUPPRESS)
    p.add_argument("--atspi-launcher", default="/usr/libexec/at-spi-bus-launcher", help=argparse.SUPPRESS)
    p.add_argument("--grace", type=float, default=2.0, help="seconds between SIGTERM and SIGKILL on stop")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    return p


def read_token(args: argparse.Namespace) -> str:
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as e:
            raise SessionError(f"--token-file {args.token_file}: {e.strerror}") from None
        if not token:
            raise SessionError(f"--token-file {args.token_file}: file is empty")
        return token
    token = os.environ.get("OSFARM_GUEST_TOKEN", "").strip()
    if not token:
        raise SessionError("a bearer token is required: pass --token-file PATH or set OSFARM_GUEST_TOKEN")
    return token


def keep_big_buffers_in_heap() -> None:
    """Every screenshot allocates a few frame-sized buffers (8 MB at 1920x1080). glibc serves
    those with fresh mmaps, and touching their pages for the first time costs more than the
    capture itself (measured: grab 24 ms -> 8 ms). Raising the mmap and trim thresholds lets
    freed frames be reused from the heap."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 2**20)
    libc.mallopt(m_trim_threshold, 128 * 2**20)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.socket is None and args.port is None:
        parser.error("give --socket PATH or --port N")
    if args.socket and len(os.fsencode(args.socket)) >= 108:
        parser.error(f"--socket path is {len(os.fsencode(args.socket))} bytes; unix sockets allow at most 107")
    if args.socket is None and not is_loopback_host(args.host) and not args.allow_non_loopback:
        parser.error(f"--host {args.host} is not a loopback address; the guest only binds loopback "
                     "or a unix socket (use --allow-non-loopback inside a VM)")
    try:
        token = read_token(args)
    except SessionError as e:
        log(str(e))
        return 2

    keep_big_buffers_in_heap()
    session = Session(args, token)

    def early_stop(sig: int, _frame: Any) -> None:
        session.exit_reason = f"signal {signal.Signals(sig).name}"
        session.stopping = True
        raise _Stop()

    old = {s: signal.signal(s, early_stop) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    if not set_child_subreaper():
        log("could not become a child subreaper; double-forked apps may outlive the session")
    try:
        try:
            session.prepare_dirs()
            session.start_xvfb()
            # Import the server stack while Xvfb starts: the two overlap.
            t_imp = time.monotonic()
            import osfarm.desktop.guest  # noqa: F401
            import uvicorn  # noqa: F401

            session.timings["import_ms"] = round((time.monotonic() - t_imp) * 1000, 1)

            session.wait_xvfb()
            session.build_env()
            session.prepare_home()
            session.start_desktop()
            # serve() hands SIGTERM/SIGINT to the asyncio loop once it runs; until then
            # early_stop stays in charge.
            session.serve()
        except SessionError as e:
            log(str(e))
            session.exit_code = 1
        except (_Stop, KeyboardInterrupt):
            pass
        except SystemExit as e:  # uvicorn exits on bind failures
            log(f"guest server failed to start (exit {e.code})")
            session.exit_code = 1
        finally:
            # Signals during cleanup must not interrupt it.
            for s in old:
                signal.signal(s, signal.SIG_IGN)
            session.stop()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if session.exit_reason:
        log(f"stopped: {session.exit_reason}")
    return session.exit_code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Worker threads blocked in long waits (wait_for_window ...) must not keep a stopped
    # desktop's process alive.
    os._exit(code)
