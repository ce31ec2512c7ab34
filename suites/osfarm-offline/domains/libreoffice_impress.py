"""libreoffice_impress: edits of .pptx decks made in Impress and saved in PowerPoint format.

Decks are written with python-pptx in the form Impress writes back: every run with an explicit
font and size, every paragraph with explicit alignment and bullet, a solid master background.
Impress then saves an unchanged slide so that compare_pptx_files (all its default checks) finds
it equal to its python-pptx source, and a gold differs from its input only where the task asks.
"""
from lxml import etree
from pptx import Presentation
from pptx.dml.color import RGBColor
from pptx.enum.text import PP_ALIGN
from pptx.util import Pt
from suitekit import (
    DONE,
    SAVE_KEEP_FORMAT,
    await_office,
    await_window,
    gold,
    hotkey,
    office_doc,
    pause,
    press,
    saved_after_mark,
    type_text,
    vm_file,
)

RETITLE = "0f5d2a10-0000-4000-8000-000000000301"
NOTES = "0f5d2a10-0000-4000-8000-000000000302"
DELETE = "0f5d2a10-0000-4000-8000-000000000303"
BOLD = "0f5d2a10-0000-4000-8000-000000000304"
NEW_SLIDE = "0f5d2a10-0000-4000-8000-000000000305"
PORTRAIT = "0f5d2a10-0000-4000-8000-000000000306"
INFEASIBLE = "0f5d2a10-0000-4000-8000-000000000905"

APP = ["libreoffice_impress"]
_A = "{http://schemas.openxmlformats.org/drawingml/2006/main}"
LAYOUTS = {"title": 0, "content": 1, "title_only": 5}  # python-pptx's default template

# Impress at 1920x1080, maximised, 4:3 slides.
SLIDE_BLANK = (1300, 970)  # below every placeholder
# After loading, the keyboard focus can be in the slide pane, where Tab and Enter do not reach
# the slide's shapes: a click on a blank part of the slide moves it to the slide view.
FOCUS = [f"pyautogui.click{SLIDE_BLANK}"]
# Tab selects the slide's first shape (its title) and Enter starts editing its text with the
# cursor at the end; Impress starts editing asynchronously, so typing waits for the status bar's
# "TextEdit: Paragraph 1, ..." (typed sooner, keys go to the slide view).
EDIT_FIRST_SHAPE = [press("tab"), press("enter")]
EDITING = await_office("TextEdit")
LEAVE_TEXT = [press("escape"), press("escape")]


def slide_menu(item: int) -> list[str]:
    """Slide menu (Alt+S opens Slide Show, Left goes to its neighbour Slide), then the item
    that many Down presses below New Slide (disabled items are skipped)."""
    return hotkey("alt", "s") + pause() + press("left") + pause() + press("down", item) + press("enter")


def _style(text_frame, size: int, align=None, bullet: bool = False, bold: bool = False) -> None:
    for p in text_frame.paragraphs:
        if align is not None:
            p.alignment = align
        bu = etree.SubElement(p._p.get_or_add_pPr(), _A + ("buChar" if bullet else "buNone"))
        if bullet:
            bu.set("char", "\u2022")
        for r in p.runs:
            # bold written either way, as Impress writes it (b="0" for plain text)
            r.font.size, r.font.name, r.font.bold = Pt(size), "Calibri", bold


def slide(layout: str, title: str, body: tuple[str, ...] = (), notes: str = "", bold: bool = False) -> dict:
    return {"layout": layout, "title": title, "body": body, "notes": notes, "bold": bold}


def write_pptx(kit, tid: str, name: str, slides: list[dict]) -> None:
    prs = Presentation()
    fill = prs.slide_master.background.fill
    fill.solid()
    fill.fore_color.rgb = RGBColor(0xFF, 0xFF, 0xFF)
    for spec in slides:
        s = prs.slides.add_slide(prs.slide_layouts[LAYOUTS[spec["layout"]]])
        s.shapes.title.text = spec["title"]
        _style(s.shapes.title.text_frame, 44, PP_ALIGN.CENTER, bold=spec["bold"])
        if spec["layout"] == "title":
            s.placeholders[1].text = spec["body"][0]
            _style(s.placeholders[1].text_frame, 32, PP_ALIGN.CENTER)
        elif spec["layout"] == "content":
            tf = s.placeholders[1].text_frame
            tf.text = spec["body"][0]
            for line in spec["body"][1:]:
                tf.add_paragraph().text = line
            _style(tf, 32, bullet=True)
        if spec["notes"]:
            s.notes_slide.notes_text_frame.text = spec["notes"]
    prs.save(kit.path(tid, name))


def impress_task(kit, tid: str, name: str, instruction: str, slides: list[dict], steps: list,
                 gold_slides: list[dict] | None = None, evaluator: dict | None = None,
                 options: dict | None = None) -> None:
    """A task on /home/user/<name>; by default compare_pptx_files (with ``options``) against
    <stem>_gold.pptx."""
    write_pptx(kit, tid, name, slides)
    path = f"/home/user/{name}"
    if evaluator is None:
        gold_name = name.replace(".pptx", "_gold.pptx")
        write_pptx(kit, tid, gold_name, gold_slides or slides)
        evaluator = {"func": "compare_pptx_files", "result": vm_file(path), "expected": gold(tid, gold_name),
                     "options": options or {}}
    kit.task("libreoffice_impress", tid, instruction, office_doc(tid, name),
             {"postconfig": [saved_after_mark(tid, path)], **evaluator}, steps + SAVE_KEEP_FORMAT + [DONE], APP)


def build(kit) -> None:
    pitch = [slide("title", "Community Solar Project", ("Proposal to the town council",)),
             slide("content", "Agenda", ("Why solar", "Costs and savings", "Timeline")),
             slide("content", "Costs and savings", ("Panels: 48,000 dollars", "Savings: 6,500 dollars a year")),
             slide("title_only", "Thank you")]
    impress_task(kit, RETITLE, "pitch.pptx",
                 'In pitch.pptx, change the title of slide 2 from "Agenda" to "Outline" and save the file as pptx.',
                 pitch,
                 [FOCUS, press("pagedown"), await_office("Slide 2 of 4") + press("tab"), press("enter"),
                  EDITING + hotkey("shift", "home") + type_text("Outline")] + LEAVE_TEXT,
                 [pitch[0], slide("content", "Outline", pitch[1]["body"]), *pitch[2:]])

    review = [slide("title", "Quarterly Review", ("Sales team, third quarter",)),
              slide("content", "Highlights", ("Revenue up 12 percent", "Two new clients")),
              slide("title_only", "Questions")]
    note = "Welcome everyone and introduce the team"
    impress_task(kit, NOTES, "review.pptx",
                 f'Add the speaker note "{note}" to the first slide of review.pptx and save it, keeping the '
                 "PowerPoint format.",
                 review,
                 # View > Notes; on the notes page Tab selects the slide image, then the notes box
                 [FOCUS, hotkey("alt", "v") + pause() + press("down", 2) + press("enter"),
                  await_office("PresentationNotes") + press("tab") + press("tab"), press("enter"),
                  EDITING + type_text(note)] + LEAVE_TEXT,
                 [slide("title", review[0]["title"], review[0]["body"], notes=note), *review[1:]])

    plan = [slide("title", "Garden Expansion Plan", ("Spring planning meeting",)),
            slide("content", "Goals", ("Twenty new raised beds", "A second water tap")),
            slide("content", "Old Roadmap", ("Build a shed in 2019", "Fence repairs")),
            slide("content", "Budget", ("Beds: 3,000 dollars", "Tap: 800 dollars"))]
    impress_task(kit, DELETE, "plan.pptx",
                 'Delete the third slide ("Old Roadmap") from plan.pptx and save the presentation in pptx format.',
                 plan,
                 [FOCUS, press("pagedown"), press("pagedown"),
                  await_office("Slide 3 of 4") + slide_menu(4)],  # Slide > Delete Slide
                 [plan[0], plan[1], plan[3]])

    launch = [slide("title", "Product Launch", ("Marketing kickoff, May",)),
              slide("content", "Channels", ("Newsletter", "Local radio", "Farmers market stand"))]
    impress_task(kit, BOLD, "launch.pptx",
                 "Make the title on the first slide of launch.pptx bold and save the file in its current format.",
                 launch,
                 [FOCUS, *EDIT_FIRST_SHAPE, EDITING + hotkey("shift", "home") + hotkey("ctrl", "b")] + LEAVE_TEXT,
                 [slide("title", "Product Launch", launch[0]["body"], bold=True), launch[1]])

    talk = [slide("title", "Composting at Home", ("Evening talk at the library",)),
            slide("content", "What goes in", ("Vegetable scraps", "Coffee grounds", "Dry leaves")),
            slide("title_only", "Thank you")]
    impress_task(kit, NEW_SLIDE, "talk.pptx",
                 'Add a new slide at the end of talk.pptx with the title "Questions?" and save it as pptx.',
                 talk,
                 # End: the last slide; Ctrl+M inserts a slide after it with the same (title-only) layout
                 [FOCUS, press("end"), await_office("Slide 3 of 3") + hotkey("ctrl", "m"),
                  await_office("Slide 4 of 4") + press("tab"), press("enter"), EDITING + type_text("Questions?")]
                 + LEAVE_TEXT,
                 [*talk, slide("title_only", "Questions?")],
                 # Impress styles a slide it creates from its own defaults (a left-aligned 18 pt
                 # title), which the instruction leaves open: those two are not compared.
                 options={"examine_alignment": False, "examine_font_size": False})

    poster = [slide("title", "Summer Fair", ("Saturday 21 June, town square",)),
              slide("content", "Program", ("Music from noon", "Plant swap", "Pie contest"))]
    impress_task(kit, PORTRAIT, "poster.pptx",
                 "Set the slides of poster.pptx upright (portrait orientation) and save the file as pptx.",
                 # Slide > Slide Properties, Alt+P = Portrait, Enter = OK
                 poster, [FOCUS, slide_menu(6), await_window("Slide Properties") + hotkey("alt", "p"), press("enter")],
                 evaluator={"func": "check_slide_orientation_Portrait",
                            "result": vm_file("/home/user/poster.pptx")})

    kit.infeasible("libreoffice_impress", INFEASIBLE,
                   "Export this presentation from LibreOffice Impress as an MP4 video with my recorded voice "
                   "narration.")
