"""OSWorld metrics added to close the coverage of test_all (slides settings and colours, the
conference cities, PDF page images, the GIMP text box, the Steam cart, OCR), each scored on
files built in the test: one input that passes and one that fails."""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

import openpyxl
import pptx
import pytest
from PIL import Image, ImageDraw
from pptx.dml.color import RGBColor

from osfarm.evaluators.errors import UnsupportedOption
from osfarm.evaluators.metrics import METRICS
from osfarm.evaluators.metrics import chrome as chrome_m
from osfarm.evaluators.metrics import docs as docs_m
from osfarm.evaluators.metrics import gimp as gimp_m
from osfarm.evaluators.metrics import pdf as pdf_m
from osfarm.evaluators.metrics import slides as slides_m
from osfarm.evaluators.metrics import table as table_m
from osfarm.evaluators.scoring import score

NEW = ("compare_image_text", "check_auto_saving_time", "check_left_panel", "check_page_number_colors",
       "check_presenter_console_disable", "check_textbox_on_leftside", "compare_conference_city_in_order",
       "compare_pdf_images", "evaluate_presentation_fill_to_rgb_distance", "is_added_to_steam_cart")


def test_registered_under_osworld_names() -> None:
    for name in NEW:
        assert METRICS[name].__name__ == name


# ------------------------------------------------------------------- LibreOffice profile settings


def xcu(path: Path, items: list[tuple[str, str, str]]) -> str:
    """A registrymodifications.xcu with one <item> per (path, prop, value), as LibreOffice writes."""
    body = "".join(
        f'<item oor:path="{p}"><prop oor:name="{name}" oor:op="fuse"><value>{value}</value></prop></item>\n'
        for p, name, value in items
    )
    path.write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n<oor:items xmlns:oor="http://openoffice.org/2001/registry" '
        'xmlns:xs="http://www.w3.org/2001/XMLSchema" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">\n'
        f"{body}</oor:items>\n", encoding="utf-8")
    return str(path)


START = "/org.openoffice.Office.Impress/Misc/Start"
SAVE = "/org.openoffice.Office.Common/Save/Document"
OTHER = ("/org.openoffice.Office.Common/Misc", "FirstRun", "false")


def test_check_presenter_console_disable(tmp_path: Path) -> None:
    off = xcu(tmp_path / "off.xcu", [OTHER, (START, "EnablePresenterScreen", "false")])
    on = xcu(tmp_path / "on.xcu", [(START, "EnablePresenterScreen", "true")])
    unset = xcu(tmp_path / "unset.xcu", [OTHER])
    assert slides_m.check_presenter_console_disable(off) == 1.0
    assert slides_m.check_presenter_console_disable(on) == 0.0
    assert slides_m.check_presenter_console_disable(unset) == 0.0
    assert slides_m.check_presenter_console_disable(None) == 0.0


def test_check_auto_saving_time(tmp_path: Path) -> None:
    three = xcu(tmp_path / "3.xcu", [OTHER, (SAVE, "AutoSaveTimeIntervall", "3")])
    ten = xcu(tmp_path / "10.xcu", [(SAVE, "AutoSaveTimeIntervall", "10")])
    assert slides_m.check_auto_saving_time(three, {"minutes": 3}) == 1.0
    assert slides_m.check_auto_saving_time(ten, {"minutes": 3}) == 0.0
    assert slides_m.check_auto_saving_time(xcu(tmp_path / "u.xcu", [OTHER]), {"minutes": 3}) == 0.0
    junk = tmp_path / "junk.xcu"
    junk.write_text("<oor:items")
    assert slides_m.check_auto_saving_time(str(junk), {"minutes": 3}) == 0.0


def a11y_tree(*frames: str) -> str:
    docs = "".join(f'<document-frame name="{name}" st:showing="true"/>' for name in frames)
    return ('<desktop-frame xmlns:st="https://accessibility.ubuntu.example.org/ns/state">'
            f'<application name="soffice"><frame name="deck.pptx - LibreOffice Impress">{docs}</frame>'
            "</application></desktop-frame>")


def test_check_left_panel() -> None:
    assert slides_m.check_left_panel(a11y_tree("Slides View", "Edit View")) == 1.0
    assert slides_m.check_left_panel(a11y_tree("Edit View")) == 0.0
    assert slides_m.check_left_panel(None) == 0.0
    assert slides_m.check_left_panel("<not xml") == 0.0


# ------------------------------------------------------------------------------ slide colours


def deck(path: Path, backgrounds: list[tuple[int, int, int] | None]) -> str:
    prs = pptx.Presentation()
    for rgb in backgrounds:
        slide = prs.slides.add_slide(prs.slide_layouts[6])
        if rgb is not None:
            slide.background.fill.solid()
            slide.background.fill.fore_color.rgb = RGBColor(*rgb)
    prs.save(path)
    return str(path)


def test_evaluate_presentation_fill_to_rgb_distance(tmp_path: Path) -> None:
    blue = deck(tmp_path / "blue.pptx", [(0, 0, 255), (0, 0, 255)])
    near = deck(tmp_path / "near.pptx", [(0, 0, 255), (10, 10, 245)])
    red = deck(tmp_path / "red.pptx", [(255, 0, 0), (255, 0, 0)])
    rules = {"rgb": [0, 0, 255]}
    assert slides_m.evaluate_presentation_fill_to_rgb_distance(blue, rules) == 1.0
    assert 0.95 < slides_m.evaluate_presentation_fill_to_rgb_distance(near, rules) < 1.0
    assert slides_m.evaluate_presentation_fill_to_rgb_distance(red, rules) < 0.2
    # a slide still in its original colour, or with no background of its own, counts as the worst
    assert slides_m.evaluate_presentation_fill_to_rgb_distance(blue, {**rules, "original_rgb": [0, 0, 255]}) == 0.0
    assert slides_m.evaluate_presentation_fill_to_rgb_distance(deck(tmp_path / "p.pptx", [None]), rules) == 0.0
    assert slides_m.evaluate_presentation_fill_to_rgb_distance(None, rules) == 0.0


# LibreOffice's export puts the slide-number placeholder last in the master; its slidenum field
# run colour is followed by the paragraph-end colour (see check_page_number_colors).
SLDNUM = (
    '<p:sp><p:nvSpPr><p:cNvPr id="90" name="PlaceHolder 9"/><p:cNvSpPr/><p:nvPr><p:ph type="sldNum" idx="3"/>'
    "</p:nvPr></p:nvSpPr><p:spPr/><p:txBody><a:bodyPr/><a:lstStyle/><a:p>"
    '<a:fld id="{3334D23A-FE3E-4E87-8A9E-C8BB513C8AC3}" type="slidenum"><a:rPr lang="en-US">'
    '<a:solidFill><a:srgbClr val="{color}"/></a:solidFill></a:rPr><a:t>&lt;number&gt;</a:t></a:fld>'
    '<a:endParaRPr lang="en-US"><a:solidFill><a:srgbClr val="000000"/></a:solidFill></a:endParaRPr>'
    "</a:p></p:txBody></p:sp>"
)


def numbered_deck(path: Path, color: str) -> str:
    plain = deck(path.with_suffix(".plain.pptx"), [None])
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "ppt/slideMasters/slideMaster1.xml":
                data = data.replace(b"</p:spTree>", SLDNUM.replace("{color}", color).encode() + b"</p:spTree>", 1)
            dst.writestr(item, data)
    return str(path)


def test_check_page_number_colors(tmp_path: Path) -> None:
    red = numbered_deck(tmp_path / "red.pptx", "C9211E")
    grey = numbered_deck(tmp_path / "grey.pptx", "8B8B8B")
    assert pptx.Presentation(red).slides  # still a valid deck
    assert slides_m.check_page_number_colors(red, {"color": "red"}) == 1.0
    assert slides_m.check_page_number_colors(grey, {"color": "red"}) == 0.0
    assert slides_m.check_page_number_colors(numbered_deck(tmp_path / "b.pptx", "1C1CE0"), {"color": "blue"}) == 1.0
    assert slides_m.check_page_number_colors(numbered_deck(tmp_path / "k.pptx", "101010"), {"color": "black"}) == 1.0
    assert slides_m.check_page_number_colors(grey, {"color": "black"}) == 0.0
    assert slides_m.check_page_number_colors(None, {"color": "red"}) == 0.0


# ------------------------------------------------------------------------------ spreadsheet


CITIES = ["Scottsdale", "Atlanta", "Lake Tahoe", "Banff", "Beijing", ["Montreal", "Montréal"], "San Diego",
          "Lille", ["Montreal", "Montréal"], "San Juan", ["New York", "New York City", "NYC"], "Barcelona",
          "Toulon", "Sydney", "Long Beach", "Vancouver", "Stockholm", ["Montreal", "Montréal"], "New Orleans",
          "Long Beach", "Vancouver"]


def city_book(path: Path, cities: list[str]) -> str:
    wb = openpyxl.Workbook()
    ws = wb.active
    ws.append(["Conference", "Year", "City"])
    for i, city in enumerate(cities):
        ws.append([["ICML", "NeurIPS", "ICLR"][i % 3], 2013 + i // 3, city])
    wb.save(path)
    return str(path)


def test_compare_conference_city_in_order(tmp_path: Path) -> None:
    typed = [c if isinstance(c, str) else c[0] for c in CITIES]
    typed[5], typed[10], typed[0] = "MONTRÉAL, Canada", "New York City", "Scottsdale, AZ"
    good = city_book(tmp_path / "good.xlsx", typed)
    assert table_m.compare_conference_city_in_order(good, {"expected": CITIES}) == 1.0
    swapped = typed[:]
    swapped[1], swapped[2] = swapped[2], swapped[1]
    swapped_book = city_book(tmp_path / "sw.xlsx", swapped)
    assert table_m.compare_conference_city_in_order(swapped_book, {"expected": CITIES}) == 0.0
    short = city_book(tmp_path / "short.xlsx", typed[:-1])  # C22 left empty
    assert table_m.compare_conference_city_in_order(short, {"expected": CITIES}) == 0.0
    assert table_m.compare_conference_city_in_order(None, {"expected": CITIES}) == 0.0


# ------------------------------------------------------------------------------ images and PDFs


def text_box(path: Path, x: int) -> str:
    img = Image.new("RGB", (400, 200), "white")
    ImageDraw.Draw(img).rectangle([x, 80, x + 120, 100], fill=(20, 20, 20))
    img.save(path)
    return str(path)


def test_check_textbox_on_leftside(tmp_path: Path) -> None:
    assert gimp_m.check_textbox_on_leftside(text_box(tmp_path / "left.png", 8)) == 1.0
    assert gimp_m.check_textbox_on_leftside(text_box(tmp_path / "mid.png", 150)) == 0.0
    blank = tmp_path / "blank.png"
    Image.new("RGB", (400, 200), "white").save(blank)
    assert gimp_m.check_textbox_on_leftside(str(blank)) == 0.0
    assert gimp_m.check_textbox_on_leftside(None) == 0.0


def pdf(path: Path, colors: list[str]) -> str:
    pages = []
    for color in colors:
        img = Image.new("RGB", (300, 200), "white")
        ImageDraw.Draw(img).ellipse([40, 40, 160, 160], fill=color)
        pages.append(img)
    pages[0].save(path, save_all=True, append_images=pages[1:], resolution=72)
    return str(path)


def test_compare_pdf_images(tmp_path: Path) -> None:
    assert shutil.which("pdftoppm"), "poppler-utils is not installed (scripts/system-packages.txt lists it)"
    gold = pdf(tmp_path / "gold.pdf", ["red", "blue"])
    same = pdf(tmp_path / "same.pdf", ["red", "blue"])
    assert pdf_m.compare_pdf_images(same, gold) == 1.0
    assert pdf_m.compare_pdf_images(pdf(tmp_path / "other.pdf", ["red", "green"]), gold) == 0.0
    assert pdf_m.compare_pdf_images(pdf(tmp_path / "one.pdf", ["red"]), gold) == 0.0
    assert pdf_m.compare_pdf_images(None, gold) == 0.0
    junk = tmp_path / "junk.pdf"
    junk.write_bytes(b"%PDF-1.4 not really")
    assert pdf_m.compare_pdf_images(str(junk), gold) == 0.0


def test_compare_pdf_images_without_a_renderer_is_unsupported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gold = pdf(tmp_path / "gold.pdf", ["red"])
    monkeypatch.setattr(pdf_m.shutil, "which", lambda name: None)
    with pytest.raises(UnsupportedOption, match="pdftoppm"):
        pdf_m.compare_pdf_images(gold, gold)


# ------------------------------------------------------------------------------ web, OCR


def test_is_added_to_steam_cart() -> None:
    page = {"title": "Shopping Cart", "url": "https://store.example/cart/",
            "content": "<div class=cart_item>The Dota 2 Official Soundtrack</div><div>Dota 2 - Axe Arcana</div>"}
    assert chrome_m.is_added_to_steam_cart(page, {"items": ["The Dota 2 Official Soundtrack"]}) == 1.0
    assert chrome_m.is_added_to_steam_cart(page, {"items": ["The Dota 2 Official Soundtrack", "Portal 2"]}) == 0.0
    failed = {"title": "Connection failed", "url": "https://store.example/cart/", "content": ""}
    assert chrome_m.is_added_to_steam_cart(failed, {"items": ["Portal 2"]}) == 0.0
    assert chrome_m.is_added_to_steam_cart(None, {"items": ["Portal 2"]}) == 0.0


def test_compare_image_text_without_the_ocr_extra_is_unsupported_not_scored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (with the extra, tests/test_ocr.py reads real images)
    monkeypatch.setitem(sys.modules, "easyocr", None)  # as if osfarm[ocr] were not installed
    shot = text_box(tmp_path / "ls.png", 8)
    with pytest.raises(UnsupportedOption, match="EasyOCR"):
        docs_m.compare_image_text(shot, {"type": "text", "text": " Ls"})
    evaluator = {"func": "compare_image_text", "result": {"type": "vm_file"}, "expected": {"type": "rule"}}
    with pytest.raises(UnsupportedOption):
        score(evaluator, [shot], [{"type": "text", "text": " Ls"}], "DONE", METRICS)
