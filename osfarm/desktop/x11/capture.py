"""Screen capture of an X display, with the mouse cursor composited in.

Frames come from ``mss`` (XShmGetImage through XCB, falling back to XGetImage), which copies a
1920x1080 frame in a few ms. X servers never include the pointer in GetImage results, so, like
OSWorld's screenshot route, we paste the cursor ourselves: its ARGB image and hotspot come from
XFixes ``GetCursorImage`` on a separate python-xlib connection.

The fast path keeps the frame in the server's own BGRX layout: the cursor is blended into it
with numpy and JPEG is encoded straight from it by libjpeg-turbo (``simplejpeg``), skipping the
RGB conversion (1920x1080 grab + JPEG: about 10 ms instead of 20 ms here).

Thread-safety: a :class:`ScreenCapture` serialises all X traffic behind one internal lock, so one
instance can be shared by the server's worker threads. :func:`encode_image` and
:func:`encode_frame` are pure functions.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mss
import numpy as np
import simplejpeg
from PIL import Image
from Xlib import display as xdisplay
from Xlib.error import XError
from Xlib.ext import damage as xdamage
from Xlib.ext import xfixes  # noqa: F401  (registers the XFixes requests on Display)

if TYPE_CHECKING:
    from mss.base import MSS

_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}


@dataclass
class Frame:
    """One screenshot in the X server's layout: 4 bytes per pixel, B, G, R, unused."""

    width: int
    height: int
    bgrx: bytearray

    def pixels(self) -> np.ndarray:
        """A writable (height, width, 4) view of the frame (no copy)."""
        return np.frombuffer(self.bgrx, dtype=np.uint8).reshape(self.height, self.width, 4)

    def image(self) -> Image.Image:
        return Image.frombuffer("RGB", (self.width, self.height), bytes(self.bgrx), "raw", "BGRX", 0, 1)


class ScreenCapture:
    """Grabs RGB screenshots of ``display`` (default ``$DISPLAY``)."""

    def __init__(self, display: str | None = None):
        self.display_name = display or os.environ.get("DISPLAY") or ""
        if not self.display_name:
            raise RuntimeError("no X display: pass display= or set $DISPLAY")
        self._lock = threading.Lock()
        self._mss: MSS | None = None
        self._x: xdisplay.Display | None = None
        self._has_xfixes = False
        self._has_damage = False
        self._damage_hits: dict[int, bool] = {}  # per DAMAGE object: drawn on since last asked
        self._connect()

    def _connect(self) -> None:
        self._mss = mss.MSS(display=self.display_name, with_cursor=False)
        self._x = xdisplay.Display(self.display_name)
        if self._x.has_extension("XFIXES"):
            # XFixes answers BadRequest to requests newer than the version a client announced,
            # so the version handshake is mandatory before GetCursorImage.
            self._x.xfixes_query_version()
            self._has_xfixes = True
        if self._x.has_extension("DAMAGE"):
            self._x.damage_query_version()  # the same mandatory handshake
            self._has_damage = True

    def size(self) -> tuple[int, int]:
        with self._lock:
            return self._size()

    def _size(self) -> tuple[int, int]:
        # Ask the server (one round trip) rather than trusting the connection-setup screen
        # info, which goes stale if the screen is resized with RandR.
        assert self._x is not None
        g = self._x.screen().root.get_geometry()
        return g.width, g.height

    def grab(self, cursor: bool = True) -> Image.Image:
        """The whole screen as an RGB image; ``cursor`` draws the pointer in."""
        return self.grab_frame(cursor).image()

    def grab_frame(self, cursor: bool = True) -> Frame:
        """The whole screen as a BGRX :class:`Frame`; ``cursor`` blends the pointer in."""
        with self._lock:
            assert self._mss is not None and self._x is not None
            w, h = self._size()
            shot = self._mss.grab({"left": 0, "top": 0, "width": w, "height": h})
            raw = shot.raw if isinstance(shot.raw, bytearray) else bytearray(shot.raw)
            frame = Frame(w, h, raw)
            if cursor and self._has_xfixes:
                self._blend_cursor(frame)
            return frame

    def grab_region(self, x: int, y: int, width: int, height: int) -> Frame | None:
        """The screen's pixels in a rectangle, clipped to the screen, without the cursor; None
        when none of it is on screen. XShmGetImage of a window costs a fraction of a full frame."""
        with self._lock:
            assert self._mss is not None
            sw, sh = self._size()
            x0, y0, x1, y1 = max(0, x), max(0, y), min(sw, x + width), min(sh, y + height)
            if x1 <= x0 or y1 <= y0:
                return None
            shot = self._mss.grab({"left": x0, "top": y0, "width": x1 - x0, "height": y1 - y0})
            raw = shot.raw if isinstance(shot.raw, bytearray) else bytearray(shot.raw)
            return Frame(x1 - x0, y1 - y0, raw)

    def wait_still(self, timeout: float, quiet: float = 0.1, interval: float = 0.03,
                   cpu: Callable[[], float] | None = None, idle_share: float = 0.15,
                   cpu_window: float = 0.25) -> bool:
        """Block until two grabs ``quiet`` seconds apart are identical, or ``timeout`` passes.
        Returns whether the screen settled. The cursor is left out: a blinking caret is not.

        With ``cpu`` (cumulative CPU seconds of the desktop's apps) the screen must also stay
        unchanged while the apps use under ``idle_share`` of a core for ``cpu_window`` seconds:
        a CPU-starved app can show a still screen while it has not yet handled the input (and
        LibreOffice then even applies queued shortcuts after text typed later).

        Where the server has DAMAGE, a poll grabs a frame only when something was drawn since
        the last one: the server reports any drawing, so a frame nothing drew on is the same as
        the last one, and a still screen costs no grabs (the cursor's sprite is not drawing)."""
        deadline = time.monotonic() + timeout
        damage = self._damage_start()
        try:
            last = self.grab_frame(cursor=False).bgrx
            still_since = time.monotonic()
            mark: tuple[float, float] | None = None  # (time, cpu seconds) when the idle check began
            while time.monotonic() < deadline:
                time.sleep(interval)
                changed = False
                if damage is None or self._damaged(damage):
                    frame = self.grab_frame(cursor=False).bgrx
                    changed = frame != last  # memcmp of two frames: a few ms at 1920x1080
                    last = frame
                now = time.monotonic()
                if changed:
                    still_since, mark = now, None
                elif now - still_since >= quiet:
                    if cpu is None:
                        return True
                    if mark is None:
                        mark = (now, cpu())
                    elif now - mark[0] >= cpu_window:
                        used = cpu()
                        if (used - mark[1]) / (now - mark[0]) < idle_share:
                            return True
                        mark = (now, used)
            return False
        finally:
            if damage is not None:
                self._damage_stop(damage)

    def _damage_start(self) -> int | None:
        """A DAMAGE object on the root window that reports once until subtracted (None: none)."""
        if not self._has_damage:
            return None
        with self._lock:
            assert self._x is not None
            try:
                d = self._x.screen().root.damage_create(xdamage.DamageReportNonEmpty)
                self._x.sync()  # created before the first grab: what is drawn after it is reported
                self._damage_hits[d] = False
                return d
            except XError:
                return None

    def _damaged(self, damage: int) -> bool:
        """Whether anything was drawn since the last call (or since ``damage`` was made); a
        True clears the report before the caller grabs, so drawing after it is seen next time."""
        with self._lock:
            assert self._x is not None
            # Reports for every waiter's object arrive on this one connection: note them all.
            while self._x.pending_events():
                ev = self._x.next_event()
                d = getattr(ev, "damage", None)
                if d in self._damage_hits:
                    self._damage_hits[d] = True
            hit = self._damage_hits.get(damage, True)
            if hit:
                self._damage_hits[damage] = False
                self._x.damage_subtract(damage)
                self._x.sync()
            return hit

    def _damage_stop(self, damage: int) -> None:
        with self._lock:
            if self._x is None:
                return
            self._damage_hits.pop(damage, None)
            try:
                self._x.damage_destroy(damage)
                self._x.sync()
                while self._x.pending_events():  # note other waiters' reports, drop this one's
                    d = getattr(self._x.next_event(), "damage", None)
                    if d in self._damage_hits:
                        self._damage_hits[d] = True
            except XError:
                pass

    def _blend_cursor(self, frame: Frame) -> None:
        assert self._x is not None
        try:
            cur = self._x.xfixes_get_cursor_image(self._x.screen().root)
        except XError:
            # The server may refuse the pointer's image (BadAccess seen once in a GNOME VM while
            # the shell owned the cursor): the frame without it beats a failed observation.
            return
        cw, ch = cur.width, cur.height
        if not cw or not ch or len(cur.cursor_image) < cw * ch:
            return
        # XFixes gives premultiplied ARGB as native 32-bit ints: on little-endian hosts the bytes
        # are B, G, R, A, the frame's own order, so "over" is src + dst * (1 - alpha).
        argb = np.array(cur.cursor_image[: cw * ch], dtype="<u4")
        sprite = argb.view(np.uint8).reshape(ch, cw, 4).astype(np.uint16)
        x0, y0 = cur.x - cur.xhot, cur.y - cur.yhot
        # Clip the sprite to the screen.
        sx0, sy0 = max(0, -x0), max(0, -y0)
        dx0, dy0 = max(0, x0), max(0, y0)
        wdt = min(cw - sx0, frame.width - dx0)
        hgt = min(ch - sy0, frame.height - dy0)
        if wdt <= 0 or hgt <= 0:
            return
        src = sprite[sy0 : sy0 + hgt, sx0 : sx0 + wdt]
        dst = frame.pixels()[dy0 : dy0 + hgt, dx0 : dx0 + wdt, :3]
        alpha = src[..., 3:4]
        blended = src[..., :3] + (dst.astype(np.uint16) * (255 - alpha) + 127) // 255
        dst[...] = np.minimum(blended, 255).astype(np.uint8)

    def close(self) -> None:
        with self._lock:
            if self._mss is not None:
                self._mss.close()
                self._mss = None
            if self._x is not None:
                self._x.close()
                self._x = None

    def __enter__(self) -> ScreenCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def encode_image(
    img: Image.Image, fmt: str = "png", scale: float = 1.0, quality: int = 80, png_level: int = 1
) -> bytes:
    """Encode ``img`` as png, jpeg or webp, optionally downscaled by ``scale`` (0 < scale <= 1).

    Defaults favour speed: zlib level 1 for PNG (about 3x faster than Pillow's default 6 for
    screenshots, ~20% larger), WebP ``method=0``, no JPEG optimisation pass.
    """
    pil_fmt = _FORMATS.get(fmt.lower())
    if pil_fmt is None:
        raise ValueError(f"unsupported image format {fmt!r}; use png, jpeg or webp")
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    if scale < 1:
        size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
        # reducing_gap lets Pillow box-reduce first, then filter a small image: fast and
        # still antialiased (text stays legible, unlike NEAREST).
        img = img.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0)
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    buf = io.BytesIO()
    if pil_fmt == "PNG":
        img.save(buf, "PNG", compress_level=max(0, min(9, png_level)))
    elif pil_fmt == "JPEG":
        img.save(buf, "JPEG", quality=quality)
    else:
        img.save(buf, "WEBP", quality=quality, method=0)
    return buf.getvalue()


def encode_frame(frame: Frame, fmt: str = "png", scale: float = 1.0, quality: int = 80, png_level: int = 1) -> bytes:
    """Like :func:`encode_image` for a :class:`Frame`; full-size JPEG skips the RGB conversion."""
    if fmt.lower() in ("jpeg", "jpg") and scale == 1:
        if not 1 <= quality <= 100:
            raise ValueError(f"quality must be in [1, 100], got {quality}")
        return simplejpeg.encode_jpeg(frame.pixels(), quality, colorspace="BGRX", colorsubsampling="420", fastdct=True)
    return encode_image(frame.image(), fmt, scale, quality, png_level)
