"""libreoffice_writer: edits of .docx files made in Writer and saved in Word format.

Inputs and golds are written with python-docx. The metrics compare what survives a Writer
round-trip (paragraph texts, direct paragraph and run properties that Writer writes back); where
a gold takes part, it differs from its input only in the property the task asks for.
"""
from docx import Document
from suitekit import (
    DONE,
    SAVE_KEEP_FORMAT,
    at,
    await_window,
    gold,
    hotkey,
    office_doc,
    pause,
    press,
    rule,
    saved_after_mark,
    type_text,
    vm_file,
)

CENTER = "0f5d2a10-0000-4000-8000-000000000201"
SPACING = "0f5d2a10-0000-4000-8000-000000000202"
SUBSCRIPT = "0f5d2a10-0000-4000-8000-000000000203"
STRIKE = "0f5d2a10-0000-4000-8000-000000000204"
ITALIC14 = "0f5d2a10-0000-4000-8000-000000000205"
PAGENUM = "0f5d2a10-0000-4000-8000-000000000206"
REPLACE = "0f5d2a10-0000-4000-8000-000000000207"
PAGEBREAK = "0f5d2a10-0000-4000-8000-000000000208"
INFEASIBLE = "0f5d2a10-0000-4000-8000-000000000904"

APP = ["libreoffice_writer"]
# Writer at 1920x1080, maximised: the font-size box of the Formatting toolbar, and in the
# Find and Replace dialog (Ctrl+H) its Replace field and Replace All button.
FONT_SIZE_BOX = at((514, 103), (610, 147))
REPLACE_FIELD = at((982, 444), (1010, 496))
REPLACE_ALL = at((1225, 498), (1266, 550))


def menu(key: str, *moves: list[str]) -> list[str]:
    """One step: Alt+key opens a menu, each of ``moves`` (key presses) then runs once the menu
    or submenu it acts on has popped up."""
    step = hotkey("alt", key)
    for m in moves:
        step += pause() + m
    return step


def write_docx(kit, tid: str, name: str, paragraphs: list) -> None:
    """paragraphs: each a list of runs, a run being text or (text, {python-docx font attrs});
    a dict item in the list sets paragraph_format attributes (alignment, line_spacing)."""
    doc = Document()
    for spec in paragraphs:
        p = doc.add_paragraph()
        for item in spec:
            if isinstance(item, dict):
                for attr, value in item.items():
                    setattr(p.paragraph_format, attr, value)
                continue
            text, props = (item, {}) if isinstance(item, str) else item
            run = p.add_run(text)
            for attr, value in props.items():
                setattr(run.font, attr, value)
    doc.save(kit.path(tid, name))


def writer_task(kit, tid: str, name: str, instruction: str, paragraphs: list, steps: list, evaluator: dict,
                gold_paragraphs: list | None = None) -> None:
    """A task on /home/user/<name>: the input from ``paragraphs``, a gold (<stem>_gold.docx) from
    ``gold_paragraphs`` when given; ``evaluator`` gets the save-wait postconfig added."""
    write_docx(kit, tid, name, paragraphs)
    if gold_paragraphs is not None:
        write_docx(kit, tid, name.replace(".docx", "_gold.docx"), gold_paragraphs)
    path = f"/home/user/{name}"
    kit.task("libreoffice_writer", tid, instruction, office_doc(tid, name),
             {"postconfig": [saved_after_mark(tid, path)], **evaluator}, steps + SAVE_KEEP_FORMAT + [DONE], APP)


def heading(text: str) -> list:
    return [(text, {"bold": True})]


def build(kit) -> None:
    news = [heading("Community Garden Newsletter"),
            ["Spring planting day is on Saturday, 12 April. Volunteers meet at the north gate at nine."],
            ["Bring gloves and a water bottle; seedlings and tools are provided by the garden committee."],
            ["The compost workshop moves to the first Sunday of each month."]]
    writer_task(kit, CENTER, "newsletter.docx",
                "Center the heading at the top of newsletter.docx and save the document, keeping the Word format.",
                news, [hotkey("ctrl", "home"), hotkey("ctrl", "e")],
                {"func": "is_first_line_centered", "result": vm_file("/home/user/newsletter.docx")})

    essay = ["Cities are planting more trees along their streets than ever before.",
             "Shade from a mature tree can cool the pavement beneath it by several degrees in summer.",
             "Trees also catch rainwater, which eases the load on storm drains during heavy showers.",
             "Finally, residents report that tree-lined streets feel calmer and safer to walk along."]
    writer_task(kit, SPACING, "essay.docx",
                "Make the first two paragraphs of essay.docx double-spaced (line spacing 2) and save it as a Word "
                "document.",
                [[{"line_spacing": 1.0}, t] for t in essay],
                [hotkey("ctrl", "home"), hotkey("ctrl", "shift", "down") + hotkey("ctrl", "shift", "down"),
                 # Format > Spacing > Line Spacing: 2
                 menu("o", press("down") + press("right"), press("down", 3) + press("enter"))],
                {"func": "compare_line_spacing", "result": vm_file("/home/user/essay.docx"),
                 "expected": gold(SPACING, "essay_gold.docx")},
                [[{"line_spacing": 2.0 if i < 2 else 1.0}, t] for i, t in enumerate(essay)])

    h2o = "Water (H2O) is a molecule made of two hydrogen atoms and one oxygen atom."
    cut = h2o.index("2")
    water = [heading("Water Facts"), [h2o], ["It covers about 71 percent of the surface of the Earth."]]
    writer_task(kit, SUBSCRIPT, "water.docx",
                'In water.docx, make the "2" in "H2O" a subscript, then save the file in Word format.',
                water,
                [hotkey("ctrl", "home"), hotkey("ctrl", "down"), press("right", cut), hotkey("shift", "right"),
                 hotkey("ctrl", "shift", "b")],
                {"func": ["compare_docx_files", "compare_subscript_contains"], "conj": "and",
                 "result": [vm_file("/home/user/water.docx")] * 2,
                 "expected": [gold(SUBSCRIPT, "water_gold.docx")] * 2},
                [water[0], [h2o[:cut], ("2", {"subscript": True}), h2o[cut + 1:]], water[2]])

    outline = [heading("Course Outline: Introduction to Botany"),
               ["Week 1: plant cells and tissues."],
               ["Week 2: photosynthesis and respiration."],
               ["Week 3: roots, stems and leaves."],
               ["Week 4: a second look at plant cells, photosynthesis, roots, stems and leaves."]]
    writer_task(kit, STRIKE, "outline.docx",
                "The last paragraph of outline.docx only repeats the others: strike it through (do not delete it) "
                "and save the document in Word format.",
                outline,
                [hotkey("ctrl", "end"), hotkey("ctrl", "shift", "up"),
                 # Format > Text > Strikethrough
                 menu("o", press("right"), press("down", 4) + press("enter"))],
                {"func": "evaluate_strike_through_last_paragraph", "result": vm_file("/home/user/outline.docx"),
                 "expected": gold(STRIKE, "outline_gold.docx")},
                outline)

    lead = "We meet in the library on Thursday at six. "
    reading = [heading("Reading Group, March"),
               [lead, ("Please finish the first half of the book before then.", {"italic": True})],
               ["New members are always welcome; just bring a copy of the book."]]
    writer_task(kit, ITALIC14, "reading.docx",
                "Italic text in reading.docx is hard for me to tell apart: make all italic text 14 pt (leave the rest "
                "as it is) and save the file in Word format.",
                reading,
                [hotkey("ctrl", "home"), hotkey("ctrl", "down"), press("right", len(lead)),
                 hotkey("ctrl", "shift", "down"),
                 # a triple click does not always select the whole "11 pt": select it with Ctrl+A
                 [f"pyautogui.click({FONT_SIZE_BOX})"], hotkey("ctrl", "a") + type_text("14\n")],
                {"func": "check_italic_font_size_14", "result": vm_file("/home/user/reading.docx"),
                 "expected": gold(ITALIC14, "reading_gold.docx")},
                reading)

    report = [heading("Volunteer Hours Report")] + [
        [f"{month}: volunteers worked {hours} hours, mostly on weeding and watering."]
        for month, hours in (("January", 42), ("February", 38), ("March", 65), ("April", 120))]
    writer_task(kit, PAGENUM, "report.docx",
                "Add page numbers at the bottom of every page of report.docx and save it as a Word document.",
                report,
                # Insert > Header and Footer > Footer > Default Page Style (the cursor moves into the
                # footer), then Insert > Page Number
                [menu("i", press("up", 3) + press("right"), press("down") + press("right"), press("enter")),
                 menu("i", press("up", 5) + press("enter"))],
                {"func": "has_page_numbers_in_footers", "result": vm_file("/home/user/report.docx")})

    memo = [heading("Memo: Team Planning"),
            ["The planning meeting moves to Room 4 on Tuesday."],
            ["Please send agenda items before the meeting starts."],
            ["Notes from the meeting will be shared by Friday."]]
    writer_task(kit, REPLACE, "memo.docx",
                'In memo.docx, replace every "meeting" with "workshop" and save the file in Word format.',
                memo,
                [hotkey("ctrl", "h"), await_window("Find and Replace") + type_text("meeting"),
                 [f"pyautogui.click({REPLACE_FIELD})"] + type_text("workshop"),
                 [f"pyautogui.click({REPLACE_ALL})"], press("escape")],
                {"func": "compare_docx_files", "result": vm_file("/home/user/memo.docx"),
                 "expected": gold(REPLACE, "memo_gold.docx")},
                [[t.replace("meeting", "workshop") if isinstance(t, str) else t for t in p] for p in memo])

    letter = [["Dear Ms. Rivera,"],
              ["Thank you for hosting our class at the botanical garden last week."],
              ["The students especially enjoyed the greenhouse tour."],
              ["Kind regards,"], ["Sam Patel"],
              ["P.S. A few photos from the visit follow on the next page."]]
    writer_task(kit, PAGEBREAK, "letter.docx",
                'In letter.docx, insert a page break so that the paragraph starting with "P.S." begins on a new page, '
                "then save the file in Word format.",
                letter, [hotkey("ctrl", "end"), press("home"), hotkey("ctrl", "enter")],
                {"func": ["compare_docx_files", "contains_page_break"], "conj": "and",
                 "result": [vm_file("/home/user/letter.docx")] * 2,
                 "expected": [gold(PAGEBREAK, "letter_gold.docx"), rule(page_break_count=1)]},
                letter)

    kit.infeasible("libreoffice_writer", INFEASIBLE,
                   "Turn on LibreOffice Writer's built-in voice dictation so that I can speak my letter instead of "
                   "typing it.")
