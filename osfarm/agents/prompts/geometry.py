"""Screen geometry the prompt formats need: a PNG's size and Qwen2-VL's smart resize.

Qwen2-VL / Qwen2.5-VL processors (and so vLLM serving UI-TARS) resize every image to a size whose
sides are multiples of ``factor`` (28 = patch 14 x merge 2) and whose area lies within
[min_pixels, max_pixels], keeping the aspect ratio as well as they can. UI-TARS answers with
absolute coordinates in that resized image, so the agent must know the resized size to map a
point back to the screen. Both functions are pure and unit-tested with numbers worked by hand.
"""

from __future__ import annotations

import math
import struct

from osfarm.errors import OsfarmError

FACTOR = 28
MIN_PIXELS = 100 * 28 * 28  # Qwen2.5-VL / UI-TARS defaults
MAX_PIXELS = 16384 * 28 * 28
MAX_ASPECT = 200


class GeometryError(OsfarmError, ValueError):
    pass


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, without decoding the image."""
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise GeometryError("the screenshot is not a PNG image")
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


def smart_resize(width: int, height: int, *, factor: int = FACTOR, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The (width, height) a Qwen2-VL processor resizes a width x height image to.

    Each side is rounded to the nearest multiple of ``factor``; if the area then exceeds
    ``max_pixels`` both sides shrink by sqrt(area / max_pixels) and round *down*; if it falls
    under ``min_pixels`` both grow by sqrt(min_pixels / area) and round *up*.
    """
    if width <= 0 or height <= 0:
        raise GeometryError(f"image size {width}x{height} must be positive")
    if max(width, height) / min(width, height) > MAX_ASPECT:
        raise GeometryError(f"image {width}x{height}: aspect ratio over {MAX_ASPECT}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return w, h


def to_screen(x: float, y: float, model_size: tuple[int, int], screen: tuple[int, int]) -> tuple[int, int]:
    """Map a point in the model's image space (``model_size``) to integer screen pixels."""
    mw, mh = model_size
    sw, sh = screen
    sx = min(sw - 1, max(0, round(x / mw * sw)))
    sy = min(sh - 1, max(0, round(y / mh * sh)))
    return int(sx), int(sy)
