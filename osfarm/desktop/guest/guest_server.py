"""Serving a session's guest app (:func:`osfarm.desktop.guest.guest.create_app`) with uvicorn, in the
launcher's process, until a stop signal or the X server's death.

While it serves it writes the state file once the server listens, watches Xvfb, and reaps the
orphans the session adopts as a child subreaper. Signals are handled here (not by uvicorn, which
would re-raise them after serving, before the session could clean up).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from Xlib import X
from Xlib import display as xdisplay

from osfarm.desktop.box.process_tree import ZombieReaper
from osfarm.desktop.guest.guest import create_app
from osfarm.desktop.session.session import Session

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Keep idle connections longer than any client does (the farm's 30 s, httpx's 5 s): with
# uvicorn's 5 s default, a farm connection idle 5-15 s (an agent thinking) was reused just after
# the guest closed it, and the step failed with a broken pipe.
KEEP_ALIVE_S = 75


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises captured signals after serving; the session must clean up first,
        # so serve() handles signals itself.
        yield


def _bound_port(server: uvicorn.Server) -> int | None:
    try:
        return int(server.servers[0].sockets[0].getsockname()[1])
    except (AttributeError, IndexError):
        return None


def watch_desktop_start(session: Session, timeout: float = 15.0) -> None:
    """Mark when the window manager runs (``wm_ready_ms``: it has set _NET_SUPPORTING_WM_CHECK)
    and the panel is up (``panel_ready_ms``: a mapped top-level window as wide as the screen),
    from the X server's events (no polling); for the cold start's breakdown. Gives up quietly."""
    want_wm, want_panel = not session.config.no_wm, not session.config.no_panel
    if not (want_wm or want_panel):
        return
    try:
        d = xdisplay.Display(session.display)
    except Exception as e:  # noqa: BLE001 - only timings are lost
        log.debug("start watcher: %s", e)
        return
    try:
        root = d.screen().root
        width = d.screen().width_in_pixels
        root.change_attributes(event_mask=X.PropertyChangeMask | X.SubstructureNotifyMask)
        wm_check = d.intern_atom("_NET_SUPPORTING_WM_CHECK")
        deadline = time.monotonic() + timeout

        def look() -> None:
            nonlocal want_wm, want_panel
            if want_wm and root.get_full_property(wm_check, X.AnyPropertyType) is not None:
                want_wm = False
                session.mark("wm_ready_ms")
            if want_panel:
                for w in root.query_tree().children:
                    with contextlib.suppress(Exception):
                        if w.get_attributes().map_state == X.IsViewable and w.get_geometry().width == width:
                            want_panel = False
                            session.mark("panel_ready_ms")
                            break

        look()  # what happened before the events were selected
        while (want_wm or want_panel) and not session.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not d.pending_events():
                select.select([d.fileno()], [], [], min(left, 0.5))
            changed = False
            while d.pending_events():
                ev = d.next_event()
                changed = changed or ev.type in (X.PropertyNotify, X.MapNotify, X.ConfigureNotify)
            if changed:
                look()
    except Exception as e:  # noqa: BLE001 - only timings are lost
        log.debug("start watcher: %s", e)
    finally:
        d.close()


def serve(session: Session) -> None:
    """Serve until stopped; uvicorn's own exit on a bind failure raises SystemExit."""
    cfg = session.config
    threading.Thread(target=watch_desktop_start, args=(session,), daemon=True, name="start-watcher").start()
    app = create_app(session.token, session.display, home=cfg.home, alive=session.xvfb_alive,
                     work_dir=str(session.run_dir), agent=session.agent, restart_buses=session.restart_agent_buses,
                     session=cfg.desktop)
    if cfg.socket:
        sock = Path(cfg.socket)
        if sock.exists() or sock.is_symlink():
            sock.unlink()
    # With uds set, uvicorn ignores host and port.
    server = _Server(uvicorn.Config(
        app, uds=cfg.socket, host=cfg.host, port=cfg.port or 0, log_level=cfg.log_level, lifespan="on",
        access_log=False, timeout_graceful_shutdown=1, ws="none", timeout_keep_alive=KEEP_ALIVE_S,
    ))

    def on_signal(sig: int) -> None:
        session.on_signal(sig)
        if server.should_exit:  # a second signal: do not wait for open connections
            server.force_exit = True
        server.should_exit = True

    async def watch() -> None:
        reaper = ZombieReaper(keep={p.pid for p in session.procs.values()})
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.005)
        if server.started:
            session.mark("ready_ms")
            if not cfg.socket:
                session.port = _bound_port(server) or cfg.port
            session.write_state()
            log.info("ready on %s at %s in %.0f ms", session.display, session.where(), session.timings["ready_ms"])
        n = 0
        while not server.should_exit:
            if not session.xvfb_alive():
                session.exit_reason = f"Xvfb exited (code {session.procs['xvfb'].returncode})"
                session.exit_code = 1
                log.warning("%s; stopping", session.exit_reason)
                server.should_exit = True
                break
            n += 1
            if n % 5 == 0:
                reaper.keep = {p.pid for p in session.procs.values()}
                await asyncio.to_thread(reaper.tick)
            await asyncio.sleep(0.2)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        watcher = asyncio.create_task(watch())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    asyncio.run(main())
