"""Word-processor metrics compatible with OSWorld's ``metrics/docs.py`` (LibreOffice Writer:
.docx and .odt documents, and Writer's default font in the user profile).

Names, signatures and scoring follow upstream; every metric is a pure function over file paths
and never raises: a missing, None or unreadable document scores 0.0. The exception is
``compare_image_text``, which needs EasyOCR (the optional ``ocr`` extra): without it, it raises
:class:`~osfarm.evaluators.errors.UnsupportedOption` instead of guessing a score.
"""

from __future__ import annotations

import io
import logging
import os
import re
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from docx import Document
from docx.enum.text import WD_PARAGRAPH_ALIGNMENT, WD_TAB_ALIGNMENT
from lxml import etree
from PIL import Image
from rapidfuzz import fuzz

from osfarm.evaluators.errors import RuleError, UnsupportedOption
from osfarm.evaluators.metrics import ocr
from osfarm.evaluators.metrics.color import delta_e_2000, srgb_to_lab
from osfarm.evaluators.metrics.contract import is_file, never_raises

logger = logging.getLogger(__name__)

_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_ODF_STYLE = "urn:oasis:names:tc:opendocument:xmlns:style:1.0"
_ODF_FO = "urn:oasis:names:tc:opendocument:xmlns:xsl-fo-compatible:1.0"
_ODF_OFFICE = "urn:oasis:names:tc:opendocument:xmlns:office:1.0"
_ODF_TEXT = "urn:oasis:names:tc:opendocument:xmlns:text:1.0"
_OOR = "{http://openoffice.org/2001/registry}"


def _open(path: str | None) -> Any:
    if not path or not os.path.isfile(path):
        return None
    try:
        return Document(path)
    except Exception as exc:  # noqa: BLE001 - not a docx
        logger.info("cannot open %s: %s", path, exc)
        return None


def _odt_paragraphs(path: str) -> list[str] | None:
    """Paragraph texts of an .odt (text:p / text:h in content.xml, spans flattened)."""
    try:
        with zipfile.ZipFile(path) as zf:
            root = etree.fromstring(zf.read("content.xml"))
    except Exception as exc:  # noqa: BLE001 - metrics never raise; any failure scores 0.0
        logger.info("cannot open %s: %s", path, exc)
        return None
    return ["".join(p.itertext()) for p in root.iter(f"{{{_ODF_TEXT}}}p", f"{{{_ODF_TEXT}}}h")]


def _paragraphs(path: str | None) -> list[str] | None:
    if not path or not os.path.isfile(path):
        return None
    if path.endswith(".odt"):
        return _odt_paragraphs(path)
    doc = _open(path)
    return None if doc is None else [p.text for p in doc.paragraphs]


def _ratio(a: str, b: str) -> float:
    """Indel similarity in [0, 1] (rapidfuzz ``fuzz.ratio`` / 100), via LCS.

    Memory is O(len(b)); long documents are fine, time is O(len(a) * len(b))."""
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0] * (len(b) + 1)
        for j in range(1, len(b) + 1):
            cur[j] = prev[j - 1] + 1 if ca == b[j - 1] else (max(cur[j - 1], prev[j]))
        prev = cur
    return 2.0 * prev[-1] / (len(a) + len(b))


def _squash(paragraphs: list[str]) -> str:
    return re.sub(r"\s+", " ", "\n".join(paragraphs)).strip()


@never_raises
def compare_docx_files(file1: str | None, file2: str | None, **options: Any) -> float:
    """Text comparison of two .docx (or two .odt) documents.

    Options (OSWorld defaults): ignore_blanks=True (whitespace runs collapse, whole text
    compared), ignore_case=False, ignore_order=False (sort paragraphs), content_only=False
    (return the fuzzy ratio of the squashed texts), fuzzy_match=False (ratio instead of
    equality; with fuzzy_match_threshold it becomes pass/fail), delete_empty_lines=False.
    """
    if not file1 or not file2:
        return 0.0
    ext1, ext2 = os.path.splitext(file1)[1], os.path.splitext(file2)[1]
    if ext1 != ext2 or ext1 not in {".docx", ".odt"}:
        return 0.0
    p1, p2 = _paragraphs(file1), _paragraphs(file2)
    if p1 is None or p2 is None:
        return 0.0
    ignore_case = options.get("ignore_case", False)
    threshold = options.get("fuzzy_match_threshold")
    if options.get("ignore_order", False):
        p1, p2 = sorted(p1), sorted(p2)
    if options.get("delete_empty_lines", False):
        p1, p2 = [p for p in p1 if p.strip()], [p for p in p2 if p.strip()]

    if options.get("content_only", False) or options.get("ignore_blanks", True):
        t1, t2 = _squash(p1), _squash(p2)
        if ignore_case:
            t1, t2 = t1.lower(), t2.lower()
        if options.get("content_only", False):
            return _ratio(t1, t2)
        if options.get("fuzzy_match", False):
            sim = _ratio(t1, t2)
            return float(sim >= threshold) if threshold is not None else sim
        return 1.0 if t1 == t2 else 0.0

    if len(p1) != len(p2):
        return 0.0
    if ignore_case:
        p1, p2 = [p.lower() for p in p1], [p.lower() for p in p2]
    if options.get("fuzzy_match", False):
        if not p1:
            return 1.0
        sims = [_ratio(a, b) for a, b in zip(p1, p2, strict=True)]
        if threshold is not None:
            sims = [float(s >= threshold) for s in sims]
        return sum(sims) / len(sims)
    return 1.0 if p1 == p2 else 0.0


@never_raises
def compare_docx_files_and_ignore_new_lines(file1: str | None, file2: str | None, **options: Any) -> float:
    """Like compare_docx_files but blank paragraphs are dropped before comparing."""
    return compare_docx_files(file1, file2, **{**options, "delete_empty_lines": True})


def _aligned_runs(doc1: Any, doc2: Any) -> Iterator[tuple[Any, Any]]:
    """Runs at the same place (paragraph i, run j) in both documents, up to the shorter one."""
    for p1, p2 in zip(doc1.paragraphs, doc2.paragraphs, strict=False):
        yield from zip(p1.runs, p2.runs, strict=False)


def _doc_if_text_matches(file1: str | None, file2: str | None) -> Any:
    """``file1`` opened, when its text matches ``file2``'s (``compare_docx_files``); else None.
    The formatting checks below only look at a document whose words are right."""
    if not compare_docx_files(file1, file2):
        return None
    return _open(file1)


@never_raises
def compare_docx_tables(docx_file1: str | None, docx_file2: str | None) -> float:
    """1.0 iff both documents have the same tables, cell texts equal after strip."""
    d1, d2 = _open(docx_file1), _open(docx_file2)
    if d1 is None or d2 is None or len(d1.tables) != len(d2.tables):
        return 0.0
    for t1, t2 in zip(d1.tables, d2.tables, strict=True):
        if len(t1.rows) != len(t2.rows) or len(t1.columns) != len(t2.columns):
            return 0.0
        for i in range(len(t1.rows)):
            for j in range(len(t1.columns)):
                if t1.cell(i, j).text.strip() != t2.cell(i, j).text.strip():
                    return 0.0
    return 1.0


@never_raises
def compare_line_spacing(docx_file1: str | None, docx_file2: str | None) -> float:
    """1.0 iff the texts match (compare_docx_files) and every paragraph's line spacing is equal."""
    d1, d2 = _doc_if_text_matches(docx_file1, docx_file2), _open(docx_file2)
    if d1 is None or d2 is None or len(d1.paragraphs) != len(d2.paragraphs):
        return 0.0
    for a, b in zip(d1.paragraphs, d2.paragraphs, strict=True):
        if a.paragraph_format.line_spacing != b.paragraph_format.line_spacing:
            return 0.0
    return 1.0


@never_raises
def contains_page_break(docx_file: str | None, rules: dict[str, Any] | None = None) -> float:
    """1.0 iff the body has at least one ``<w:br w:type="page"/>`` in a run, and exactly
    ``rules["page_break_count"]`` of them when that is given."""
    doc = _open(docx_file)
    if doc is None:
        return 0.0
    count = 0
    for para in doc.paragraphs:
        for run in para.runs:
            count += sum(1 for br in run.element.iter(f"{_W}br") if br.get(f"{_W}type") == "page")
    expected = (rules or {}).get("page_break_count")
    if expected is not None and count != expected:
        return 0.0
    return 1.0 if count > 0 else 0.0


@never_raises
def is_first_line_centered(docx_file: str | None) -> float:
    doc = _open(docx_file)
    if doc is None or not doc.paragraphs:
        return 0.0
    return 1.0 if doc.paragraphs[0].paragraph_format.alignment == WD_PARAGRAPH_ALIGNMENT.CENTER else 0.0


@never_raises
def compare_font_names(docx_file: str | None, rules: dict[str, Any]) -> float:
    """1.0 iff every run of every body paragraph has font ``rules["font_name"]``."""
    doc = _open(docx_file)
    if doc is None or not rules or "font_name" not in rules:
        return 0.0
    want = rules["font_name"]
    return 0.0 if any(r.font.name != want for p in doc.paragraphs for r in p.runs) else 1.0


@never_raises
def check_italic_font_size_14(path1: str | None, path2: str | None) -> float:
    """1.0 iff the texts match and every italic run is 14 pt."""
    doc = _doc_if_text_matches(path1, path2)
    if doc is None:
        return 0.0
    for p in doc.paragraphs:
        for r in p.runs:
            if r.italic and (r.font.size is None or r.font.size.pt != 14):
                return 0.0
    return 1.0


@never_raises
def evaluate_strike_through_last_paragraph(file_path1: str | None, file_path2: str | None) -> float:
    """1.0 iff the texts match and every run of the last paragraph is struck through."""
    doc = _doc_if_text_matches(file_path1, file_path2)
    if doc is None or not doc.paragraphs:
        return 0.0
    return 1.0 if all(r.font.strike for r in doc.paragraphs[-1].runs) else 0.0


@never_raises
def compare_subscript_contains(docx_file1: str | None, docx_file2: str | None) -> float:
    """1.0 iff some aligned pair of runs is subscript in both documents."""
    d1, d2 = _open(docx_file1), _open(docx_file2)
    if d1 is None or d2 is None:
        return 0.0
    return 1.0 if any(r1.font.subscript and r2.font.subscript for r1, r2 in _aligned_runs(d1, d2)) else 0.0


@never_raises
def has_page_numbers_in_footers(docx_file: str | None) -> float:
    """1.0 iff every section's footer's first paragraph contains a digit.

    A PAGE field that Writer saved with its cached value counts; an empty field does not."""
    doc = _open(docx_file)
    if doc is None:
        return 0.0
    for section in doc.sections:
        paras = section.footer.paragraphs
        text = "".join(paras[0]._p.itertext()) if paras else ""
        if not any(c.isdigit() for c in text):
            return 0.0
    return 1.0


def _image_blobs(doc: Any) -> list[bytes]:
    return [rel.target_part.blob for rel in doc.part.rels.values() if "image" in rel.reltype]


@never_raises
def compare_docx_images(docx_file1: str | None, docx_file2: str | None) -> float:
    """1.0 iff both documents embed the same number of images with identical pixels."""
    d1, d2 = _open(docx_file1), _open(docx_file2)
    if d1 is None or d2 is None:
        return 0.0
    b1, b2 = _image_blobs(d1), _image_blobs(d2)
    if len(b1) != len(b2):
        return 0.0
    for x, y in zip(b1, b2, strict=True):
        if Image.open(io.BytesIO(x)).tobytes() != Image.open(io.BytesIO(y)).tobytes():
            return 0.0
    return 1.0


@never_raises
def compare_contains_image(docx_file1: str | None, docx_file2: str | None) -> float:
    """1.0 iff aligned runs agree on whether they hold a drawing."""
    d1, d2 = _open(docx_file1), _open(docx_file2)
    if d1 is None or d2 is None:
        return 0.0
    drawing_differs = (("graphicData" in r1._element.xml) != ("graphicData" in r2._element.xml)
                       for r1, r2 in _aligned_runs(d1, d2))
    return 0.0 if any(drawing_differs) else 1.0


@never_raises
def find_default_font(config_file_path: Any, rules: Mapping[str, Any]) -> float:
    """LibreOffice ``registrymodifications.xcu``: Writer's ``DefaultFont/Standard`` value equals
    ``rules["font_name"]`` (the last such item wins)."""
    expected = rules["font_name"]
    if not is_file(config_file_path):
        return 0.0
    root = ET.parse(config_file_path).getroot()
    font = None
    for item in root.iter("item"):
        if item.get(f"{_OOR}path") != "/org.openoffice.Office.Writer/DefaultFont":
            continue
        for prop in item.iter("prop"):
            if prop.get(f"{_OOR}name") == "Standard":
                for value in prop.findall("value"):
                    font = value.text
    return float(font == expected)


@never_raises
def check_tabstops(docx_file1: Any, docx_file2: Any, **kwargs: Any) -> float:
    """Tab stops of the non-empty paragraphs match the reference: same count and alignment
    per paragraph, score 1 - mean(sum |position diff| / text width).

    ``word_number_split_by_tabstop=N`` (with ``index``, default 0) also requires the index-th
    tab-separated part of every paragraph to hold exactly N words."""
    doc1, doc2 = _open(docx_file1), _open(docx_file2)
    if doc1 is None or doc2 is None:
        return 0.0
    para1 = [p for p in doc1.paragraphs if p.text.strip()]
    para2 = [p for p in doc2.paragraphs if p.text.strip()]
    if len(para1) != len(para2) or not para1:
        return 0.0
    number = kwargs.get("word_number_split_by_tabstop")
    if number is not None:
        index = kwargs.get("index", 0)
        for p in para1:
            parts = p.text.split("\t")
            words = [w for w in re.split(r"\s", parts[index]) if w.strip()]
            if len(words) != number:
                return 0.0
    section = doc2.sections[0]
    width = section.page_width - section.left_margin - section.right_margin

    def kept(tab: Any) -> bool:
        return not (
            tab.alignment == WD_TAB_ALIGNMENT.CLEAR or (tab.alignment == WD_TAB_ALIGNMENT.LEFT and tab.position == 0)
        )

    minus = 0.0
    for p1, p2 in zip(para1, para2, strict=True):
        tabs1 = [t for t in p1.paragraph_format.tab_stops if kept(t)]
        tabs2 = [t for t in p2.paragraph_format.tab_stops if kept(t)]
        if len(tabs1) != len(tabs2):
            return 0.0
        diff = 0.0
        for t1, t2 in zip(tabs1, tabs2, strict=True):
            if t1.alignment != t2.alignment:
                return 0.0
            diff += abs(t1.position - t2.position)
        minus += diff / width
    return 1.0 - minus / len(para1)


@never_raises
def compare_references(file1: Any, file2: Any, **options: Any) -> float:
    """Reference lists after the first paragraph equal to ``reference_indicator`` (default
    "References"): same count, mean fuzzy ratio r; score (r - base) / (1 - base) when
    r >= base + 0.01 (``reference_base_result``, default 0.5), else 0. No reference section in
    either document scores 1."""
    indicator = options.get("reference_indicator", "References")
    base = float(options.get("reference_base_result", 0.5))
    if not (isinstance(file1, str) and isinstance(file2, str)):
        return 0.0
    if not (file1.endswith(".docx") and file2.endswith(".docx")):
        return 0.0
    doc1, doc2 = _open(file1), _open(file2)
    if doc1 is None or doc2 is None:
        return 0.0
    paras1 = [p.text for p in doc1.paragraphs]
    paras2 = [p.text for p in doc2.paragraphs]
    idx1 = paras1.index(indicator) if indicator in paras1 else -1
    idx2 = paras2.index(indicator) if indicator in paras2 else -1
    if idx1 == -1 and idx2 == -1:
        return 1.0
    if idx1 == -1 or idx2 == -1:
        return 0.0
    refs1 = [p for p in paras1[idx1 + 1 :] if p.strip()]
    refs2 = [p for p in paras2[idx2 + 1 :] if p.strip()]
    if len(refs1) != len(refs2):
        return 0.0
    if not refs1:
        return 1.0
    mean = sum(fuzz.ratio(a, b) / 100.0 for a, b in zip(refs1, refs2, strict=True)) / len(refs1)
    if mean >= base + 0.01:
        return (mean - base) / (1 - base)
    return 0.0


@never_raises
def evaluate_colored_words_in_tables(file_path1: Any, file_path2: Any, **kwargs: Any) -> float:
    """The result's text matches the reference (``compare_docx_files``) and, in every table,
    each run whose text starts with a vowel is red and every other run is blue: CIEDE2000
    distance to (255, 0, 0) / (0, 0, 255) at most ``threshold`` (default 3.5). A run without
    an explicit colour fails."""
    doc = _doc_if_text_matches(file_path1, file_path2)
    if doc is None:
        return 0.0
    threshold = float(kwargs.get("threshold", 3.5))
    red, blue = srgb_to_lab((255, 0, 0)), srgb_to_lab((0, 0, 255))
    for table in doc.tables:
        for row in table.rows:
            for cell in row.cells:
                for paragraph in cell.paragraphs:
                    for run in paragraph.runs:
                        if not run.text:
                            continue
                        rgb = run.font.color.rgb
                        if rgb is None:
                            return 0.0
                        target = red if run.text[0].lower() in "aeiou" else blue
                        if delta_e_2000(srgb_to_lab(tuple(rgb)), target) > threshold:
                            return 0.0
    return 1.0


@never_raises
def check_highlighted_words(file_path1: Any, file_path2: Any) -> float:
    """The .odt result matches the reference text (``compare_docx_files``) and no text span
    uses an automatic style with yellow (``#ffff00``) background: the highlights were removed."""
    if not compare_docx_files(file_path1, file_path2):
        return 0.0
    with zipfile.ZipFile(file_path1) as zf:
        root = ET.fromstring(zf.read("content.xml"))
    yellow: set[str] = set()
    auto = root.find(f"{{{_ODF_OFFICE}}}automatic-styles")
    if auto is not None:
        for style in auto:
            for prop in style:
                if (prop.get(f"{{{_ODF_FO}}}background-color") or "").lower() == "#ffff00":
                    yellow.add(style.get(f"{{{_ODF_STYLE}}}name", ""))
    for span in root.iter(f"{{{_ODF_TEXT}}}span"):
        if span.get(f"{{{_ODF_TEXT}}}style-name") in yellow:
            return 0.0
    return 1.0


def _train_lines(path: Any) -> tuple[list[str], list[str]] | None:
    doc = _open(path)
    if doc is None:
        return None
    lines = [p.text.strip() for p in doc.paragraphs if p.text.strip()]
    ids = [line.split(",")[1].strip() for line in lines if len(line.split(",")) == 4]
    return lines, ids


@never_raises
def compare_unique_train_records(processed_file: Any, expected_files: Any, **kwargs: Any) -> float:
    """De-duplicated train records (``time, train_id, station, platform`` lines of a .docx).

    ``expected_files = [gold, initial]``. 1 iff every processed line was in the initial file,
    no train id repeats, the set of ids equals the gold one and the line counts agree."""
    if not processed_file or not isinstance(expected_files, list) or len(expected_files) < 2:
        return 0.0
    processed, gold, initial = (_train_lines(p) for p in (processed_file, expected_files[0], expected_files[1]))
    if processed is None or gold is None or initial is None:
        return 0.0
    p_lines, p_ids = processed
    g_lines, g_ids = gold
    if not set(p_lines) <= set(initial[0]):
        return 0.0
    if len(p_ids) != len(set(p_ids)):
        return 0.0
    if set(p_ids) != set(g_ids):
        return 0.0
    return float(len(p_lines) == len(g_lines))


@never_raises
def compare_docx_lines(file1: Any, file2: Any) -> float:
    """OSWorld: 1 iff both .docx hold the same set of non-blank paragraph texts (each stripped;
    order and repeats ignored)."""
    doc1, doc2 = _open(file1), _open(file2)
    if doc1 is None or doc2 is None:
        return 0.0
    lines1 = {p.text.strip() for p in doc1.paragraphs if p.text.strip()}
    lines2 = {p.text.strip() for p in doc2.paragraphs if p.text.strip()}
    return float(lines1 == lines2)


def compare_image_text(image_path: str | None, rule: dict[str, Any]) -> float:
    """OSWorld: 1.0 iff ``rule["text"]`` is a substring of EasyOCR's readings of the image,
    joined with spaces (see :mod:`osfarm.evaluators.metrics.ocr`). A missing or unreadable image
    scores 0; a rule whose ``type`` is not ``"text"`` is the task's error (RuleError); without the
    ``ocr`` extra it raises :class:`UnsupportedOption` ("install osfarm[ocr]"), not a 0: the agent
    may have done the task."""
    if not isinstance(rule, dict) or rule.get("type") != "text" or not isinstance(rule.get("text"), str):
        raise RuleError(f"compare_image_text: rule must be {{'type': 'text', 'text': str}}, got {rule!r}")
    if not ocr.ocr_available():
        raise UnsupportedOption(ocr.OCR_MISSING)
    if not is_file(image_path):
        return 0.0
    try:
        texts = ocr.image_texts(image_path)  # type: ignore[arg-type]
    except (ValueError, OSError) as exc:
        logger.info("compare_image_text: cannot read %s: %s", image_path, exc)
        return 0.0
    logger.info("compare_image_text: EasyOCR read %r", texts)
    return float(rule["text"] in " ".join(texts))


METRICS: dict[str, Callable[..., float]] = {
    "compare_image_text": compare_image_text,
    "compare_docx_files": compare_docx_files,
    "compare_docx_lines": compare_docx_lines,
    "compare_docx_files_and_ignore_new_lines": compare_docx_files_and_ignore_new_lines,
    "compare_docx_tables": compare_docx_tables,
    "compare_line_spacing": compare_line_spacing,
    "contains_page_break": contains_page_break,
    "is_first_line_centered": is_first_line_centered,
    "compare_font_names": compare_font_names,
    "check_italic_font_size_14": check_italic_font_size_14,
    "evaluate_strike_through_last_paragraph": evaluate_strike_through_last_paragraph,
    "compare_subscript_contains": compare_subscript_contains,
    "has_page_numbers_in_footers": has_page_numbers_in_footers,
    "compare_docx_images": compare_docx_images,
    "compare_contains_image": compare_contains_image,
    "find_default_font": find_default_font,
    "check_tabstops": check_tabstops,
    "compare_references": compare_references,
    "check_highlighted_words": check_highlighted_words,
    "evaluate_colored_words_in_tables": evaluate_colored_words_in_tables,
    "compare_unique_train_records": compare_unique_train_records,
}
