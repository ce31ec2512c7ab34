"""OSWorld's image metrics (``metrics/gimp.py``, and ``compare_images`` of ``vlc.py``): images
the agent saved or exported, compared with a reference or checked for a property (size,
brightness, saturation, contrast, mirroring, a palette, where a shape sits), and GIMP's own
config files.

Names, signatures and scoring follow OSWorld so that task JSONs run unchanged. Under the metric
contract (``contract.py``), an unreadable or missing image scores 0.0 while a missing rule key
still raises. SSIM is ``ssim.ssim`` (scikit-image's default, without scikit-image).

Deliberate differences from OSWorld, all where OSWorld has a plain bug:

* ``check_triangle_position`` takes the triangle to be the *second most* common colour
  (OSWorld picks the second *least* common one, which for a two-colour image is the background).
* ``check_image_size`` crops to the opaque content only when ``ignore_transparent`` is set
  (OSWorld's operator precedence also crops any image carrying a ``transparency`` entry).
* ``check_green_background`` indexes pixels as (row, column) (OSWorld swaps them and so fails on
  any non-square image).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from PIL import Image, ImageChops, ImageStat

from osfarm.evaluators.errors import RuleError
from osfarm.evaluators.metrics.contract import bad_input_scores_zero, is_file, never_raises, read_text
from osfarm.evaluators.metrics.ssim import ssim

__all__ = ["METRICS"]


def _open_image(path: Any) -> Image.Image:
    if not is_file(path):
        raise FileNotFoundError(path)
    img = Image.open(path)
    img.load()
    return img


def _structure_check_by_ssim(img1: Image.Image, img2: Image.Image, threshold: float = 0.9) -> bool:
    """OSWorld's ``structure_check_by_ssim``: RGB, same size, >= 7 px a side, SSIM >= threshold."""
    if min(img1.size + img2.size) < 7:
        return False
    img1 = img1.convert("RGB") if img1.mode != "RGB" else img1
    img2 = img2.convert("RGB") if img2.mode != "RGB" else img2
    if img1.size != img2.size:
        return False
    return ssim(np.asarray(img1), np.asarray(img2), win_size=7) >= threshold


def _structure_check_by_mse(img1: Image.Image, img2: Image.Image, threshold: float = 0.03) -> bool:
    """OSWorld's ``structure_check_by_mse``: img1 resized to img2, RGB, MSE on [0, 1] values."""
    if img1.size != img2.size:
        img1 = img1.resize(img2.size, Image.Resampling.LANCZOS)
    a = np.asarray(img1.convert("RGB"), dtype=np.float32) / 255
    b = np.asarray(img2.convert("RGB"), dtype=np.float32) / 255
    return float(np.mean((a - b) ** 2)) < threshold


# --------------------------------------------------------------------------- images


@bad_input_scores_zero
def compare_images(image1_path: Any, image2_path: Any, **options: Any) -> float:
    """SSIM of the two images in grayscale, both resized to the smaller size (OSWorld's tuple
    ``min``). With ``reference_base_result`` b: ``(ssim - b) / (1 - b)`` if ssim >= b + 0.01, else 0."""
    if not is_file(image1_path) or not is_file(image2_path):
        return 0.0
    if os.path.getsize(image1_path) == 0 or os.path.getsize(image2_path) == 0:
        return 0.0
    image1 = _open_image(image1_path).convert("L")
    image2 = _open_image(image2_path).convert("L")
    new_size = min(image1.size, image2.size)
    image1 = image1.resize(new_size, Image.Resampling.LANCZOS)
    image2 = image2.resize(new_size, Image.Resampling.LANCZOS)
    similarity = ssim(np.asarray(image1), np.asarray(image2))
    base = options.get("reference_base_result")
    if base is None:
        return similarity
    if similarity >= base + 0.01:
        return (similarity - base) / (1 - base)
    return 0.0


@bad_input_scores_zero
def compare_image_list(pred_img_path_list: Any, gold_img_path_list: Any) -> float:
    """1 iff every predicted image equals its gold image pixel for pixel (pred resized to gold's
    size and converted to gold's mode first)."""
    if not isinstance(pred_img_path_list, list):
        pred_img_path_list, gold_img_path_list = [pred_img_path_list], [gold_img_path_list]
    if not isinstance(gold_img_path_list, list) or not pred_img_path_list:
        return 0.0
    for pred_path, gold_path in zip(pred_img_path_list, gold_img_path_list, strict=False):
        if not is_file(pred_path) or not is_file(gold_path):
            return 0.0
        pred, gold = _open_image(pred_path), _open_image(gold_path)
        if pred.size != gold.size:
            pred = pred.resize(gold.size, Image.Resampling.LANCZOS)
        if pred.mode != gold.mode:
            pred = pred.convert(gold.mode)
        if ImageChops.difference(pred, gold).getbbox():
            return 0.0
    return 1.0


@bad_input_scores_zero
def check_structure_sim(src_path: Any, tgt_path: Any) -> float:
    """1 iff the images have the same size and SSIM >= 0.9."""
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    if src.size != tgt.size:
        return 0.0
    return float(_structure_check_by_ssim(src, tgt))


@bad_input_scores_zero
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
    return float(ssim(a, b, win_size=win) >= threshold)


@bad_input_scores_zero
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


@bad_input_scores_zero
def check_brightness_decrease_and_structure_sim(src_path: Any, tgt_path: Any, threshold: float = 0.03) -> float:
    """1 iff src is darker than tgt and, both normalised to mean brightness 128, their MSE is
    below ``threshold``."""
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    reduced = _brightness(tgt) > _brightness(src)
    same = _structure_check_by_mse(_normalize_brightness(src, 128), _normalize_brightness(tgt, 128), threshold)
    return float(reduced and same)


@bad_input_scores_zero
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


@bad_input_scores_zero
def check_contrast_increase_and_structure_sim(src_path: Any, tgt_path: Any) -> float:
    """1 iff src's contrast (std of all pixel values) is higher than tgt's and SSIM >= 0.65."""
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    higher = float(np.std(np.asarray(tgt, dtype=np.float32))) < float(np.std(np.asarray(src, dtype=np.float32)))
    return float(higher and _structure_check_by_ssim(src, tgt, threshold=0.65))


@bad_input_scores_zero
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


@bad_input_scores_zero
def check_image_file_size(src_path: Any, rule: Mapping[str, Any]) -> float:
    """1 iff the file is smaller than ``rule["max_size"]`` bytes."""
    if not is_file(src_path):
        return 0.0
    return float(os.path.getsize(src_path) < rule["max_size"])


@bad_input_scores_zero
def check_palette_and_structure_sim(src_path: Any, tgt_path: Any) -> float:
    """1 iff src is a palette ('P' mode) image and its RGB rendering has SSIM >= 0.9 with tgt."""
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    return float(src.mode == "P" and _structure_check_by_ssim(src.convert("RGB"), tgt))


@bad_input_scores_zero
def check_image_mirror(src_path: Any, tgt_path: Any) -> float:
    """1 iff src flipped left-right has SSIM >= 0.99 with tgt."""
    src, tgt = _open_image(src_path), _open_image(tgt_path)
    return float(_structure_check_by_ssim(src.transpose(Image.Transpose.FLIP_LEFT_RIGHT), tgt, 0.99))


@bad_input_scores_zero
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


@bad_input_scores_zero
def check_file_exists_and_structure_sim(src_path: Any, tgt_path: Any) -> float:
    """1 iff src exists and has SSIM >= 0.9 with tgt."""
    if not is_file(src_path):
        return 0.0
    return float(_structure_check_by_ssim(_open_image(src_path), _open_image(tgt_path)))


@bad_input_scores_zero
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


@bad_input_scores_zero
def check_textbox_on_leftside(src_path: Any) -> float:
    """1 iff the leftmost dark pixel (grey < 128: the text) lies in the left 5% of the image."""
    gray = np.asarray(_open_image(src_path).convert("L"))
    dark_columns = np.flatnonzero(np.any(gray < 128, axis=0))
    if dark_columns.size == 0:
        return 0.0
    return float(dark_columns[0] < gray.shape[1] * 0.05)


# --------------------------------------------------------------------------- GIMP's config files


@never_raises
def check_config_status(actual_config_path: Any, rule: Mapping[str, Any]) -> float:
    """GIMP's s-expression config (gimprc, sessionrc...): some line ``(key ... value)`` has
    first token ``rule["key"]`` (or first two tokens, for a two-item key list) and last token
    ``rule["value"]``. Comment and blank lines are skipped."""
    key = rule["key"]
    if not (isinstance(key, str) or (isinstance(key, list) and len(key) == 2)):
        raise RuleError(f"check_config_status: key must be a string or a pair, got {key!r}")
    text = read_text(actual_config_path)
    if text is None:
        return 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        items = line.strip().lstrip("(").rstrip(")").split()
        if not items:
            continue
        if isinstance(key, str):
            if items[0] == key and items[-1] == rule["value"]:
                return 1.0
        elif len(items) >= 2 and items[0] == key[0] and items[1] == key[1] and items[-1] == rule["value"]:
            return 1.0
    return 0.0


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f
    for f in (
        compare_images, compare_image_list, check_structure_sim, check_structure_sim_with_threshold,
        check_structure_sim_resized, check_brightness_decrease_and_structure_sim,
        check_saturation_increase_and_structure_sim, check_contrast_increase_and_structure_sim,
        check_image_size, check_image_file_size, check_palette_and_structure_sim, check_image_mirror,
        check_green_background, check_file_exists_and_structure_sim, check_triangle_position,
        check_textbox_on_leftside, check_config_status,
    )
}
