"""The desktop session launcher: ``python -m osfarm.desktop.launch.launcher`` (``osfarm desktop run``).

What every provider starts in its box: one Python process per desktop that starts a
:class:`~osfarm.desktop.session.session.Session` (Xvfb, openbox, tint2, D-Bus, AT-SPI) and serves its
guest API (:mod:`osfarm.desktop.guest.guest_server`) on a unix socket or a loopback port, then
writes the state file. On SIGTERM/SIGINT/SIGHUP, or when Xvfb dies, it stops the server,
kills every descendant (it is a child subreaper, so double-forked apps are among them), removes
its socket and X lock, and exits.

Import cost matters (a reset is kill + start): this module and the session import only the
standard library; the server stack (fastapi, uvicorn, numpy, PIL, Xlib) is imported while Xvfb
is starting.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path
from types import FrameType

from osfarm.desktop.box.process_tree import set_child_subreaper
from osfarm.desktop.session.gnome import DESKTOPS
from osfarm.desktop.session.session import Session, SessionConfig
from osfarm.desktop.x11.xserver import DisplayError
from osfarm.errors import OsfarmError
from osfarm.http.hosts import is_loopback_host

# Named, not __name__: run with -m this module is __main__, outside the "osfarm.desktop" logger.
log = logging.getLogger("osfarm.desktop.launch.launcher")

BLAS_THREADS = "OPENBLAS_NUM_THREADS"  # read once, when numpy loads its OpenBLAS


class TokenError(OsfarmError, ValueError):
    """No usable bearer token; the message says where one was looked for."""


class _Stop(BaseException):
    """Raised from the signal handler while the launcher is still starting up."""


def parse_display(value: str) -> int | None:
    """'auto' -> None, ':N' or 'N' -> N."""
    if value == "auto":
        return None
    v = value[1:] if value.startswith(":") else value
    if not v.isdigit():
        raise argparse.ArgumentTypeError(f"--display must be 'auto' or ':N', got {value!r}")
    return int(v)


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
    p.add_argument("--desktop", choices=list(DESKTOPS), default="light",
                   help="gnome: OSWorld's Ubuntu GNOME (top bar, dock, Yaru; needs a box); light: openbox + tint2")
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
            raise TokenError(f"--token-file {args.token_file}: {e.strerror}") from None
        if not token:
            raise TokenError(f"--token-file {args.token_file}: file is empty")
        return token
    token = os.environ.get("OSFARM_GUEST_TOKEN", "").strip()
    if not token:
        raise TokenError("a bearer token is required: pass --token-file PATH or set OSFARM_GUEST_TOKEN")
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


def log_to_stderr() -> None:
    """The desktop's own messages go to stderr (the box's log), one line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("osfarm-session[%(process)d]: %(message)s"))
    logger = logging.getLogger("osfarm.desktop")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def import_numpy_single_threaded() -> None:
    """Load numpy now with OpenBLAS told to start no worker threads, then put the environment
    back, before anything but Xvfb has started (no process of the desktop inherits it). The
    guest uses numpy for elementwise work only (cursor blending, settle checks), never BLAS;
    OpenBLAS's default, a primed worker thread per core at load, made numpy's import cost
    120-200 ms of CPU instead of ~65 ms (2 cores)."""
    saved = os.environ.get(BLAS_THREADS)
    if saved is None:
        os.environ[BLAS_THREADS] = "1"
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass  # the server stack's import says what is missing
    finally:
        if saved is None:
            os.environ.pop(BLAS_THREADS, None)


def drop_cwd_from_path() -> None:
    """``python -m`` puts the working directory first on ``sys.path``, and a box starts the
    launcher in the agent's home, which the agent can write: every module the guest imports
    later (lazily: httpx on the first download, gi, mss) could then be the agent's, run as the
    guest. Imports resolve from the interpreter's own paths only (a forked box's template runs
    with ``-P``, the same)."""
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]


def start_desktop(session: Session, failed: list[BaseException]) -> None:
    """Once Xvfb is up: the desktop's environment, the home's settings, its processes (a thread
    of its own, while the main thread imports the server stack); an error goes to ``failed``."""
    try:
        session.wait_xvfb()
        if session.stopping:
            return
        session.build_env()
        session.prepare_home()
        if not session.stopping:
            session.start_desktop()
    except BaseException as e:  # noqa: BLE001 - raised again in the main thread
        failed.append(e)


def main(argv: list[str] | None = None) -> int:
    drop_cwd_from_path()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.socket is None and args.port is None:
        parser.error("give --socket PATH or --port N")
    if args.socket and len(os.fsencode(args.socket)) >= 108:
        parser.error(f"--socket path is {len(os.fsencode(args.socket))} bytes; unix sockets allow at most 107")
    if args.socket is None and not is_loopback_host(args.host) and not args.allow_non_loopback:
        parser.error(f"--host {args.host} is not a loopback address; the guest only binds loopback "
                     "or a unix socket (use --allow-non-loopback inside a VM)")
    log_to_stderr()
    try:
        token = read_token(args)
    except TokenError as e:
        log.error("%s", e)
        return 2

    keep_big_buffers_in_heap()
    config = SessionConfig(**{f.name: getattr(args, f.name) for f in fields(SessionConfig)})
    session = Session(config, token)

    def early_stop(sig: int, _frame: FrameType | None) -> None:
        session.on_signal(sig)
        raise _Stop()

    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    old = {s: signal.signal(s, early_stop) for s in stop_signals}
    if not set_child_subreaper():
        log.warning("could not become a child subreaper; double-forked apps may outlive the session")
    desktop: threading.Thread | None = None
    desktop_failed: list[BaseException] = []
    try:
        try:
            session.prepare_dirs()
            session.start_xvfb()
            t_imp = time.monotonic()  # import_ms: the server stack, numpy included
            import_numpy_single_threaded()  # while Xvfb starts (~0.1 s), before the desktop thread
            # The server stack takes far longer to import (~0.4 s) than Xvfb takes to start
            # (~0.1 s): import it now, while Xvfb starts and, once it is up, the desktop's
            # processes (WM, panel, buses) start in a thread, rather than one after the other.
            desktop = threading.Thread(target=start_desktop, args=(session, desktop_failed), daemon=True,
                                       name="desktop-start")
            desktop.start()
            from osfarm.desktop.guest import guest_server

            session.timings["import_ms"] = round((time.monotonic() - t_imp) * 1000, 1)
            desktop.join()
            if desktop_failed:
                raise desktop_failed[0]
            # guest_server.serve hands the stop signals to the asyncio loop once it runs; until
            # then early_stop stays in charge.
            guest_server.serve(session)
        except DisplayError as e:
            log.error("%s", e)
            session.exit_code = 1
        except (_Stop, KeyboardInterrupt):
            pass
        except SystemExit as e:  # uvicorn exits on bind failures
            log.error("guest server failed to start (exit %s)", e.code)
            session.exit_code = 1
        finally:
            # Signals during cleanup must not interrupt it.
            for s in old:
                signal.signal(s, signal.SIG_IGN)
            session.stopping = True  # the desktop thread starts nothing more
            if desktop is not None:
                desktop.join(10)
            session.stop()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if session.exit_reason:
        log.info("stopped: %s", session.exit_reason)
    return session.exit_code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Worker threads blocked in long waits (wait_for_window ...) must not keep a stopped
    # desktop's process alive.
    os._exit(code)
