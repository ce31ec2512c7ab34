"""Screen capture of an X display, with the mouse cursor composited in.

Frames come from ``mss`` (XShmGetImage through XCB, falling back to XGetImage), which copies a
1920x1080 frame in a few ms. X servers never include the pointer in GetImage results, so, like
OSWorld's screenshot route, we paste the cursor ourselves: its ARGB image and hotspot come from
XFixes ``GetCursorImage`` on a separate python-xlib connection.

Thread-safety: a :class:`ScreenCapture` serialises all X traffic behind one internal lock, so one
instance can be shared by the server's worker threads. :func:`encode_image` is a pure function.
"""

from __future__ import annotations

import array
import io
import os
import sys
import threading
from typing import TYPE_CHECKING

import mss
from PIL import Image
from Xlib import display as xdisplay
from Xlib.ext import xfixes  # noqa: F401  (registers the XFixes requests on Display)

if TYPE_CHECKING:
    from mss.base import MSS

_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}


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
        self._connect()

    def _connect(self) -> None:
        self._mss = mss.MSS(display=self.display_name, with_cursor=False)
        self._x = xdisplay.Display(self.display_name)
        if self._x.has_extension("XFIXES"):
            # XFixes answers BadRequest to requests newer than the version a client announced,
            # so the version handshake is mandatory before GetCursorImage.
            self._x.xfixes_query_version()
            self._has_xfixes = True

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
        with self._lock:
            assert self._mss is not None and self._x is not None
            w, h = self._size()
            shot = self._mss.grab({"left": 0, "top": 0, "width": w, "height": h})
            # BGRX -> RGB in C; no per-pixel Python work.
            img = Image.frombuffer("RGB", shot.size, shot.bgra, "raw", "BGRX", 0, 1)
            if img.readonly:
                img = img.copy()  # frombuffer may share mss's buffer; the paste below writes
            if cursor and self._has_xfixes:
                self._draw_cursor(img)
            return img

    def _draw_cursor(self, img: Image.Image) -> None:
        assert self._x is not None
        cur = self._x.xfixes_get_cursor_image(self._x.screen().root)
        cw, ch = cur.width, cur.height
        if not cw or not ch or len(cur.cursor_image) < cw * ch:
            return
        # XFixes gives premultiplied ARGB as native 32-bit ints; on little-endian hosts the
        # bytes are B,G,R,A, which PIL reads as premultiplied "RGBa" and un-premultiplies.
        pixels = array.array("I", cur.cursor_image[: cw * ch])
        if sys.byteorder != "little":
            pixels.byteswap()
        sprite = Image.frombuffer("RGBa", (cw, ch), pixels.tobytes(), "raw", "BGRa", 0, 1).convert("RGBA")
        img.paste(sprite, (cur.x - cur.xhot, cur.y - cur.yhot), sprite)

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
