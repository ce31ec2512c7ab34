"""Frames of the desktops someone is watching, and nothing else.

A :class:`LiveHub` runs one capture loop per watched (desktop, kind): ``live`` (the desktop page,
10+ fps, full size: the browser scales) or ``thumb`` (the pool page, a small picture
every few seconds). A loop starts with its first watcher and stops with its last, so a desktop
nobody watches is never captured. Frames come from the guest's own screenshot route (the
capture path agents' observations use: X shared-memory grab + libjpeg-turbo), over the farm's
unix-socket link to that guest. A slow browser never queues frames: each watcher holds only the
newest one, and an unchanged screen is not sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from osfarm.errors import OsfarmError
from osfarm.farm.guest_link import GuestLink, GuestTimeout, GuestUnreachable
from osfarm.providers.base import GuestEndpoint

log = logging.getLogger("osfarm.dashboard.live")

Kind = Literal["live", "thumb"]
LIVE_FPS_MAX = 30.0
THUMB_WIDTH = 360
THUMB_INTERVAL_S = 3.0
LIVE_QUALITY = 70
THUMB_QUALITY = 55
FRAME_TIMEOUT_S = 5.0
# After this many identical frames in a row the screen counts as still and is polled at
# STILL_FPS until it changes: an agent thinking for seconds costs its desktop less.
STILL_AFTER = 10
STILL_FPS = 4.0


class DesktopGone(OsfarmError, LookupError):
    """The desktop is not in the pool (any more), or has no guest to capture."""


@dataclass(frozen=True)
class Target:
    """Where a desktop's frames come from right now (a reset may change the endpoint)."""

    endpoint: GuestEndpoint
    screen: tuple[int, int]


# desktop id -> its current target, or None when it is gone / not capturable
Locate = Callable[[str], Target | None]


@dataclass(eq=False)
class Watcher:
    """One viewer: the size it draws at and the newest frame it has not taken yet."""

    width: int
    height: int
    fps: float
    frame: bytes | None = None
    gone: str | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def offer(self, frame: bytes) -> None:
        self.frame = frame
        self._ready.set()

    def end(self, why: str) -> None:
        self.gone = why
        self._ready.set()

    async def next_frame(self) -> bytes:
        """The newest frame not yet taken; DesktopGone when the desktop went away."""
        await self._ready.wait()
        self._ready.clear()
        if self.gone is not None:
            raise DesktopGone(self.gone)
        assert self.frame is not None
        return self.frame


@dataclass(eq=False)
class _Stream:
    desktop_id: str
    kind: Kind
    watchers: set[Watcher] = field(default_factory=set)
    task: asyncio.Task[None] | None = None
    last: bytes | None = None
    frames: int = 0
    unchanged: int = 0  # frames in a row equal to the last one sent


class LiveHub:
    """Capture loops of watched desktops (use on the farm's event loop only)."""

    def __init__(self, locate: Locate):
        self.locate = locate
        self._streams: dict[tuple[str, Kind], _Stream] = {}
        self.captured = 0  # frames grabbed since start (the bench and the tests read it)

    def capturing(self) -> list[tuple[str, Kind]]:
        """The (desktop, kind) pairs being captured now."""
        return [k for k, s in self._streams.items() if s.task is not None and not s.task.done()]

    @contextlib.asynccontextmanager
    async def watch(self, desktop_id: str, kind: Kind, width: int = THUMB_WIDTH, height: int = THUMB_WIDTH,
                    fps: float = 1 / THUMB_INTERVAL_S) -> AsyncIterator[Watcher]:
        if self.locate(desktop_id) is None:
            raise DesktopGone(f"desktop {desktop_id!r} is not in the pool or has no screen yet")
        w = Watcher(max(16, width), max(16, height), min(LIVE_FPS_MAX, max(0.05, fps)))
        key = (desktop_id, kind)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream(desktop_id, kind)
        stream.watchers.add(w)
        if stream.last is not None:
            w.offer(stream.last)  # a new viewer sees the screen at once
        if stream.task is None or stream.task.done():
            stream.task = asyncio.create_task(self._run(stream), name=f"osfarm-live-{kind}-{desktop_id}")
        try:
            yield w
        finally:
            stream.watchers.discard(w)
            if not stream.watchers:
                self._streams.pop(key, None)
                if stream.task is not None:
                    stream.task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await stream.task

    async def close(self) -> None:
        for s in list(self._streams.values()):
            for w in s.watchers:
                w.end("the farm is stopping")
            if s.task is not None:
                s.task.cancel()
        self._streams.clear()

    async def _run(self, s: _Stream) -> None:
        loop = asyncio.get_running_loop()
        link: GuestLink | None = None
        endpoint: GuestEndpoint | None = None
        failures = 0
        due = 0.0  # when the next frame is due (loop time)
        try:
            while s.watchers:
                t0 = loop.time()
                target = self.locate(s.desktop_id)
                if target is None:
                    for w in list(s.watchers):
                        w.end(f"desktop {s.desktop_id} left the pool")
                    return
                if link is None or target.endpoint != endpoint:  # new box after a reset
                    if link is not None:
                        await link.aclose()
                    endpoint, link = target.endpoint, GuestLink(target.endpoint)
                scale, quality = self._scale(s, target.screen)
                try:
                    r = await link.request("GET", "/v1/screenshot", timeout_s=FRAME_TIMEOUT_S,
                                           params={"format": "jpeg", "scale": f"{scale:.4f}", "quality": str(quality)})
                    ok = r.status_code == 200
                except (GuestUnreachable, GuestTimeout) as e:
                    ok, r = False, None
                    log.debug("live capture of %s failed: %s", s.desktop_id, e)
                if ok and r is not None:
                    failures = 0
                    self.captured += 1
                    s.frames += 1
                    if r.content != s.last:  # an unchanged screen is not sent again
                        s.last = r.content
                        s.unchanged = 0
                        for w in list(s.watchers):
                            w.offer(r.content)
                    else:
                        s.unchanged += 1
                else:
                    failures += 1  # a desktop being reset does not answer for a moment
                    await asyncio.sleep(min(2.0, 0.2 * failures))
                    continue
                fps = max((w.fps for w in s.watchers), default=1.0)
                if s.kind == "live" and s.unchanged >= STILL_AFTER:
                    fps = min(fps, STILL_FPS)  # a still screen is polled slower until it changes
                # A fixed schedule (not "sleep what is left"): the rate holds on average even when
                # a busy machine delays single frames; a frame later than a whole interval does
                # not cause a burst of catch-up frames.
                due = max(due + 1.0 / fps, loop.time()) if due else t0 + 1.0 / fps
                await asyncio.sleep(max(0.0, due - loop.time()))
        finally:
            if link is not None:
                await link.aclose()

    @staticmethod
    def _scale(s: _Stream, screen: tuple[int, int]) -> tuple[float, int]:
        if s.kind == "thumb":
            return min(1.0, THUMB_WIDTH / max(1, screen[0])), THUMB_QUALITY
        # Live frames are always full size, whatever the window: the guest encodes a full-size
        # JPEG straight from the X frame (1920x1080: ~4 ms of CPU), while a scaled one costs an
        # RGB conversion and a resize first (~28 ms); the browser scales for free.
        return 1.0, LIVE_QUALITY
