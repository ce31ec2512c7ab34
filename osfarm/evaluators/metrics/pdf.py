"""OSWorld's PDF metrics (``compare_pdfs`` and ``compare_pdf_images`` of ``metrics/chrome.py``,
``check_pdf_pages`` of ``pdf.py``): text extracted with pypdf instead of PyMuPDF, pages rendered
with poppler's ``pdftoppm`` instead of PyMuPDF. Under the metric contract (``contract.py``) an
unreadable PDF scores 0.0."""

from __future__ import annotations

import io
import logging
import operator
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from PIL import Image
from pypdf import PdfReader
from rapidfuzz import fuzz

from osfarm.evaluators.errors import UnsupportedOption
from osfarm.evaluators.metrics.contract import INPUT_ERRORS, bad_input_scores_zero, is_file

logger = logging.getLogger(__name__)

__all__ = ["METRICS", "pdf_text_bytes"]


def _pdf_text(path: Any) -> str:
    if not is_file(path):
        raise FileNotFoundError(path)
    reader = PdfReader(path)
    return "".join((page.extract_text() or "") + "\n" for page in reader.pages).strip()


def pdf_text_bytes(content: bytes) -> str:
    """The text of a PDF held in memory, its pages' texts joined."""
    return "".join(page.extract_text() or "" for page in PdfReader(io.BytesIO(content)).pages)


@bad_input_scores_zero
def compare_pdfs(pdf1_path: Any, pdf2_path: Any) -> float:
    """Mean over the pairs (a single path or two lists) of the fuzzy ratio of the PDFs' texts."""
    if not isinstance(pdf2_path, list):
        pdf1_path, pdf2_path = [pdf1_path], [pdf2_path]
    if not isinstance(pdf1_path, list) or not pdf2_path:
        return 0.0
    score = 0.0
    for p1, p2 in zip(pdf1_path, pdf2_path, strict=False):
        try:
            score += fuzz.ratio(_pdf_text(p1), _pdf_text(p2)) / 100
        except INPUT_ERRORS as e:
            logger.info("compare_pdfs: %s vs %s unreadable: %s", p1, p2, e)
    return score / len(pdf2_path)


@bad_input_scores_zero
def check_pdf_pages(pdf_file: Any, rules: Mapping[str, Any]) -> float:
    """1 iff ``operator.<rules["relation"]>(number of pages, rules["ref_value"])``."""
    if not is_file(pdf_file):
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


@bad_input_scores_zero
def compare_pdf_images(pdf1_path: Any, pdf2_path: Any, **kwargs: Any) -> float:
    """1 iff both PDFs have the same number of pages and every page renders to the same pixels.

    Pages are rendered with poppler's ``pdftoppm`` (OSWorld uses PyMuPDF; both files go through
    the same renderer, so equal pages stay equal). Without ``pdftoppm`` this raises
    :class:`UnsupportedOption`: a score would be a guess.
    """
    if not is_file(pdf1_path) or not is_file(pdf2_path):
        return 0.0
    pdftoppm = shutil.which("pdftoppm")
    if pdftoppm is None:
        raise UnsupportedOption("compare_pdf_images needs poppler's pdftoppm (Debian package poppler-utils)")
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        pages1 = _render_pdf(pdftoppm, str(pdf1_path), d1)
        pages2 = _render_pdf(pdftoppm, str(pdf2_path), d2)
    return float(len(pages1) == len(pages2) and pages1 == pages2)


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f for f in (compare_pdfs, compare_pdf_images, check_pdf_pages)
}
