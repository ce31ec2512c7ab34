"""Presentation metrics compatible with OSWorld's ``metrics/slides.py``.

``compare_pptx_files(result, expected, **options)`` walks both decks in parallel and scores 1.0
only if nothing examined differs; every ``examine_*`` option keeps OSWorld's default. All
metrics are pure functions over file paths and never raise: unreadable input scores 0.0.
"""

from __future__ import annotations

import logging
import math
import os
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

from pptx import Presentation
from pptx.enum.shapes import MSO_SHAPE_TYPE
from pptx.enum.text import PP_ALIGN
from pptx.util import Inches

from osfarm.evaluators.metrics.contract import never_raises

logger = logging.getLogger("osfarm.evaluators.metrics.slides")


_A = "{http://schemas.openxmlformats.org/drawingml/2006/main}"

# option name -> OSWorld default
_DEFAULTS: dict[str, bool] = {
    "examine_number_of_slides": True,
    "examine_shape": True,
    "examine_text": True,
    "examine_indent": True,
    "examine_font_name": True,
    "examine_font_size": True,
    "examine_font_bold": True,
    "examine_font_italic": True,
    "examine_color_rgb": True,
    "examine_font_underline": True,
    "examine_strike_through": True,
    "examine_alignment": True,
    "examine_bullets": True,
    "examine_background_color": True,
    "examine_note": True,
    "examine_image_size": False,
    "examine_modify_height": False,
}


class _Mismatch(Exception):
    """Raised internally at the first difference; the public function turns it into 0.0."""


def _open(path: str | None) -> Any:
    if not path or not os.path.isfile(path):
        return None
    try:
        return Presentation(path)
    except Exception as exc:  # noqa: BLE001 - not a pptx, truncated zip, ...
        logger.info("cannot open %s: %s", path, exc)
        return None


def _approx(a: Any, b: Any, tol: float) -> bool:
    """Relative comparison of EMU geometry (LibreOffice round-trips shift a few EMUs)."""
    if a == b:
        return True
    if a is None or b is None or a == 0 or b == 0:
        return False
    return abs(a - b) / max(abs(a), abs(b)) <= tol


def _background_rgb(slide: Any) -> Any:
    fill = slide.background.fill
    if fill.type == 1:  # solid
        return fill.fore_color.rgb
    if fill.type == 5:  # background inherited from the master
        master = slide.slide_layout.slide_master.background.fill
        return master.fore_color.rgb if master.type == 1 else None
    return None


def _notes(slide: Any) -> str:
    if not slide.has_notes_slide:
        return ""
    frame = slide.notes_slide.notes_text_frame
    return frame.text.strip() if frame is not None else ""


def _bullets(slide: Any) -> list[tuple[str, str, str]]:
    """(level, bullet char, text) for every non-empty paragraph of the slide XML."""
    root = ET.fromstring(slide.part.blob)
    out = []
    for p in root.iter(f"{_A}p"):
        text = "".join(t.text or "" for t in p.iter(f"{_A}t"))
        if not text.strip():
            continue
        ppr = p.find(f"{_A}pPr")
        lvl = "0"
        char: str | None = "No Bullet"  # None: a bullet element without a character
        if ppr is not None:
            lvl = ppr.get("lvl") or "0"
            bu = ppr.find(f"{_A}buChar")
            char = bu.get("char") if bu is not None else char
        out.append((lvl, char or "", text))
    return out


def _color(run: Any) -> Any:
    try:
        return run.font.color.rgb
    except AttributeError:  # theme colour or no colour: upstream skips these
        return None


def _strike(run: Any) -> str:
    return run.font._rPr.get("strike", "noStrike") if run.font._rPr is not None else "noStrike"


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise _Mismatch(what)


def _same_flag(a: Any, b: Any) -> bool:
    """Bold/italic: None (inherit) and False both mean off."""
    return bool(a) == bool(b)


def _same_underline(a: Any, b: Any) -> bool:
    if a == b:
        return True
    # upstream tolerates None vs False / None vs a style, but not two different set values
    # nor None vs True
    if a is not None and b is not None:
        return False
    return not (a is True or b is True)


def _compare_runs(runs1: list[Any], runs2: list[Any], opt: dict[str, Any], where: str, table: bool = False) -> None:
    _check(len(runs1) == len(runs2), f"{where}: run count")
    for r1, r2 in zip(runs1, runs2, strict=True):
        f1, f2 = r1.font, r2.font
        if not table:
            if opt["examine_font_name"]:
                _check(f1.name == f2.name, f"{where}: font name {f1.name} != {f2.name}")
            if opt["examine_font_size"]:
                _check(f1.size == f2.size, f"{where}: font size")
        if opt["examine_font_bold"] or table:
            _check(_same_flag(f1.bold, f2.bold), f"{where}: bold")
        if opt["examine_font_italic"] or table:
            _check(_same_flag(f1.italic, f2.italic), f"{where}: italic")
        c1, c2 = _color(r1), _color(r2)
        if opt["examine_color_rgb"] and c1 is not None and c2 is not None:
            _check(c1 == c2, f"{where}: colour {c1} != {c2}")
        if opt["examine_font_underline"] or table:
            _check(_same_underline(f1.underline, f2.underline), f"{where}: underline")
        if opt["examine_strike_through"] and not table:
            _check(_strike(r1) == _strike(r2), f"{where}: strike")


def _compare_table(t1: Any, t2: Any, opt: dict[str, Any], where: str) -> None:
    _check(len(t1.rows) == len(t2.rows) and len(t1.columns) == len(t2.columns), f"{where}: table size")
    for i in range(len(t1.rows)):
        for j in range(len(t1.columns)):
            c1, c2 = t1.cell(i, j), t2.cell(i, j)
            if opt["examine_text"]:
                _check(c1.text.strip() == c2.text.strip(), f"{where}[{i},{j}]: cell text")
            p1, p2 = c1.text_frame.paragraphs, c2.text_frame.paragraphs
            _check(len(p1) == len(p2), f"{where}[{i},{j}]: paragraph count")
            for a, b in zip(p1, p2, strict=True):
                _compare_runs(list(a.runs), list(b.runs), opt, f"{where}[{i},{j}]", table=True)


def _compare_text_frame(s1: Any, s2: Any, opt: dict[str, Any], where: str) -> None:
    if opt["examine_text"]:
        _check(s1.text.strip() == s2.text.strip(), f"{where}: text {s1.text!r} != {s2.text!r}")
    paras1, paras2 = s1.text_frame.paragraphs, s2.text_frame.paragraphs
    _check(len(paras1) == len(paras2), f"{where}: paragraph count")
    for k, (p1, p2) in enumerate(zip(paras1, paras2, strict=True)):
        here = f"{where} p{k}"
        if opt["examine_alignment"]:
            # no explicit alignment renders as left
            _check((p1.alignment or PP_ALIGN.LEFT) == (p2.alignment or PP_ALIGN.LEFT), f"{here}: alignment")
        if opt["examine_text"]:
            _check(p1.text == p2.text, f"{here}: text")
        if opt["examine_indent"]:
            _check(p1.level == p2.level, f"{here}: level")
        _compare_runs(list(p1.runs), list(p2.runs), opt, here)


def _has_text(shape: Any) -> bool:
    return bool(getattr(shape, "has_text_frame", False))


def _compare_shapes(sh1: Any, sh2: Any, opt: dict[str, Any], tol: float, where: str) -> None:
    same_geometry = all(_approx(getattr(sh1, a), getattr(sh2, a), tol) for a in ("left", "top", "width", "height"))
    if opt["examine_shape"]:
        _check(same_geometry, f"{where}: geometry")
    if opt["examine_image_size"]:
        if sh1.shape_type == MSO_SHAPE_TYPE.PICTURE and sh2.shape_type == MSO_SHAPE_TYPE.PICTURE:
            _check(_approx(sh1.width, sh2.width, tol) and _approx(sh1.height, sh2.height, tol), f"{where}: image size")
        else:
            _check(same_geometry, f"{where}: geometry")
    if opt["examine_modify_height"]:
        if (not _has_text(sh1) and not _has_text(sh2)) or (
            sh1.shape_type == MSO_SHAPE_TYPE.FREEFORM and sh2.shape_type == MSO_SHAPE_TYPE.FREEFORM
        ):
            _check(_approx(sh1.height, sh2.height, tol), f"{where}: height")
        else:
            _check(same_geometry, f"{where}: geometry")
    if getattr(sh1, "has_table", False) and getattr(sh2, "has_table", False):
        _compare_table(sh1.table, sh2.table, opt, where)
    if _has_text(sh1) and _has_text(sh2):
        _compare_text_frame(sh1, sh2, opt, where)
    if sh1.shape_type == MSO_SHAPE_TYPE.GROUP and sh2.shape_type == MSO_SHAPE_TYPE.GROUP:
        g1, g2 = list(sh1.shapes), list(sh2.shapes)
        _check(len(g1) == len(g2), f"{where}: group size")
        for n, (a, b) in enumerate(zip(g1, g2, strict=True)):
            _compare_shapes(a, b, opt, tol, f"{where}/g{n}")


def _compare_decks(prs1: Any, prs2: Any, opt: dict[str, Any], tol: float) -> None:
    if opt["examine_number_of_slides"]:
        _check(len(prs1.slides) == len(prs2.slides), "slide count")
    for i, (s1, s2) in enumerate(zip(prs1.slides, prs2.slides, strict=False)):
        where = f"slide {i + 1}"
        if opt["examine_background_color"]:
            _check(_background_rgb(s1) == _background_rgb(s2), f"{where}: background")
        if opt["examine_note"]:
            _check(_notes(s1) == _notes(s2), f"{where}: notes")
        shapes1, shapes2 = list(s1.shapes), list(s2.shapes)
        _check(len(shapes1) == len(shapes2), f"{where}: shape count")
        for n, (a, b) in enumerate(zip(shapes1, shapes2, strict=True)):
            _compare_shapes(a, b, opt, tol, f"{where} shape {n}")
        if opt["examine_bullets"]:
            _check(_bullets(s1) == _bullets(s2), f"{where}: bullets")


@never_raises
def compare_pptx_files(file1_path: str | None, file2_path: str | None, **options: Any) -> float:
    """1.0 iff the two decks agree on everything the ``examine_*`` options ask about.

    Geometry is compared with relative tolerance ``approximately_tolerance`` (default 0.005).
    """
    prs1, prs2 = _open(file1_path), _open(file2_path)
    if prs1 is None or prs2 is None:
        return 0.0
    opt = {k: bool(options.get(k, v)) for k, v in _DEFAULTS.items()}
    tol = float(options.get("approximately_tolerance", 0.005))
    try:
        _compare_decks(prs1, prs2, opt, tol)
    except _Mismatch as why:
        logger.debug("compare_pptx_files: %s", why)
        return 0.0
    return 1.0


@never_raises
def check_image_stretch_and_center(modified_ppt: str | None, original_ppt: str | None) -> float:
    """1.0 iff the first picture of slide 1 now fills the slide and is centred (0.5 in slack)."""
    mod, orig = _open(modified_ppt), _open(original_ppt)
    if mod is None or orig is None or not len(mod.slides) or not len(orig.slides):
        return 0.0
    pics = [s for s in orig.slides[0].shapes if s.shape_type == MSO_SHAPE_TYPE.PICTURE]
    if not pics:
        return 0.0
    blob = pics[0].image.blob
    target = None
    for s in mod.slides[0].shapes:
        if s.shape_type == MSO_SHAPE_TYPE.PICTURE and s.image.blob == blob:
            target = s
    if target is None:
        return 0.0
    sw, sh, slack = orig.slide_width, orig.slide_height, Inches(0.5)
    ok = (
        abs(target.width - sw) <= slack
        and abs(target.height - sh) <= slack
        and abs(target.left - (sw - target.width) / 2) <= slack
        and abs(target.top - (sh - target.height) / 2) <= slack
    )
    return 1.0 if ok else 0.0


@never_raises
def check_slide_orientation_Portrait(pptx_path: str | None) -> float:
    prs = _open(pptx_path)
    if prs is None:
        return 0.0
    return 1.0 if prs.slide_height > prs.slide_width else 0.0


def _iter_runs(prs: Any) -> Iterator[Any]:
    for slide in prs.slides:
        for shape in slide.shapes:
            if _has_text(shape):
                for p in shape.text_frame.paragraphs:
                    yield from p.runs


@never_raises
def check_strikethrough(pptx_path: str | None, rules: dict[str, Any]) -> float:
    """1.0 iff the listed paragraphs (first run) of the listed shapes are struck through.

    rules: {"slide_index_s": [int], "shape_index_s": [int], "paragraph_index_s": [int]}.
    """
    prs = _open(pptx_path)
    if prs is None or not rules:
        return 0.0
    for si in rules["slide_index_s"]:
        slide = prs.slides[si]
        for hi in rules["shape_index_s"]:
            shape = slide.shapes[hi]
            for pi in rules["paragraph_index_s"]:
                # upstream looks at the paragraph's first run only
                if _strike(shape.text_frame.paragraphs[pi].runs[0]) == "noStrike":
                    return 0.0
    return 1.0


@never_raises
def check_transition(pptx_file: str | None, rules: dict[str, Any]) -> float:
    """1.0 iff slide ``rules["slide_idx"]`` has a ``<p:transition>`` whose child is
    ``<p:{rules["transition_type"]}>`` (e.g. "dissolve")."""
    prs = _open(pptx_file)
    if prs is None or not rules:
        return 0.0
    try:
        slide = prs.slides[int(rules["slide_idx"])]
    except (IndexError, KeyError, ValueError, TypeError):
        return 0.0
    p = "{http://schemas.openxmlformats.org/presentationml/2006/main}"
    root = ET.fromstring(slide.part.blob)
    for tr in root.iter(f"{p}transition"):
        if tr.find(f".//{p}{rules.get('transition_type', '')}") is not None:
            return 1.0
    return 0.0


# --- LibreOffice settings (registrymodifications.xcu) and the Impress UI -----------------------

_OOR = "{http://openoffice.org/2001/registry}"


def _registry_value(config_file: str | None, item_path: str, prop_name: str) -> str | None:
    """The text of ``<value>`` of ``prop_name`` under the last ``<item oor:path=item_path>``
    (LibreOffice appends changed settings; the last entry is the one in force)."""
    if not config_file or not os.path.isfile(config_file):
        return None
    found = None
    for item in ET.parse(config_file).getroot().iter("item"):
        if item.get(f"{_OOR}path") != item_path:
            continue
        for prop in item.iter("prop"):
            if prop.get(f"{_OOR}name") == prop_name:
                value = prop.find("value")
                found = value.text if value is not None else None
    return found


@never_raises
def check_presenter_console_disable(config_file_path: str | None) -> float:
    """1.0 iff the LibreOffice user profile turns Impress's presenter console off
    (``/org.openoffice.Office.Impress/Misc/Start`` ``EnablePresenterScreen`` = false)."""
    value = _registry_value(config_file_path, "/org.openoffice.Office.Impress/Misc/Start", "EnablePresenterScreen")
    return 1.0 if value is not None and value.strip().lower() == "false" else 0.0


@never_raises
def check_auto_saving_time(pptx_file: str | None, rules: dict[str, Any]) -> float:
    """1.0 iff the profile's AutoRecovery interval is ``rules["minutes"]``. Despite the name,
    ``pptx_file`` is ``registrymodifications.xcu`` (as in OSWorld's task)."""
    value = _registry_value(pptx_file, "/org.openoffice.Office.Common/Save/Document", "AutoSaveTimeIntervall")
    if value is None:
        return 0.0
    return 1.0 if int(value.strip()) == int(rules["minutes"]) else 0.0


@never_raises
def check_left_panel(accessibility_tree: str | None) -> float:
    """1.0 iff Impress's slide pane is open: the a11y tree has a ``document-frame`` named
    "Slides View" (the pane's document; it leaves the tree when the pane is closed)."""
    if not accessibility_tree:
        return 0.0
    root = ET.fromstring(accessibility_tree)
    return 1.0 if any(el.get("name") == "Slides View" for el in root.iter("document-frame")) else 0.0


def _fill_rgb(fill: Any) -> Any:
    """The solid RGB of a fill; None for theme colours and other fill types."""
    try:
        return fill.fore_color.rgb
    except (AttributeError, TypeError, ValueError):
        return None


def _slide_fill_distance(slide: Any, rgb: tuple[int, int, int], original: Any) -> float:
    """Normalised RGB distance of the slide's solid background to ``rgb``; 1.0 (the worst) when
    the background is not a solid colour or is still ``original``."""
    fill = slide.background.fill
    if fill.type == 5:  # no background of its own: the master's counts
        fill = slide.slide_layout.slide_master.background.fill
    if fill.type != 1:
        return 1.0
    got = _fill_rgb(fill)
    if got is None:
        return 1.0
    if original is not None and tuple(got) == tuple(original):
        return 1.0
    return math.dist(tuple(got), tuple(rgb)) / math.dist((0, 0, 0), (255, 255, 255))


@never_raises
def evaluate_presentation_fill_to_rgb_distance(pptx_file: str | None, rules: dict[str, Any]) -> float:
    """1 - the mean over slides of the background's distance to ``rules["rgb"]`` (a graded
    score, as OSWorld's); ``rules["original_rgb"]``, if given, counts as the worst distance."""
    prs = _open(pptx_file)
    if prs is None or not len(prs.slides):
        return 0.0
    rgb = tuple(rules["rgb"])
    original = rules.get("original_rgb")
    total = sum(_slide_fill_distance(slide, rgb, original) for slide in prs.slides)
    return max(0.0, 1.0 - total / len(prs.slides))


def _rgb_hex(value: str) -> tuple[int, int, int]:
    v = value.lstrip("#")
    return int(v[0:2], 16), int(v[2:4], 16), int(v[4:6], 16)


_COLOR_TESTS: dict[str, Callable[[int, int, int], bool]] = {
    # a channel dominates the other two by more than 50 (OSWorld's thresholds)
    "red": lambda r, g, b: r > g + 50 and r > b + 50,
    "green": lambda r, g, b: g > r + 50 and g > b + 50,
    "blue": lambda r, g, b: b > r + 50 and b > g + 50,
    "black": lambda r, g, b: r < 50 and g < 50 and b < 50,
}


@never_raises
def check_page_number_colors(pptx_file: str | None, rules: dict[str, Any]) -> float:
    """1.0 iff the slide number colour of the first slide master is ``rules["color"]`` (red,
    green, blue or black; another name always passes, as in OSWorld).

    The colour read is the second-to-last ``a:srgbClr`` of a solid fill in
    ``slideMaster1.xml``, OSWorld's rule: LibreOffice writes the slide-number placeholder last,
    and in it the ``slidenum`` field's run colour comes right before the paragraph-end colour.
    Unlike OSWorld, the hex value is parsed from its first character (OSWorld skips one, as
    if it began with "#").
    """
    if not pptx_file or not os.path.isfile(pptx_file):
        return 0.0
    with zipfile.ZipFile(pptx_file) as zf:
        root = ET.fromstring(zf.read("ppt/slideMasters/slideMaster1.xml"))
    colors = [c.get("val") for fill in root.iter(f"{_A}solidFill") for c in fill.iter(f"{_A}srgbClr")]
    if len(colors) < 2 or not colors[-2]:
        return 0.0
    test = _COLOR_TESTS.get(rules["color"])
    return 1.0 if test is None or test(*_rgb_hex(colors[-2])) else 0.0


METRICS: dict[str, Callable[..., float]] = {
    "check_presenter_console_disable": check_presenter_console_disable,
    "check_auto_saving_time": check_auto_saving_time,
    "check_left_panel": check_left_panel,
    "evaluate_presentation_fill_to_rgb_distance": evaluate_presentation_fill_to_rgb_distance,
    "check_page_number_colors": check_page_number_colors,
    "check_transition": check_transition,
    "compare_pptx_files": compare_pptx_files,
    "check_image_stretch_and_center": check_image_stretch_and_center,
    "check_slide_orientation_Portrait": check_slide_orientation_Portrait,
    "check_strikethrough": check_strikethrough,
}
