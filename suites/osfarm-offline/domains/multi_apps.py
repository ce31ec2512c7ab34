"""multi_apps: tasks that carry data from one app to another (terminal, LibreOffice Calc,
Mousepad, Chromium)."""
from __future__ import annotations

import openpyxl
from suitekit import (
    DONE,
    TERM,
    activate,
    at,
    await_window,
    chrome,
    cmdline,
    dl,
    execute,
    gold,
    hotkey,
    launch,
    office_doc,
    poll,
    press,
    rule,
    saved_after_mark,
    type_text,
    typed,
    vm_file,
    wait_window,
)

CSV2XLSX = "0f5d2a10-0000-4000-8000-000000000801"
PASTE = "0f5d2a10-0000-4000-8000-000000000802"
PAGE2FILE = "0f5d2a10-0000-4000-8000-000000000803"
CSV_COUNT = "0f5d2a10-0000-4000-8000-000000000804"
PDF_VIEW = "0f5d2a10-0000-4000-8000-000000000805"
D = "/home/user/Desktop"

# The 1920x1080 screen. Light desktop: tint2's task buttons, in the order the windows were opened.
# GNOME: the dock's icons (Chrome and Calc are favourites; xfce4-terminal, not one, comes after them).
CALC_WINDOW = at((100, 1064), (34, 404))   # the first window opened: Calc, or Chromium in PDF_VIEW
CHROME_WINDOW = at((100, 1064), (34, 66))
TERMINAL_WINDOW = at((300, 1064), (34, 746))  # the second window opened
EXPORT_PDF = at((163, 66), (234, 108))        # Calc's "Export Directly as PDF" toolbar button

GRADES = [("student", "math", "physics"), ("Ana", 91, 78), ("Ben", 64, 82), ("Chloe", 88, 95), ("Dev", 72, 69)]
INVENTORY = [("item", "category", "stock"), ("stapler", "office", 12), ("toner", "printing", 0),
             ("paper clips", "office", 250), ("label tape", "printing", 0), ("whiteboard marker", "office", 0),
             ("envelopes", "mail", 40)]
REPORT = [("Month", "Visitors", "Signups"), ("January", 1200, 48), ("February", 1350, 52), ("March", 1610, 71)]


def click(point: str) -> list[str]:
    """``point``: the arguments :func:`suitekit.at` makes."""
    return [f"pyautogui.click({point})"]


def until_window(action: str, pattern: str, present: bool = True, tries: int = 3) -> list[str]:
    """One step: an action (one line of pyautogui code) that opens a window titled like grep -i
    pattern (or with present=False closes it), done again if that did not happen within 5 s:
    LibreOffice can drop a key or click that comes while it is still busy with a document or
    a dialog it has just mapped, and a person would notice and retry."""
    cond = f"wmctrl -l | grep -qi -- {pattern!r}"
    if not present:
        cond = f"! {{ {cond}; }}"
    code = ("import subprocess\n"
            f"for _ in range({tries}):\n"
            f"    {action}\n"
            "    for _ in range(50):\n"
            f"        if subprocess.run({cond!r}, shell=True).returncode == 0:\n"
            "            break\n"
            "        time.sleep(0.1)\n"
            "    else:\n"
            "        continue\n"
            "    break")
    return [code]


def click_for_window(point: str, pattern: str) -> list[str]:
    return [f"pyautogui.moveTo({point})", "time.sleep(0.3)"] + until_window(f"pyautogui.click({point})", pattern)


SAVE_AS = "pyautogui.hotkey('ctrl', 'shift', 's')"
ENTER = "pyautogui.press('enter')"


def xlsx(kit, tid: str, name: str, rows, sheet: str = "Sheet1") -> None:
    wb = openpyxl.Workbook()
    ws = wb.active
    ws.title = sheet
    for r in rows:
        ws.append(list(r))
    wb.save(kit.path(tid, name))


def csv(rows) -> str:
    return "".join(",".join(str(v) for v in r) + "\n" for r in rows)


def build(kit) -> None:
    # Terminal -> Calc: LibreOffice started from the shell, then Save As with an .xlsx name
    # (the file type follows the extension; Enter keeps the Excel format).
    kit.text(CSV2XLSX, "grades.csv", csv(GRADES))
    xlsx(kit, CSV2XLSX, "grades_gold.xlsx", GRADES, sheet="grades")  # Calc names the sheet after the CSV
    kit.task("multi_apps", CSV2XLSX,
             "From the terminal, open ~/Desktop/grades.csv in LibreOffice Calc, then use Calc to save it as an "
             "Excel workbook ~/Desktop/grades.xlsx.",
             [dl(CSV2XLSX, "grades.csv", f"{D}/grades.csv")] + TERM,
             {"postconfig": [execute(poll(f"[ -s {D}/grades.xlsx ]", 60) + "sleep 1")],
              "func": "compare_table", "result": vm_file(f"{D}/grades.xlsx"),
              "expected": gold(CSV2XLSX, "grades_gold.xlsx")},
             [typed("libreoffice --calc ~/Desktop/grades.csv") + await_window("Text Import", n=300),
              until_window(ENTER, "grades.csv - LibreOffice"),                     # import with the defaults
              until_window(SAVE_AS, " Save$"),
              type_text("grades.xlsx\n") + await_window("Confirm File Format"),
              until_window(ENTER, "Confirm File Format", present=False), DONE],   # Use Excel 2007-365!
             ["terminal", "libreoffice_calc"])

    # Mousepad -> Calc through the clipboard.
    quote = "Simplicity is the soul of efficiency."
    kit.text(PASTE, "quote.txt", quote + "\n")
    quotes = [("Quote", "Author"), (None, "Austin Freeman")]
    xlsx(kit, PASTE, "quotes.xlsx", quotes)
    xlsx(kit, PASTE, "quotes_gold.xlsx", [("Quote", "Author"), (quote, "Austin Freeman")])
    kit.task("multi_apps", PASTE,
             "Copy the sentence in quote.txt (open in Mousepad) into cell A2 of quotes.xlsx (open in LibreOffice "
             "Calc) and save the workbook, keeping its xlsx format.",
             office_doc(PASTE, "quotes.xlsx", f"{D}/quotes.xlsx")
             + [dl(PASTE, "quote.txt", f"{D}/quote.txt"), launch("mousepad", f"{D}/quote.txt"),
                wait_window("quote.txt"), activate("quote.txt")],
             {"postconfig": [saved_after_mark(PASTE, f"{D}/quotes.xlsx")],
              "func": "compare_table", "result": vm_file(f"{D}/quotes.xlsx"),
              "expected": gold(PASTE, "quotes_gold.xlsx")},
             [hotkey("ctrl", "a") + hotkey("ctrl", "c"),
              click(CALC_WINDOW) + ["time.sleep(0.5)"],                               # back to Calc
              hotkey("ctrl", "home") + press("down"), hotkey("ctrl", "v"),         # A2
              until_window("pyautogui.hotkey('ctrl', 's')", "Confirm File Format"),
              until_window(ENTER, "Confirm File Format", present=False), DONE],
             ["mousepad", "libreoffice_calc"])

    # Chromium -> terminal: a value read on a page, written to a file.
    kit.text(PAGE2FILE, "parcel.html",
             "<!doctype html><html><head><title>Parcel status</title></head><body><h1>Your parcel is on its way</h1>"
             "<p>Carrier: Northwind Express</p><p>Tracking number: <b>NW-58213-QZ</b></p>"
             "<p>Expected delivery: Thursday</p></body></html>\n")
    kit.task("multi_apps", PAGE2FILE,
             "The page open in the browser shows a parcel tracking number. Write just that tracking number into a "
             "new file ~/Desktop/tracking.txt.",
             [dl(PAGE2FILE, "parcel.html", f"{D}/parcel.html")] + chrome(f"file://{D}/parcel.html") + TERM,
             {"func": "exact_match",
              "result": cmdline(poll(f"[ -s {D}/tracking.txt ]") + f"tr -d ' \\n' < {D}/tracking.txt"),
              "expected": rule(expected="NW-58213-QZ")},
             [typed("echo NW-58213-QZ > ~/Desktop/tracking.txt"), DONE], ["chrome", "terminal"])

    # Calc -> terminal: a CSV export, then counted in the shell.
    xlsx(kit, CSV_COUNT, "inventory.xlsx", INVENTORY)
    kit.text(CSV_COUNT, "inventory_gold.csv", csv(INVENTORY))
    zero = sum(1 for r in INVENTORY[1:] if r[2] == 0)
    kit.task("multi_apps", CSV_COUNT,
             "Save inventory.xlsx (open in LibreOffice Calc) as a comma-separated file ~/Desktop/inventory.csv, then "
             "use the terminal to write the number of items with a stock of 0 into ~/Desktop/out_of_stock.txt.",
             office_doc(CSV_COUNT, "inventory.xlsx", f"{D}/inventory.xlsx") + TERM,
             {"postconfig": [execute(poll(f"[ -s {D}/out_of_stock.txt ]") + "true")],
              "func": ["compare_csv", "exact_match"], "conj": "and",
              "result": [vm_file(f"{D}/inventory.csv"), cmdline(f"tr -d ' \\n' < {D}/out_of_stock.txt")],
              "expected": [gold(CSV_COUNT, "inventory_gold.csv"), rule(expected=str(zero))]},
             [click(CALC_WINDOW) + ["time.sleep(0.5)"],                               # to Calc
              until_window(SAVE_AS, " Save$"),
              type_text("inventory.csv\n") + await_window("Confirm File Format"),
              until_window(ENTER, "Export Text File"),                             # keep the CSV format
              until_window(ENTER, "Export Text File", present=False)              # default options: comma
              + await_window("inventory.csv - LibreOffice"),
              click(TERMINAL_WINDOW),                                               # to the terminal
              typed("awk -F, 'NR>1 && $3==0' ~/Desktop/inventory.csv | wc -l > ~/Desktop/out_of_stock.txt"),
              DONE], ["libreoffice_calc", "terminal"])

    # Calc -> Chromium: a PDF export, then viewed in the browser.
    xlsx(kit, PDF_VIEW, "report.xlsx", REPORT)
    pdf_url = f"file://{D}/report.pdf"
    kit.task("multi_apps", PDF_VIEW,
             "Export report.xlsx (open in LibreOffice Calc) to a PDF file ~/Desktop/report.pdf, then open that PDF "
             "in the browser.",
             chrome("about:blank") + office_doc(PDF_VIEW, "report.xlsx", f"{D}/report.xlsx"),
             {"postconfig": [execute(poll(f"[ -s {D}/report.pdf ]") + "sleep 1")],
              "func": ["check_pdf_pages", "is_expected_active_tab"], "conj": "and",
              "result": [vm_file(f"{D}/report.pdf"), {"type": "active_tab_info"}],
              "expected": [rule(relation="eq", ref_value=1), rule(type="url", url=pdf_url)]},
             [click_for_window(EXPORT_PDF, " Export$"),
              type_text("report.pdf\n") + await_window(" Export$", present=False),
              click(CHROME_WINDOW) + ["time.sleep(0.5)"],                             # to Chromium
              hotkey("ctrl", "l"), type_text(pdf_url + "\n"), DONE], ["libreoffice_calc", "chrome"])
