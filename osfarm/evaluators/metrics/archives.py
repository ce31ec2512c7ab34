"""OSWorld's metrics over archives (``compare_archive`` of ``metrics/chrome.py``,
``compare_zip_files`` of ``vscode.py``, ``compare_epub`` of ``others.py``): both files are
unpacked and their members compared, each with the metric for its kind. Under the metric
contract (``contract.py``) an unreadable archive scores 0.0; an unknown ``file_type`` raises."""

from __future__ import annotations

import difflib
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from typing import Any

import lxml.html

from osfarm.evaluators.errors import UnsupportedOption
from osfarm.evaluators.metrics.audio_video import compare_audios, compare_videos
from osfarm.evaluators.metrics.contract import bad_input_scores_zero, is_file
from osfarm.evaluators.metrics.docs import compare_docx_files
from osfarm.evaluators.metrics.gimp import compare_images
from osfarm.evaluators.metrics.pdf import compare_pdfs, pdf_text_bytes
from osfarm.evaluators.metrics.slides import compare_pptx_files
from osfarm.evaluators.metrics.table import compare_csv, compare_table
from osfarm.evaluators.metrics.vscode import compare_text_file

logger = logging.getLogger(__name__)

__all__ = ["METRICS"]

# compare_archive's file_type -> the metric comparing two members of that type
_MEMBER_METRICS: dict[str, Callable[..., float]] = {
    "text": compare_text_file,
    "pdf": compare_pdfs,
    "docx": compare_docx_files,
    "ppt": compare_pptx_files,
    "image": compare_images,
    "csv": compare_csv,
    "table": compare_table,
    "audio": compare_audios,
    "video": compare_videos,
}


def _member_metric(file_type: str) -> Callable[..., float]:
    if file_type not in _MEMBER_METRICS:
        raise UnsupportedOption(f"compare_archive: unsupported file_type {file_type!r}")
    return _MEMBER_METRICS[file_type]


@bad_input_scores_zero
def compare_archive(pred_path: Any, gold_path: Any, **kwargs: Any) -> float:
    """Unpack both archives (any format ``shutil.unpack_archive`` knows); 0 unless the names in
    ``file_path`` (default: the top folder) are the same; else the mean score of the same-named
    files compared with the metric for ``file_type`` (text, pdf, docx, ppt, image, csv, table,
    audio, video; default text), the other options passed on to it."""
    file_path = kwargs.pop("file_path", "")
    compare = _member_metric(kwargs.pop("file_type", "text"))
    if not is_file(pred_path) or not is_file(gold_path):
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


@bad_input_scores_zero
def compare_zip_files(actual: Any, expected: Any, **options: Any) -> float:
    """1 iff both zips hold the same names with the same bytes (PDF members: text similarity
    (difflib ratio) >= 0.95)."""
    if not is_file(actual) or not is_file(expected):
        return 0.0
    with zipfile.ZipFile(actual) as z1, zipfile.ZipFile(expected) as z2:
        names = set(z1.namelist())
        if names != set(z2.namelist()):
            return 0.0
        for name in names:
            c1, c2 = z1.read(name), z2.read(name)
            if name.lower().endswith(".pdf"):
                ratio = difflib.SequenceMatcher(None, pdf_text_bytes(c1), pdf_text_bytes(c2)).ratio()
                if ratio < 0.95:
                    return 0.0
            elif c1 != c2:
                return 0.0
    return 1.0


def _epub_texts(path: Any) -> list[tuple[str, list[str]]]:
    """OSWorld's ``process_epub``: toc.ncx without navPoint lines, content.opf without
    dc:identifier lines, and every .html member re-serialised, as (name, lines), sorted."""
    if not is_file(path):
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


@bad_input_scores_zero
def compare_epub(result: Any, expected: Any) -> float:
    """Mean line-level similarity (difflib ratio) of the normalised members of two EPUBs
    (toc.ncx, content.opf, the .html chapters), paired in sorted order."""
    if not is_file(result) or not is_file(expected):
        return 0.0
    try:
        got, want = _epub_texts(result), _epub_texts(expected)
    except KeyError as e:  # no toc.ncx / content.opf: not an EPUB of the expected shape
        logger.info("compare_epub: %s", e)
        return 0.0
    if not got:
        return 0.0
    score = sum(difflib.SequenceMatcher(a=a[1], b=b[1]).ratio() for a, b in zip(got, want, strict=False))
    return score / len(got)


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f for f in (compare_archive, compare_zip_files, compare_epub)
}
