#!/usr/bin/env python3
"""Generated stand-ins for every file the OSWorld tasks in ../shared/osworld/tasks download.

OSWorld fetches its inputs and gold files from a Hugging Face dataset; an offline farm never
does. This module writes equivalents (same file names and formats, content made for the task
and its evaluator) into an osfarm offline cache:

    <cache>/<task_id>/<file name from the URL>
    <cache>/url_map.json      every URL -> its file (the eval runner reads it from the cache root)

The map is what makes every URL resolve: a ``download`` step looks under the name of its
destination path (the GIMP task saves ``berry.jpeg`` as ``berry.png``) and the Thunderbird task
downloads a profile published under another task's id.

    python generate.py DIR        # writes DIR/cache (used by tests/test_osworld_tasks.py)
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

HF = "https://huggingface.co/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main"

CALC = "1273e544-688f-496b-8d89-3e0f40aa0606"
IMPRESS = "73c99fb9-f828-43ce-b87a-01dc07faa224"
WRITER = "0b17a146-2934-46c7-8727-73ff6b6483e8"
GIMP = "72f83cdc-bf76-4531-9a1b-eb893a13f8aa"
THUNDERBIRD = "a10b69e1-6034-4a2b-93e1-571d45194f75"
THUNDERBIRD_PROFILE_TASK = "dd84e895-72fd-4023-a336-97689ded257c"  # the task that published the profile

# ---------------------------------------------------------------------------------- calc

NET_INCOME = [
    ("Year", "Revenue", "Expenses", "Net Income"),
    (2013, 182500, 141200, 41300),
    (2014, 195300, 150900, 44400),
    (2015, 201800, 163400, 38400),
    (2016, 224600, 171050, 53550),
    (2017, 238900, 180300, 58600),
    (2018, 251200, 199800, 51400),
    (2019, 266750, 205100, 61650),
    (2020, 243100, 197600, 45500),
    (2021, 279400, 214300, 65100),
    (2022, 301250, 228900, 72350),
]


def net_income(path: Path) -> None:
    import openpyxl

    wb = openpyxl.Workbook()
    ws = wb.active
    ws.title = "Sheet1"
    for row in NET_INCOME:
        ws.append(row)
    wb.save(path)


def net_income_gold(path: Path) -> None:
    """Sheet1 unchanged, and Sheet2 holding the Revenue column (header included) from A1."""
    import openpyxl

    wb = openpyxl.Workbook()
    ws = wb.active
    ws.title = "Sheet1"
    for row in NET_INCOME:
        ws.append(row)
    ws2 = wb.create_sheet("Sheet2")
    for row in NET_INCOME:
        ws2.append([row[1]])
    wb.save(path)


# ---------------------------------------------------------------------------------- impress

SLIDES = [
    ("Emergent Abilities of Language Agents", "Reading group, week 4"),
    ("Motivation", None),  # the content placeholder the task fills
    ("Method", "Plan with a world model\nAct, observe, reflect\nRevise the plan"),
]


def _deck(path: Path, slide2_text: str | None) -> None:
    """Text attributes are explicit, as in a deck LibreOffice saved (OSWorld's decks are): Impress
    writes the effective font, size, alignment and bullet of every run it saves, so a gold deck that
    left them to the master would differ from any deck Impress wrote, solved or not."""
    from pptx import Presentation
    from pptx.dml.color import RGBColor
    from pptx.enum.text import PP_ALIGN
    from pptx.oxml.ns import qn
    from pptx.util import Pt

    def style(paragraph, size: int, bullet: bool) -> None:
        if bullet:
            ppr = paragraph._p.get_or_add_pPr()
            ppr.set("marL", "342900")
            ppr.set("indent", "-342900")
            ppr.append(ppr.makeelement(qn("a:buFont"), {"typeface": "Arial"}))
            ppr.append(ppr.makeelement(qn("a:buChar"), {"char": "\u2022"}))
        else:
            paragraph.alignment = PP_ALIGN.CENTER
        for run in paragraph.runs:
            run.font.name, run.font.size, run.font.bold = "Calibri", Pt(size), False

    prs = Presentation()
    master_bg = prs.slide_masters[0].background.fill
    master_bg.solid()
    master_bg.fore_color.rgb = RGBColor(0xFF, 0xFF, 0xFF)
    for i, (title, body) in enumerate(SLIDES):
        slide = prs.slides.add_slide(prs.slide_layouts[0 if i == 0 else 1])
        slide.shapes.title.text = title
        style(slide.shapes.title.text_frame.paragraphs[0], 44, bullet=False)
        text = slide2_text if i == 1 else body
        if text is not None:
            frame = slide.placeholders[1].text_frame
            frame.text = text
            for paragraph in frame.paragraphs:
                style(paragraph, 32, bullet=i > 0)
    prs.save(path)


def impress_input(path: Path) -> None:
    _deck(path, None)


def impress_gold(path: Path) -> None:
    _deck(path, "Page 1")


# ---------------------------------------------------------------------------------- writer

FACTS = [
    "Washington State Department of Health",
    ("Water is the most common substance on Earth and the only one found naturally as a solid, "
     "a liquid and a gas. Each molecule holds two hydrogen atoms bound to one oxygen atom."),
    ("Drinking water in Washington comes from wells, springs, rivers and lakes. Public water systems "
     "test it regularly for bacteria, nitrate and arsenic."),
    "If you use a private well, have it tested every year and after any flood.",
]


def _factsheet(path: Path, subscript: bool) -> None:
    import docx

    doc = docx.Document()
    title = doc.add_paragraph(style="Title")
    if subscript:
        title.add_run("H")
        title.add_run("2").font.subscript = True
        title.add_run("O Factsheet")
    else:
        title.add_run("H2O Factsheet")
    for text in FACTS:
        doc.add_paragraph(text)
    doc.save(path)


def writer_input(path: Path) -> None:
    _factsheet(path, subscript=False)


def writer_gold(path: Path) -> None:
    _factsheet(path, subscript=True)


# ---------------------------------------------------------------------------------- gimp


def berry(path: Path) -> None:
    """A JPEG photo-like picture of a berry, off centre so that a mirror image is clearly different."""
    from PIL import Image, ImageDraw, ImageFilter

    w, h = 640, 480
    img = Image.new("RGB", (w, h))
    px = img.load()
    for y in range(h):
        for x in range(w):
            px[x, y] = (235 - y // 6, 228 - x // 12, 200 + x // 20)
    d = ImageDraw.Draw(img)
    for cx, cy, r in ((230, 270, 62), (300, 250, 58), (265, 320, 60), (330, 315, 52), (205, 335, 45)):
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=(120, 16, 52), outline=(80, 8, 30), width=3)
        d.ellipse((cx - r // 3, cy - r // 2, cx, cy - r // 5), fill=(205, 120, 150))
    d.polygon([(300, 190), (430, 110), (520, 150), (380, 215)], fill=(48, 140, 40))
    d.line([(300, 200), (470, 135)], fill=(20, 90, 20), width=4)
    d.rectangle((40, 40, 150, 90), fill=(250, 240, 120))
    img = img.filter(ImageFilter.GaussianBlur(1.2))
    img.save(path, "JPEG", quality=92)


# ---------------------------------------------------------------------------------- thunderbird

PROFILE = "t5q2a5hp.default-release"

# Thunderbird keeps one default profile per installation, keyed by a hash of its install folder
# (this one is /usr/lib/thunderbird, where Debian and Ubuntu install it); without that section it
# ignores Default=1 and starts a fresh profile of its own.
INSTALL = "FDC34C9F024745EB"
PROFILES_INI = f"""[Profile0]
Name=default-release
IsRelative=1
Path={PROFILE}
Default=1

[General]
StartWithLastProfile=1
Version=2

[Install{INSTALL}]
Default={PROFILE}
Locked=1
"""
INSTALLS_INI = f"""[{INSTALL}]
Default={PROFILE}
Locked=1
"""

# A profile with its Local Folders and nothing that needs the network: no mail account to poll,
# no first-run pages or default-client prompt in the way of the task.
PREFS = {
    "mail.accountmanager.accounts": "account1",
    "mail.accountmanager.localfoldersserver": "server1",
    "mail.account.account1.server": "server1",
    "mail.server.server1.directory-rel": "[ProfD]Mail/Local Folders",
    "mail.server.server1.hostname": "Local Folders",
    "mail.server.server1.name": "Local Folders",
    "mail.server.server1.type": "none",
    "mail.server.server1.userName": "nobody",
    "mail.shell.checkDefaultClient": False,
    "mail.startup.enabledMailCheckOnce": True,
    "mailnews.start_page.enabled": False,
    "mailnews.start_page_override.mstone": "ignore",
    "mail.provider.enabled": False,
    "mail.rights.override": True,
    "mail.rights.version": 1,
    "mail.spotlight.firstRunDone": True,
    "mail.winsearch.firstRunDone": True,
    "datareporting.policy.dataSubmissionPolicyBypassNotification": True,
    "app.update.auto": False,
    "app.update.enabled": False,
    "browser.shell.checkDefaultBrowser": False,
}

INBOX = """From - Mon Mar 04 09:12:31 2024
From: Alice Chen <alice.chen@example.com>
To: user@example.com
Subject: Quarterly report draft
Date: Mon, 4 Mar 2024 09:12:31 +0000
Message-ID: <q1-report@example.com>
Content-Type: text/plain; charset=UTF-8

Hi, the draft of the quarterly report is ready for your comments.

From - Tue Mar 05 14:40:02 2024
From: Prof. Daniel Moore <d.moore@university.example.edu>
To: user@example.com
Subject: Seminar schedule
Date: Tue, 5 Mar 2024 14:40:02 +0000
Message-ID: <seminar@university.example.edu>
Content-Type: text/plain; charset=UTF-8

The seminar moves to Thursday at 3 pm, room 204.

"""


def _pref_value(v: object) -> str:
    return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")


def thunderbird_profile(path: Path) -> None:
    """``.thunderbird/`` with one profile, extracted by the task into /home/user."""
    prefs = "".join(f'user_pref("{k}", {_pref_value(v)});\n' for k, v in PREFS.items())
    files = {
        ".thunderbird/profiles.ini": PROFILES_INI,
        ".thunderbird/installs.ini": INSTALLS_INI,
        f".thunderbird/{PROFILE}/prefs.js": prefs,
        f".thunderbird/{PROFILE}/Mail/Local Folders/Inbox": INBOX,
        f".thunderbird/{PROFILE}/Mail/Local Folders/Trash": "",
        f".thunderbird/{PROFILE}/Mail/Local Folders/Unsent Messages": "",
    }
    now = time.time()
    with tarfile.open(path, "w:gz") as tar:
        dirs = sorted({str(Path(n).parent) for n in files} | {".thunderbird", f".thunderbird/{PROFILE}",
                                                                f".thunderbird/{PROFILE}/Mail"})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o700, now
            tar.addfile(info)
        for name, body in files.items():
            data = body.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, now
            tar.addfile(info, io.BytesIO(data))


# ---------------------------------------------------------------------------------- the cache

# (task id the file is cached under, URL, builder)
FILES: list[tuple[str, str, Callable[[Path], None]]] = [
    (CALC, f"{HF}/libreoffice_calc/{CALC}/NetIncome.xlsx", net_income),
    (CALC, f"{HF}/libreoffice_calc/{CALC}/3_NetIncome_gt1.xlsx", net_income_gold),
    (IMPRESS, f"{HF}/libreoffice_impress/{IMPRESS}/109_4.pptx", impress_input),
    (IMPRESS, f"{HF}/libreoffice_impress/{IMPRESS}/109_4_Gold.pptx", impress_gold),
    (WRITER, f"{HF}/libreoffice_writer/{WRITER}/H2O_Factsheet_WA.docx", writer_input),
    (WRITER, f"{HF}/libreoffice_writer/{WRITER}/H2O_Factsheet_WA_Gold.docx", writer_gold),
    (GIMP, f"{HF}/gimp/{GIMP}/berry.jpeg", berry),
    (THUNDERBIRD, f"{HF}/thunderbird/{THUNDERBIRD_PROFILE_TASK}/thunderbird-profile.tar.gz", thunderbird_profile),
]


def build_cache(cache: Path) -> dict[str, str]:
    """Write every file and ``url_map.json`` under ``cache``; returns the map (url -> relative path)."""
    url_map: dict[str, str] = {}
    for task_id, url, make in FILES:
        rel = f"{task_id}/{url.rsplit('/', 1)[1]}"
        dest = cache / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        make(dest)
        url_map[url] = rel
    (cache / "url_map.json").write_text(json.dumps(url_map, indent=1) + "\n")
    return url_map


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1]) / "cache"
    for url, rel in build_cache(out).items():
        print(f"{out / rel}  <-  {url}")
