"""``/ui`` pages of a live farm: the pool (every desktop with a live thumbnail, over server-sent
events) and one desktop's live view and take-over (a WebSocket).

The WebSocket speaks JSON text one way and JPEG frames the other:

* browser -> farm: ``{"type": "view", "width", "height"}`` (the canvas size: frames are scaled to
  it), ``{"type": "control", "on": bool, "csrf"}``, ``{"type": "input", "actions": [...]}``
  (computer_13 mouse/keyboard actions, while in control);
* farm -> browser: binary JPEG frames; ``{"type": "hello", "screen", "can_control", "why"}``,
  ``{"type": "control", "on", "by", "mine"}``, ``{"type": "error", "detail"}``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response, WebSocket, WebSocketDisconnect
from fastapi.responses import StreamingResponse

from osfarm.dashboard import pages
from osfarm.dashboard.access import csrf_ok, may_watch, same_origin, uses_cookie
from osfarm.dashboard.control import ControlRefused, control_actions
from osfarm.dashboard.live import DesktopGone, LiveHub, Watcher
from osfarm.dashboard.responses import PageRoute, error_page, page
from osfarm.dashboard.state import Caller, Dashboard, DashboardOf, Hub, PageFrame
from osfarm.farm.errors import ApiError
from osfarm.farm.pool import DesktopView, LeasePool
from osfarm.farm.state import FarmState, State
from osfarm.http.principals import Principal
from osfarm.schema.actions import ActionError

log = logging.getLogger("osfarm.dashboard.farm_routes")

POOL_EVENT_INTERVAL_S = 1.0
STEP_TIMEOUT_S = 30.0


def _visible(p: Principal, v: DesktopView) -> bool:
    lease = v.lease
    return may_watch(p, lease.principal if lease else None, lease.owner if lease else None)


def _desktop_json(dash: Dashboard, v: DesktopView, now: float) -> dict[str, Any]:
    lease = v.lease
    return {
        "id": v.id, "state": v.state, "provider": v.provider, "lease": lease is not None,
        "owner": (lease.principal or lease.owner) if lease else None, "task_id": lease.task_id if lease else None,
        "age_s": round(now - v.created_at, 1), "resets": v.resets,
        "controlled_by": dash.control.holder(v.id) if lease and dash.control.lease_of(v.id) == lease.id else None,
    }  # fmt: skip


router = APIRouter(tags=["dashboard"], include_in_schema=False, route_class=PageRoute)


@router.get("/ui/pool")
async def pool_page(frame: PageFrame) -> Response:
    return page(pages.render("pool.html", frame))


@router.get("/ui/pool/events")
async def pool_events(who: Caller, dash: DashboardOf, farm: State, hub: Hub) -> Response:
    if who is None:
        return Response(status_code=401)
    return StreamingResponse(_pool_stream(dash, farm, hub, who), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


@router.get("/ui/desktops/{desktop_id}")
async def desktop_page(request: Request, desktop_id: str, who: Caller, dash: DashboardOf, farm: State,
                       frame: PageFrame) -> Response:
    view = farm.pool.desktop(desktop_id) if farm.pool is not None else None
    if who is None or view is None or not _visible(who, view):
        return error_page(request, 404, f"no desktop {desktop_id!r} you may watch")
    return page(pages.render("desktop.html", frame, desktop_id=desktop_id, can_control=who.is_admin,
                             fps=dash.live_fps))


async def _pool_stream(dash: Dashboard, state: FarmState, hub: LiveHub, who: Principal) -> AsyncIterator[str]:
    """Pool snapshots every second and thumbnails as they come, while the page is open."""
    thumbs: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(maxsize=64)
    watching: dict[str, asyncio.Task[None]] = {}

    async def watch(desktop_id: str) -> None:
        with contextlib.suppress(DesktopGone):
            async with hub.watch(desktop_id, "thumb") as w:
                while True:
                    frame = await w.next_frame()
                    with contextlib.suppress(asyncio.QueueFull):
                        thumbs.put_nowait((desktop_id, frame))

    try:
        while True:
            pool: LeasePool = state.require_pool()
            now = time.time()
            views = [v for v in pool.desktops() if _visible(who, v)]
            status = pool.status()
            snap = {"desktops": [_desktop_json(dash, v, now) for v in views], "counts": status["counts"],
                    "waiting": status.get("waiting", 0)}
            yield f"event: pool\ndata: {json.dumps(snap)}\n\n"
            live_ids = {v.id for v in views if v.endpoint is not None and v.state not in ("failed", "stopping")}
            for gone in set(watching) - live_ids:
                watching.pop(gone).cancel()
            for new in live_ids - set(watching):
                watching[new] = asyncio.create_task(watch(new))
            deadline = asyncio.get_running_loop().time() + POOL_EVENT_INTERVAL_S
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                try:
                    desktop_id, frame = await asyncio.wait_for(thumbs.get(), left)
                except TimeoutError:
                    break
                data = json.dumps({"id": desktop_id, "jpeg": base64.b64encode(frame).decode("ascii")})
                yield f"event: thumb\ndata: {data}\n\n"
    except ApiError:
        yield "event: error\ndata: {\"detail\": \"the farm is stopping\"}\n\n"
    finally:
        for t in watching.values():
            t.cancel()
        for t in watching.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


@router.websocket("/ui/desktops/{desktop_id}/live")
async def live(ws: WebSocket, desktop_id: str, who: Caller, dash: DashboardOf, state: State, hub: Hub) -> None:
    """A desktop's live view and take-over (the protocol is in the module's docstring)."""
    if who is None:
        await ws.close(code=4401, reason="log in first")
        return
    if uses_cookie(ws) and not same_origin(ws):
        await ws.close(code=4403, reason="cross-site WebSocket refused")
        return
    view = state.pool.desktop(desktop_id) if state.pool is not None else None
    if view is None or not _visible(who, view) or view.screen is None:
        await ws.close(code=4404, reason=f"no desktop {desktop_id!r} you may watch")
        return
    await ws.accept()
    me = object()  # this connection's identity as a controller
    send_lock = asyncio.Lock()

    async def send_json(msg: dict[str, Any]) -> None:
        async with send_lock:
            await ws.send_text(json.dumps(msg))

    async def on_control(msg: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            await send_json({**msg, "mine": dash.control.held_by(desktop_id, me)})

    why = None if who.is_admin else "only an admin can take control"
    screen = view.screen
    await send_json({"type": "hello", "screen": {"width": screen[0], "height": screen[1]},
                     "can_control": who.is_admin, "why": why})
    dash.control.listen(desktop_id, on_control)
    if dash.control.holder(desktop_id):
        await on_control({"type": "control", "on": True, "by": dash.control.holder(desktop_id)})
    try:
        async with hub.watch(desktop_id, "live", screen[0], screen[1], dash.live_fps) as watcher:

            async def pump() -> None:
                while True:
                    frame = await watcher.next_frame()
                    async with send_lock:
                        await ws.send_bytes(frame)

            sender = asyncio.create_task(pump())
            try:
                while True:
                    receive = asyncio.create_task(ws.receive_text())
                    done, _ = await asyncio.wait({receive, sender}, return_when=asyncio.FIRST_COMPLETED)
                    if sender in done:
                        receive.cancel()
                        sender.result()  # raises DesktopGone or a send error
                        return
                    try:
                        msg = json.loads(receive.result())
                    except ValueError:
                        await send_json({"type": "error", "detail": "messages are JSON objects"})
                        continue
                    if isinstance(msg, dict):
                        await _on_message(dash, ws, state, desktop_id, who, me, watcher, msg, send_json)
            finally:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sender
    except DesktopGone as e:
        with contextlib.suppress(Exception):
            await ws.close(code=4410, reason=str(e)[:120])
    except WebSocketDisconnect:
        pass
    finally:
        dash.control.unlisten(desktop_id, on_control)
        if dash.control.release(desktop_id, me):
            await dash.control.announce(desktop_id)


async def _on_message(dash: Dashboard, ws: WebSocket, state: FarmState, desktop_id: str, who: Principal,
                      me: object, watcher: Watcher, msg: dict[str, Any],
                      send_json: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    kind = msg.get("type")
    if kind == "view":
        w, h = msg.get("width"), msg.get("height")
        if isinstance(w, int) and isinstance(h, int) and 16 <= w <= 16384 and 16 <= h <= 16384:
            watcher.width, watcher.height = w, h
        return
    if kind == "control":
        if not msg.get("on"):
            if dash.control.release(desktop_id, me):
                await dash.control.announce(desktop_id)
            return
        if not who.is_admin:
            await send_json({"type": "error", "detail": "only an admin can take control"})
            return
        if not csrf_ok(ws, msg.get("csrf")):
            await send_json({"type": "error", "detail": "stale page: reload it to take control"})
            return
        view = state.pool.desktop(desktop_id) if state.pool is not None else None
        try:
            dash.control.take(desktop_id, view.lease if view else None, who.name, me)
        except ControlRefused as e:
            await send_json({"type": "error", "detail": str(e)})
            return
        log.warning("desktop %s taken over by %s (lease %s)", desktop_id, who.name,
                    view.lease.id[:8] if view and view.lease else "-")
        await dash.control.announce(desktop_id)
        return
    if kind == "input":
        if not dash.control.held_by(desktop_id, me):
            await send_json({"type": "error", "detail": "take control first"})
            return
        view = state.pool.desktop(desktop_id) if state.pool is not None else None
        lease = view.lease if view is not None else None
        if lease is None or view is None or view.screen is None or lease.id != dash.control.lease_of(desktop_id):
            # the lease taken over ended (the desktop may already serve another lease): control ends
            await send_json({"type": "error", "detail": "the lease you controlled ended; control is handed back"})
            dash.control.release(desktop_id, me)
            await dash.control.announce(desktop_id)
            return
        try:
            actions = control_actions(msg.get("actions"), view.screen)
        except ActionError as e:
            await send_json({"type": "error", "detail": str(e)})
            return
        try:
            await state.guest_call(lease, "POST", "/v1/step", timeout_s=STEP_TIMEOUT_S,
                                   json={"actions": actions, "timing": "fast", "code_timeout": 10})
        except ApiError as e:
            await send_json({"type": "error", "detail": e.message})
        return
    await send_json({"type": "error", "detail": f"unknown message type {kind!r}"})
