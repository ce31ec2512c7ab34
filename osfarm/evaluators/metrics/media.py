"""OSWorld's image, audio/video and file-format metrics (``gimp.py``, ``vlc.py``, ``others.py``,
``pdf.py`` and the file comparisons of ``chrome.py`` / ``vscode.py``).

Names, signatures and scoring follow OSWorld so that task JSONs run unchanged. As in the other
metric modules, a ``None`` / missing / unreadable input scores 0.0 instead of raising, every
score is a float in [0, 1], and errors in the task's own configuration (an unknown rule type or
archive ``file_type``, a missing rule key) still raise.

OSWorld's heavy dependencies are replaced by small numpy equivalents:

* SSIM is scikit-image's default ``structural_similarity`` (7x7 uniform window, sample
  covariance, K1=0.01, K2=0.03, data range 255 for 8-bit images, channel mean for colour),
  computed here with box sums.
* ``compare_audios`` decodes with ffmpeg (mono, 22050 Hz, as ``librosa.load``), takes 20 MFCCs
  (2048-point FFT, hop 512, 128 mel bands, dB with an 80 dB floor), scales each coefficient row
  by its max-abs, aligns the frames with exact DTW on cosine distance (OSWorld uses fastdtw, an
  approximation of the same) and scores ``exp(-distance / path_length)``.
* ``compare_videos`` decodes with ffmpeg and compares 64-bit DCT perceptual hashes per frame
  (imagehash's ``phash``).
* ``compare_pdfs`` extracts text with pypdf instead of PyMuPDF; ``compare_pdf_images`` renders
  pages with poppler's ``pdftoppm`` instead of PyMuPDF.

Deliberate differences from OSWorld, all where OSWorld has a plain bug:

* ``check_triangle_position`` takes the triangle to be the *second most* common colour
  (OSWorld picks the second *least* common one, which for a two-colour image is the background).
* ``check_image_size`` crops to the opaque content only when ``ignore_transparent`` is set
  (OSWorld's operator precedence also crops any image carrying a ``transparency`` entry).
* ``check_green_background`` indexes pixels as (row, column) (OSWorld swaps them and so fails on
  any non-square image).
* ``compare_audios`` scores two undecodable files 0.0 (OSWorld: 1.0).
"""

from __future__ import annotations

import logging
import operator
import os
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from xml.etree import ElementTree

import lxml.html
import numpy as np
from PIL import Image, ImageChops, ImageStat, UnidentifiedImageError
from rapidfuzz import fuzz

from osfarm.evaluators.errors import UnsupportedOption
from osfarm.evaluators.metrics.general import _match_value_to_rule

logger = logging.getLogger(__name__)

__all__ = ["METRICS"]

FFMPEG = shutil.which("ffmpeg") or "/usr/bin/ffmpeg"

# Failures of the *inputs* (bad file, wrong format, size mismatch): scored 0.0.
_INPUT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    IndexError,
    ZeroDivisionError,
    zipfile.BadZipFile,
    ElementTree.ParseError,
    UnidentifiedImageError,
    subprocess.SubprocessError,
)
try:  # pypdf's own errors do not all derive from the above
    from pypdf.errors import PyPdfError

    _INPUT_ERRORS += (PyPdfError,)
except ImportError:  # pragma: no cover
    pass
try:
    from mutagen import MutagenError

    _INPUT_ERRORS += (MutagenError,)
except ImportError:  # pragma: no cover
    pass


def _is_file(path: Any) -> bool:
    return bool(path) and isinstance(path, (str, os.PathLike)) and os.path.isfile(path)


def _safe(func: Callable[..., Any]) -> Callable[..., float]:
    """Score input failures 0.0; clamp the result to a float in [0, 1]."""

    def wrapper(*args: Any, **kwargs: Any) -> float:
        try:
            value = func(*args, **kwargs)
        except _INPUT_ERRORS as e:
            logger.info("%s: unreadable input (%s: %s)", func.__name__, type(e).__name__, e)
            return 0.0
        value = float(value)
        if not np.isfinite(value):
            return 0.0
        return min(1.0, max(0.0, value))

    wrapper.__name__ = func.__name__
    wrapper.__qualname__ = func.__qualname__
    wrapper.__doc__ = func.__doc__
    wrapper.__wrapped__ = func  # type: ignore[attr-defined]
    return wrapper


def _open_image(path: Any) -> Image.Image:
    if not _is_file(path):
        raise FileNotFoundError(path)
    img = Image.open(path)
    img.load()
    return img


# --------------------------------------------------------------------------- SSIM


def _box_mean(x: np.ndarray, win: int) -> np.ndarray:
    """Means of every full ``win`` x ``win`` window (the 'valid' part of a uniform filter)."""
    c = np.zeros((x.shape[0] + 1, x.shape[1] + 1), dtype=np.float64)
    c[1:, 1:] = x.cumsum(0).cumsum(1)
    s = c[win:, win:] - c[:-win, win:] - c[win:, :-win] + c[:-win, :-win]
    return s / (win * win)


def _ssim_2d(a: np.ndarray, b: np.ndarray, win: int, data_range: float) -> float:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    ux, uy = _box_mean(a, win), _box_mean(b, win)
    # Variances on mean-shifted data: same values, less cancellation in the box sums.
    a0, b0 = a - a.mean(), b - b.mean()
    ux0, uy0 = _box_mean(a0, win), _box_mean(b0, win)
    cov_norm = win * win / (win * win - 1.0)
    vx = cov_norm * (_box_mean(a0 * a0, win) - ux0 * ux0)
    vy = cov_norm * (_box_mean(b0 * b0, win) - uy0 * uy0)
    vxy = cov_norm * (_box_mean(a0 * b0, win) - ux0 * uy0)
    c1 = (0.01 * data_range) ** 2
    c2 = (0.03 * data_range) ** 2
    s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux * ux + uy * uy + c1) * (vx + vy + c2))
    return float(s.mean())


def _ssim(a: np.ndarray, b: np.ndarray, win_size: int = 7, data_range: float = 255.0) -> float:
    """Mean SSIM of two same-shape 2-D (gray) or 3-D (H, W, C) arrays, as scikit-image computes it."""
    if a.shape != b.shape:
        raise ValueError(f"SSIM needs same-shape images: {a.shape} vs {b.shape}")
    if win_size < 1 or win_size % 2 == 0 or min(a.shape[0], a.shape[1]) < win_size:
        raise ValueError(f"SSIM window {win_size} does not fit image {a.shape}")
    if a.ndim == 2:
        return _ssim_2d(a, b, win_size, data_range)
    return float(np.mean([_ssim_2d(a[..., c], b[..., c], win_size, data_range) for c in range(a.shape[2])]))


def _structure_check_by_ssim(img1: Image.Image, img2: Image.Image, threshold: float = 0.9) -> bool:
    """OSWorld's ``structure_check_by_ssim``: RGB, same size, >= 7 px a side, SSIM >= threshold."""
    if min(img1.size + img2.size) < 7:
        return False
    img1 = img1.convert("RGB") if img1.mode != "RGB" else img1
    img2 = img2.convert("RGB") if img2.mode != "RGB" else img2
    if img1.size != img2.size:
        return False
    return _ssim(np.asarray(img1), np.asarray(img2), win_size=7) >= threshold


def _structure_check_by_mse(img1: Image.Image, img2: Image.Image, threshold: float = 0.03) -> bool:
    """OSWorld's ``structure_check_by_mse``: img1 resized to img2, RGB, MSE on [0, 1] values."""
    if img1.size != img2.size:
        img1 = img1.resize(img2.size, Image.Resampling.LANCZOS)
    a = np.asarray(img1.convert("RGB"), dtype=np.float32) / 255
    b = np.asarray(img2.convert("RGB"), dtype=np.float32) / 255
    return float(np.mean((a - b) ** 2)) < threshold


# --------------------------------------------------------------------------- images (gimp.py, vlc.py)


@_safe
def compare_images(image1_path: Any, image2_path: Any, **options: Any) -> float:
    """SSIM of the two images in grayscale, both resized to the smaller size (OSWorld's tuple
    ``min``). With ``reference_base_result`` b: ``(ssim - b) / (1 - b)`` if ssim >= b + 0.01, else 0."""
    if not _is_file(image1_path) or not _is_file(image2_path):
        return 0.0
    if os.path.getsize(image1_path) == 0 or os.path.getsize(image2_path) == 0:
        return 0.0
    image1 = _open_image(image1_path).convert("L")
    image2 = _open_image(image2_path).convert("L")
    new_size = min(image1.size, image2.size)
    image1 = image1.resize(new_size, Image.Resampling.LANCZOS)
    image2 = image2.resize(new_size, Image.Resampling.LANCZOS)
    similarity = _ssim(np.asarray(image1), np.asarray(image2))
    base = options.get("reference_base_result")
    if base is None:
        return similarity
    if similarity >= base + 0.01:
        return (similarity - base) / (1 - base)
    return 0.0


@_safe
def compare_image_list(pred_img_path_list: Any, gold_img_path_list: Any) -> float:
    """1 iff every predicted image equals its gold image pixel for pixel (pred resized to gold's
    size and converted to gold's mode first)."""
    if not isinstance(pred_img_path_list, list):
        pred_img_path_list, gold_img_path_list = [pred_img_path_list], [gold_img_path_list]
    if not isinstance(gold_img_path_list, list) or not pred_img_path_list:
        return 0.0
    for pred_path, gold_path in zip(pred_img_path_list, gold_img_path_list):
        if not _is_file(pred_path) or not _is_file(gold_path):
            return 0.0
        pred, gold = _open_image(pred_path), _open_image(gold_path)
        if pred.size != gold.size:
            pred = pred.resize(gold.size, Image.Resampling.LANCZOS)
        if pred.mode != gold.mode:
            pred = pred.convert(gold.mode)
        if ImageChops.difference(pred, gold).getbbox():
            return 0.0
    return 1.0


@_safe
def check_structure_sim(src_path: Any, tgt_path: Any) -> float:
    """1 iff the images have the same size and SSIM >= 0.9."""
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    if src.size != tgt.size:
        return 0.0
    return float(_structure_check_by_ssim(src, tgt))


@_safe
def check_structure_sim_with_threshold(src_path: Any, tgt_path: Any, **options: Any) -> float:
    """1 iff SSIM >= ``ssim_threshold`` (default 0.85), src resized (Lanczos) to tgt's size."""
    threshold = options.get("ssim_threshold", 0.85)
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    if src.size != tgt.size:
        src = src.resize(tgt.size, Image.Resampling.LANCZOS)
    a, b = np.asarray(src.convert("RGB")), np.asarray(tgt.convert("RGB"))
    min_dim = min(a.shape[0], a.shape[1])
    win = 7 if min_dim >= 7 else (min_dim if min_dim % 2 else min_dim - 1)
    if win < 1:
        return 0.0
    return float(_ssim(a, b, win_size=win) >= threshold)


@_safe
def check_structure_sim_resized(src_path: Any, tgt_path: Any) -> float:
    """1 iff src (cropped to its opaque content when it has transparency) resized to tgt's size
    has SSIM >= 0.9 with tgt."""
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    if src.mode in ("RGBA", "LA") or "transparency" in src.info:
        src = src.convert("RGBA")
        bbox = src.split()[-1].getbbox()
        if bbox is None:
            return 0.0
        src = src.crop(bbox).convert("RGB")
    src = src.resize(tgt.size)
    return float(_structure_check_by_ssim(src, tgt.convert("RGB")))


def _brightness(img: Image.Image) -> float:
    return float(ImageStat.Stat(img.convert("L")).mean[0])


def _normalize_brightness(img: Image.Image, target: float) -> Image.Image:
    current = _brightness(img)
    if current == 0:
        raise ValueError("black image: brightness cannot be normalised")
    factor = target / current
    return img.point(lambda x: min(255, max(0, int(x * factor))))


@_safe
def check_brightness_decrease_and_structure_sim(src_path: Any, tgt_path: Any, threshold: float = 0.03) -> float:
    """1 iff src is darker than tgt and, both normalised to mean brightness 128, their MSE is
    below ``threshold``."""
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    reduced = _brightness(tgt) > _brightness(src)
    same = _structure_check_by_mse(_normalize_brightness(src, 128), _normalize_brightness(tgt, 128), threshold)
    return float(reduced and same)


@_safe
def check_saturation_increase_and_structure_sim(src_path: Any, tgt_path: Any) -> float:
    """1 iff src's mean HSV saturation is higher than tgt's and both hue and value channels have
    SSIM >= 0.9."""
    src = _open_image(src_path).convert("RGB").convert("HSV")
    tgt = _open_image(tgt_path).convert("RGB").convert("HSV")
    h1, s1, v1 = src.split()
    h2, s2, v2 = tgt.split()
    increased = float(np.mean(np.asarray(s2))) < float(np.mean(np.asarray(s1)))
    same = _structure_check_by_ssim(h1, h2) and _structure_check_by_ssim(v1, v2)
    return float(increased and same)


@_safe
def check_contrast_increase_and_structure_sim(src_path: Any, tgt_path: Any) -> float:
    """1 iff src's contrast (std of all pixel values) is higher than tgt's and SSIM >= 0.65."""
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    higher = float(np.std(np.asarray(tgt, dtype=np.float32))) < float(np.std(np.asarray(src, dtype=np.float32)))
    return float(higher and _structure_check_by_ssim(src, tgt, threshold=0.65))


@_safe
def check_image_size(src_path: Any, rule: Mapping[str, Any]) -> float:
    """1 iff the image's width/height equal ``rule["width"]`` / ``rule["height"]`` (each optional);
    with ``ignore_transparent`` the size of the opaque content's bounding box is used."""
    img = _open_image(src_path)
    width, height = img.size
    if rule.get("ignore_transparent", False) and (img.mode in ("RGBA", "LA") or "transparency" in img.info):
        bbox = img.convert("RGBA").split()[-1].getbbox()
        width, height = (0, 0) if bbox is None else (bbox[2] - bbox[0], bbox[3] - bbox[1])
    ok_h = rule.get("height") is None or height == rule["height"]
    ok_w = rule.get("width") is None or width == rule["width"]
    return float(ok_h and ok_w)


@_safe
def check_image_file_size(src_path: Any, rule: Mapping[str, Any]) -> float:
    """1 iff the file is smaller than ``rule["max_size"]`` bytes."""
    if not _is_file(src_path):
        return 0.0
    return float(os.path.getsize(src_path) < rule["max_size"])


@_safe
def check_palette_and_structure_sim(src_path: Any, tgt_path: Any) -> float:
    """1 iff src is a palette ('P' mode) image and its RGB rendering has SSIM >= 0.9 with tgt."""
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    return float(src.mode == "P" and _structure_check_by_ssim(src.convert("RGB"), tgt))


@_safe
def check_image_mirror(src_path: Any, tgt_path: Any) -> float:
    """1 iff src flipped left-right has SSIM >= 0.99 with tgt."""
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    return float(_structure_check_by_ssim(src.transpose(Image.Transpose.FLIP_LEFT_RIGHT), tgt, 0.99))


@_safe
def check_green_background(src_path: Any, tgt_path: Any) -> float:
    """1 iff every src pixel where tgt is not black is green (G > R and G > B)."""
    src = np.asarray(_open_image(src_path).convert("RGB")).astype(np.int16)
    tgt = np.asarray(_open_image(tgt_path).convert("RGB"))
    if src.shape != tgt.shape:
        return 0.0
    background = np.any(tgt != 0, axis=2)
    r, g, b = src[..., 0], src[..., 1], src[..., 2]
    green = (g > r) & (g > b)
    return float(np.all(green[background]))


@_safe
def check_file_exists_and_structure_sim(src_path: Any, tgt_path: Any) -> float:
    """1 iff src exists and has SSIM >= 0.9 with tgt."""
    if not _is_file(src_path):
        return 0.0
    return float(_structure_check_by_ssim(_open_image(src_path), _open_image(tgt_path)))


@_safe
def check_triangle_position(tgt_path: Any) -> float:
    """1 iff the centroid of the second most common colour (the triangle; the most common is the
    background) lies within 5% of the image's centre on both axes."""
    arr = np.asarray(_open_image(tgt_path).convert("RGB"))
    colors, inverse, counts = np.unique(arr.reshape(-1, 3), axis=0, return_inverse=True, return_counts=True)
    if len(colors) < 2:
        return 0.0
    triangle = np.argsort(counts)[::-1][1]
    coords = np.argwhere(inverse.reshape(arr.shape[:2]) == triangle)
    centroid = coords.mean(axis=0)
    shape = np.array(arr.shape[:2], dtype=np.float64)
    return float(np.all(np.abs(centroid - shape / 2) < 0.05 * shape))


@_safe
def check_textbox_on_leftside(src_path: Any) -> float:
    """1 iff the leftmost dark pixel (grey < 128: the text) lies in the left 5% of the image."""
    gray = np.asarray(_open_image(src_path).convert("L"))
    dark_columns = np.flatnonzero(np.any(gray < 128, axis=0))
    if dark_columns.size == 0:
        return 0.0
    return float(dark_columns[0] < gray.shape[1] * 0.05)


# --------------------------------------------------------------------------- VLC (vlc.py)


@_safe
def is_vlc_playing(actual_status_path: Any, rule: Mapping[str, Any]) -> float:
    """1 iff VLC's HTTP status XML says ``playing`` and the played item matches the rule:
    ``{"type": "file_name", "file_name": ...}`` (basename or path suffix) or
    ``{"type": "url", "url": ...}`` (contained, or the same host and path)."""
    if not _is_file(actual_status_path):
        return 0.0
    with open(actual_status_path, "rb") as f:
        tree = ElementTree.fromstring(f.read().decode("utf-8"))
    state = tree.find("state")
    if state is None or state.text != "playing":
        return 0.0

    def first_info(names: Sequence[str]) -> str | None:
        for name in names:
            el = tree.find(f'information/category[@name="meta"]/info[@name="{name}"]')
            if el is not None and el.text:
                return el.text
        return None

    kind = rule["type"]
    if kind == "file_name":
        info = first_info(["filename", "title", "uri", "location", "name"])
        if not info:
            return 0.0
        want = rule["file_name"]
        return float(os.path.basename(info) == want or info.endswith(want))
    if kind == "url":
        from urllib.parse import urlparse

        info = first_info(["url", "URI", "location", "title", "filename"])
        if not info:
            return 0.0
        want = rule["url"]
        if want in info:
            return 1.0
        parsed = urlparse(want)
        if info == os.path.basename(parsed.path):
            return 1.0
        if "://" in info:
            got = urlparse(info)
            return float(parsed.netloc == got.netloc and parsed.path in got.path)
        return 0.0
    raise UnsupportedOption(f"is_vlc_playing: unknown rule type {kind!r}")


@_safe
def is_vlc_fullscreen(actual_window_size: Any, screen_size: Any) -> float:
    """1 iff the window's width and height equal the screen's."""
    if not isinstance(actual_window_size, Mapping) or not isinstance(screen_size, Mapping):
        return 0.0
    return float(
        actual_window_size.get("width") == screen_size.get("width")
        and actual_window_size.get("height") == screen_size.get("height")
        and screen_size.get("width") is not None
    )


def _vlcrc_value(path: Any, key: str) -> str | None:
    """The value of the last uncommented ``key=value`` line of a vlcrc, or None."""
    if not _is_file(path):
        raise FileNotFoundError(path)
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    value = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, rest = line.partition("=")
        if sep and name.strip() == key:
            value = rest.strip()
    return value


@_safe
def is_vlc_recordings_folder(actual_config_path: Any, rule: Mapping[str, Any]) -> float:
    """1 iff vlcrc's ``input-record-path`` equals ``rule["recording_file_path"]``."""
    return float(_vlcrc_value(actual_config_path, "input-record-path") == rule["recording_file_path"])


def _vlcrc_check(key: str, rule_key: str, default: str) -> Callable[..., float]:
    def check(actual_config_path: Any, rule: Mapping[str, Any]) -> float:
        value = _vlcrc_value(actual_config_path, key)
        return float((default if value is None else value) == str(rule[rule_key]))

    check.__name__ = check.__qualname__ = f"check_{key.replace('-', '_')}"
    check.__doc__ = f"1 iff vlcrc's ``{key}`` (default {default}) equals ``rule[{rule_key!r}]``."
    return _safe(check)


check_qt_bgcone = _vlcrc_check("qt-bgcone", "expected_qt_bgcone", "1")
check_qt_max_volume = _vlcrc_check("qt-max-volume", "expected_qt_max_volume", "125")
check_qt_minimal_view = _vlcrc_check("qt-minimal-view", "expected_qt_minimal_view", "0")
check_one_instance_when_started_from_file = _vlcrc_check(
    "one-instance-when-started-from-file", "expected_one_instance_when_started_from_file", "1"
)
check_play_and_exit = _vlcrc_check("play-and-exit", "expected_play_and_exit", "0")


@_safe
def check_global_key_play_pause(actual_config_path: Any, rule: Mapping[str, Any]) -> float:
    """1 iff "a global play/pause hotkey is set" ("1" when ``global-key-play-pause`` has a value,
    else "0") equals ``rule["expected_global_key_play_pause"]``."""
    value = _vlcrc_value(actual_config_path, "global-key-play-pause")
    state = "1" if value else "0"
    return float(state == str(rule["expected_global_key_play_pause"]))


_DEFAULT_SLIDER_COLOURS = "153;210;153;20;210;20;255;199;15;245;39;29"


@_safe
def check_qt_slider_colours(actual_config_path: Any, rule: Mapping[str, Any]) -> float:
    """``{"type": "match", "expected_qt_slider_colours": s}``: the vlcrc value equals s;
    ``{"type": "blackish"}``: every RGB triple of the value has all components < 100."""
    value = _vlcrc_value(actual_config_path, "qt-slider-colours") or _DEFAULT_SLIDER_COLOURS
    kind = rule["type"]
    if kind == "match":
        return float(value == rule["expected_qt_slider_colours"])
    if kind == "blackish":
        values = [int(x) for x in value.split(";")]
        triples = list(zip(values[0::3], values[1::3], values[2::3]))
        return float(all(all(v < 100 for v in rgb) for rgb in triples))
    raise UnsupportedOption(f"check_qt_slider_colours: unknown rule type {kind!r}")


# --------------------------------------------------------------------------- audio / video


def _ffmpeg_audio(path: str, sr: int = 22050) -> np.ndarray:
    proc = subprocess.run(
        [FFMPEG, "-nostdin", "-v", "error", "-i", path, "-f", "f32le", "-ac", "1", "-ar", str(sr), "-"],
        capture_output=True,
        timeout=120,
        check=True,
    )
    return np.frombuffer(proc.stdout, dtype="<f4").astype(np.float64)


def _mel_filterbank(sr: int, n_fft: int, n_mels: int) -> np.ndarray:
    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        return 700.0 * (10 ** (m / 2595.0) - 1.0)

    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mel_pts = mel_to_hz(np.linspace(hz_to_mel(np.array(0.0)), hz_to_mel(np.array(sr / 2)), n_mels + 2))
    fb = np.zeros((n_mels, len(fft_freqs)))
    for i in range(n_mels):
        lo, mid, hi = mel_pts[i], mel_pts[i + 1], mel_pts[i + 2]
        up = (fft_freqs - lo) / max(mid - lo, 1e-9)
        down = (hi - fft_freqs) / max(hi - mid, 1e-9)
        fb[i] = np.maximum(0, np.minimum(up, down)) * (2.0 / (hi - lo))
    return fb


def _mfcc(y: np.ndarray, sr: int = 22050, n_mfcc: int = 20, n_fft: int = 2048, hop: int = 512) -> np.ndarray:
    """(n_mfcc, frames) MFCCs, librosa's defaults."""
    y = np.pad(y, n_fft // 2)
    if len(y) < n_fft:
        y = np.pad(y, (0, n_fft - len(y)))
    n_frames = 1 + (len(y) - n_fft) // hop
    idx = np.arange(n_fft)[None, :] + hop * np.arange(n_frames)[:, None]
    window = np.hanning(n_fft + 1)[:-1]
    power = np.abs(np.fft.rfft(y[idx] * window, axis=1)) ** 2  # (frames, bins)
    mel = power @ _mel_filterbank(sr, n_fft, 128).T  # (frames, mels)
    db = 10.0 * np.log10(np.maximum(mel, 1e-10))
    db = np.maximum(db, db.max() - 80.0)
    n = db.shape[1]
    k = np.arange(n_mfcc)[:, None]
    dct = np.cos(np.pi * k * (2 * np.arange(n)[None, :] + 1) / (2 * n)) * np.sqrt(2.0 / n)
    dct[0] /= np.sqrt(2.0)
    return dct @ db.T


def _dtw(x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    """Exact DTW on cosine distance between rows; returns (total distance, path length)."""
    xn = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    yn = y / np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-12)
    cost = 1.0 - xn @ yn.T
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    steps = np.zeros((n + 1, m + 1), dtype=np.int64)
    acc[0, 0] = 0.0
    for k in range(2, n + m + 1):  # anti-diagonals i + j = k, 1-based
        i = np.arange(max(1, k - m), min(n, k - 1) + 1)
        j = k - i
        cands = np.stack([acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]])
        lens = np.stack([steps[i - 1, j - 1], steps[i - 1, j], steps[i, j - 1]])
        best = np.argmin(cands, axis=0)
        cols = np.arange(len(i))
        acc[i, j] = cost[i - 1, j - 1] + cands[best, cols]
        steps[i, j] = lens[best, cols] + 1
    return float(acc[n, m]), int(steps[n, m])


def _coarsen(frames: np.ndarray, limit: int) -> np.ndarray:
    """Average consecutive frames so that at most ``limit`` remain (keeps DTW's matrix bounded)."""
    factor = -(-len(frames) // limit)
    if factor <= 1:
        return frames
    pad = (-len(frames)) % factor
    if pad:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    return frames.reshape(-1, factor, frames.shape[1]).mean(axis=1)


@_safe
def compare_audios(audio_path_1: Any, audio_path_2: Any) -> float:
    """Similarity in [0, 1] of two audio files: ``exp(-DTW distance / path length)`` over
    max-abs-normalised MFCC frames (1.0 for identical audio)."""
    if not _is_file(audio_path_1) or not _is_file(audio_path_2):
        return 0.0
    y1, y2 = _ffmpeg_audio(str(audio_path_1)), _ffmpeg_audio(str(audio_path_2))
    if len(y1) == 0 or len(y2) == 0:
        return 0.0
    feats = []
    for y in (y1, y2):
        m = _mfcc(y)
        m = m / np.maximum(np.abs(m).max(axis=1, keepdims=True), 1e-12)  # librosa.util.normalize(axis=1)
        feats.append(_coarsen(m.T, 3000))
    distance, length = _dtw(feats[0], feats[1])
    return float(np.exp(-distance / length)) if length else 0.0


def _ffmpeg_frames(path: str, max_frames: int, size: int = 32) -> np.ndarray:
    proc = subprocess.run(
        [FFMPEG, "-nostdin", "-v", "error", "-i", path, "-frames:v", str(max_frames),
         "-vf", f"scale={size}:{size}:flags=area", "-pix_fmt", "gray", "-f", "rawvideo", "-"],
        capture_output=True,
        timeout=300,
        check=True,
    )
    data = np.frombuffer(proc.stdout, dtype=np.uint8)
    return data[: len(data) // (size * size) * size * size].reshape(-1, size, size)


def _phash(frame: np.ndarray) -> np.ndarray:
    n = frame.shape[0]
    k = np.arange(n)
    dct = np.cos(np.pi * k[:, None] * (2 * k[None, :] + 1) / (2 * n))
    low = (dct @ frame.astype(np.float64) @ dct.T)[:8, :8]
    return (low > np.median(low)).ravel()


@_safe
def compare_videos(video_path1: Any, video_path2: Any, max_frames_to_check: int = 100, threshold: int = 5) -> float:
    """1 iff the first ``max_frames_to_check`` frames match: at most ``threshold`` frames whose
    perceptual hashes differ by more than ``threshold`` bits, and, when a video ends within that
    window, both end at the same frame."""
    if not _is_file(video_path1) or not _is_file(video_path2):
        return 0.0
    f1 = _ffmpeg_frames(str(video_path1), max_frames_to_check)
    f2 = _ffmpeg_frames(str(video_path2), max_frames_to_check)
    if len(f1) == 0 and len(f2) == 0:
        return 0.0
    mismatches = 0
    for a, b in zip(f1, f2):
        if int(np.count_nonzero(_phash(a) != _phash(b))) > threshold:
            mismatches += 1
            if mismatches > threshold:
                return 0.0
    return float(len(f1) == len(f2))


@_safe
def check_mp3_meta(result: Any, meta: Mapping[str, Mapping[str, Any]]) -> float:
    """1 iff every ID3 tag named in ``meta`` (EasyID3 keys: title, artist, album...; multiple
    values joined with ",", absent = "") matches its ``{"method", "ref"}`` rule."""
    from mutagen.easyid3 import EasyID3

    if not _is_file(result):
        return 0.0
    tags = EasyID3(result)
    for key, rule in meta.items():
        value = tags.get(key, "")
        if isinstance(value, list):
            value = ",".join(value)
        if not _match_value_to_rule(value, rule):
            return 0.0
    return 1.0


# --------------------------------------------------------------------------- files (pdf, zip, epub, html)


def _pdf_text(path: Any) -> str:
    from pypdf import PdfReader

    if not _is_file(path):
        raise FileNotFoundError(path)
    reader = PdfReader(path)
    return "".join((page.extract_text() or "") + "\n" for page in reader.pages).strip()


def _pdf_text_bytes(content: bytes) -> str:
    import io

    from pypdf import PdfReader

    return "".join(page.extract_text() or "" for page in PdfReader(io.BytesIO(content)).pages)


@_safe
def compare_pdfs(pdf1_path: Any, pdf2_path: Any) -> float:
    """Mean over the pairs (a single path or two lists) of the fuzzy ratio of the PDFs' texts."""
    if not isinstance(pdf2_path, list):
        pdf1_path, pdf2_path = [pdf1_path], [pdf2_path]
    if not isinstance(pdf1_path, list) or not pdf2_path:
        return 0.0
    score = 0.0
    for p1, p2 in zip(pdf1_path, pdf2_path):
        try:
            score += fuzz.ratio(_pdf_text(p1), _pdf_text(p2)) / 100
        except _INPUT_ERRORS as e:
            logger.info("compare_pdfs: %s vs %s unreadable: %s", p1, p2, e)
    return score / len(pdf2_path)


@_safe
def check_pdf_pages(pdf_file: Any, rules: Mapping[str, Any]) -> float:
    """1 iff ``operator.<rules["relation"]>(number of pages, rules["ref_value"])``."""
    from pypdf import PdfReader

    if not _is_file(pdf_file):
        return 0.0
    pages = len(PdfReader(pdf_file).pages)
    return float(getattr(operator, rules["relation"])(pages, rules["ref_value"]))


def _render_pdf(pdftoppm: str, path: str, out_dir: str) -> list[bytes]:
    """Each page rendered at 72 dpi (PyMuPDF's default, which OSWorld uses) as raw RGB bytes
    prefixed by its size, in page order."""
    prefix = os.path.join(out_dir, "page")
    subprocess.run([pdftoppm, "-r", "72", "-png", path, prefix], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    pages = sorted((f for f in os.listdir(out_dir) if f.startswith("page-")),
                   key=lambda f: int(f[len("page-"):].split(".")[0]))
    out = []
    for name in pages:
        with Image.open(os.path.join(out_dir, name)) as img:
            rgb = img.convert("RGB")
            out.append(f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes())
    return out


@_safe
def compare_pdf_images(pdf1_path: Any, pdf2_path: Any, **kwargs: Any) -> float:
    """1 iff both PDFs have the same number of pages and every page renders to the same pixels.

    Pages are rendered with poppler's ``pdftoppm`` (OSWorld uses PyMuPDF; both files go through
    the same renderer, so equal pages stay equal). Without ``pdftoppm`` this raises
    :class:`UnsupportedOption`: a score would be a guess.
    """
    if not _is_file(pdf1_path) or not _is_file(pdf2_path):
        return 0.0
    pdftoppm = shutil.which("pdftoppm")
    if pdftoppm is None:
        raise UnsupportedOption("compare_pdf_images needs poppler's pdftoppm (Debian package poppler-utils)")
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        pages1 = _render_pdf(pdftoppm, str(pdf1_path), d1)
        pages2 = _render_pdf(pdftoppm, str(pdf2_path), d2)
    return float(len(pages1) == len(pages2) and pages1 == pages2)


def _zip_compare_function(file_type: str) -> Callable[..., float]:
    from osfarm.evaluators.metrics import docs, general, slides, table

    functions: dict[str, Callable[..., float]] = {
        "text": general.compare_text_file,
        "pdf": compare_pdfs,
        "docx": docs.compare_docx_files,
        "ppt": slides.compare_pptx_files,
        "image": compare_images,
        "csv": table.compare_csv,
        "table": table.compare_table,
        "audio": compare_audios,
        "video": compare_videos,
    }
    if file_type not in functions:
        raise UnsupportedOption(f"compare_archive: unsupported file_type {file_type!r}")
    return functions[file_type]


@_safe
def compare_archive(pred_path: Any, gold_path: Any, **kwargs: Any) -> float:
    """Unpack both archives (any format ``shutil.unpack_archive`` knows); 0 unless the names in
    ``file_path`` (default: the top folder) are the same; else the mean score of the same-named
    files compared with the metric for ``file_type`` (text, pdf, docx, ppt, image, csv, table,
    audio, video; default text), the other options passed on to it."""
    file_path = kwargs.pop("file_path", "")
    compare = _zip_compare_function(kwargs.pop("file_type", "text"))
    if not _is_file(pred_path) or not _is_file(gold_path):
        return 0.0
    with tempfile.TemporaryDirectory(prefix="osfarm_archive_") as tmp:
        pred_dir, gold_dir = os.path.join(tmp, "pred"), os.path.join(tmp, "gold")
        shutil.unpack_archive(pred_path, pred_dir)
        shutil.unpack_archive(gold_path, gold_dir)
        pred_files = sorted(os.listdir(os.path.join(pred_dir, file_path)))
        gold_files = sorted(os.listdir(os.path.join(gold_dir, file_path)))
        if pred_files != gold_files or not pred_files:
            return 0.0
        score = 0.0
        for name in pred_files:
            score += compare(os.path.join(pred_dir, file_path, name), os.path.join(gold_dir, file_path, name), **kwargs)
        return score / len(pred_files)


@_safe
def compare_zip_files(actual: Any, expected: Any, **options: Any) -> float:
    """1 iff both zips hold the same names with the same bytes (PDF members: text similarity
    (difflib ratio) >= 0.95)."""
    import difflib

    if not _is_file(actual) or not _is_file(expected):
        return 0.0
    with zipfile.ZipFile(actual) as z1, zipfile.ZipFile(expected) as z2:
        names = set(z1.namelist())
        if names != set(z2.namelist()):
            return 0.0
        for name in names:
            c1, c2 = z1.read(name), z2.read(name)
            if name.lower().endswith(".pdf"):
                ratio = difflib.SequenceMatcher(None, _pdf_text_bytes(c1), _pdf_text_bytes(c2)).ratio()
                if ratio < 0.95:
                    return 0.0
            elif c1 != c2:
                return 0.0
    return 1.0


def _epub_texts(path: Any) -> list[tuple[str, list[str]]]:
    """OSWorld's ``process_epub``: toc.ncx without navPoint lines, content.opf without
    dc:identifier lines, and every .html member re-serialised, as (name, lines), sorted."""
    if not _is_file(path):
        raise FileNotFoundError(path)
    out: list[tuple[str, list[str]]] = []
    with zipfile.ZipFile(path) as z:
        toc = z.read("toc.ncx").decode()
        out.append(("toc.ncx", [line for line in toc.splitlines() if "navPoint" not in line]))
        opf = z.read("content.opf").decode()
        out.append(("content.opf", [line for line in opf.splitlines() if "dc:identifier" not in line]))
        for name in z.namelist():
            if name.endswith(".html"):
                raw = z.read(name).decode().replace("\n", "").replace("\r", "")
                html = lxml.html.fromstring(raw.encode())
                out.append((name, lxml.html.tostring(html, pretty_print=True, encoding="unicode").splitlines()))
    return sorted(out)


@_safe
def compare_epub(result: Any, expected: Any) -> float:
    """Mean line-level similarity (difflib ratio) of the normalised members of two EPUBs
    (toc.ncx, content.opf, the .html chapters), paired in sorted order."""
    import difflib

    if not _is_file(result) or not _is_file(expected):
        return 0.0
    try:
        got, want = _epub_texts(result), _epub_texts(expected)
    except KeyError as e:  # no toc.ncx / content.opf: not an EPUB of the expected shape
        logger.info("compare_epub: %s", e)
        return 0.0
    if not got:
        return 0.0
    score = sum(difflib.SequenceMatcher(a=a[1], b=b[1]).ratio() for a, b in zip(got, want))
    return score / len(got)


@_safe
def compare_htmls(html_path1: Any, html_path2: Any, **options: Any) -> float:
    """1 iff, walking both parsed documents in order, every paired node agrees: tags in name,
    stripped text and attributes, other nodes (text, comments) exactly."""
    from bs4 import BeautifulSoup, Tag

    if not _is_file(html_path1) or not _is_file(html_path2):
        return 0.0
    with open(html_path1, encoding="utf-8") as f:
        soup1 = BeautifulSoup(f, "lxml")
    with open(html_path2, encoding="utf-8") as f:
        soup2 = BeautifulSoup(f, "lxml")
    for e1, e2 in zip(soup1.descendants, soup2.descendants):
        if isinstance(e1, Tag) and isinstance(e2, Tag):
            if e1.name != e2.name or e1.text.strip() != e2.text.strip() or e1.attrs != e2.attrs:
                return 0.0
        elif e1 != e2:
            return 0.0
    return 1.0


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f
    for f in (
        # images
        compare_images,
        compare_image_list,
        check_structure_sim,
        check_structure_sim_with_threshold,
        check_structure_sim_resized,
        check_brightness_decrease_and_structure_sim,
        check_saturation_increase_and_structure_sim,
        check_contrast_increase_and_structure_sim,
        check_image_size,
        check_image_file_size,
        check_palette_and_structure_sim,
        check_image_mirror,
        check_green_background,
        check_file_exists_and_structure_sim,
        check_triangle_position,
        check_textbox_on_leftside,
        # VLC / audio / video
        is_vlc_playing,
        is_vlc_fullscreen,
        is_vlc_recordings_folder,
        check_qt_bgcone,
        check_qt_max_volume,
        check_qt_minimal_view,
        check_qt_slider_colours,
        check_global_key_play_pause,
        check_one_instance_when_started_from_file,
        check_play_and_exit,
        compare_audios,
        compare_videos,
        check_mp3_meta,
        # files
        compare_pdfs,
        compare_pdf_images,
        check_pdf_pages,
        compare_archive,
        compare_zip_files,
        compare_epub,
        compare_htmls,
    )
}
