"""libreoffice_calc: formulas typed into an xlsx, a sort through the Sort dialog; saved as xlsx."""
from suitekit import (
    DONE,
    SAVE_KEEP_FORMAT,
    gold,
    hotkey,
    office_doc,
    press,
    saved_after_mark,
    type_text,
    vm_file,
    wait_window_code,
)

SUM = "0f5d2a10-0000-4000-8000-000000000101"
PRODUCT = "0f5d2a10-0000-4000-8000-000000000102"
AVG = "0f5d2a10-0000-4000-8000-000000000103"
MAX = "0f5d2a10-0000-4000-8000-000000000104"
SORT = "0f5d2a10-0000-4000-8000-000000000105"

SALES = [("Region", "Units", "Price"), ("North", 12, 3.5), ("South", 7, 4.0), ("East", 20, 2.25),
         ("West", 15, 5.0), ("Central", 9, 6.5)]
def goto(cell: str) -> list[list[str]]:
    """Steps that put the cell cursor on ``cell`` from the keyboard (Ctrl+Home, then arrows):
    unlike a click into the Name Box, this cannot land in the wrong widget under load."""
    col = ord(cell[0].upper()) - ord("A")
    row = int(cell[1:]) - 1
    moves = ([f"pyautogui.press('right', presses={col})"] if col else []) + \
            ([f"pyautogui.press('down', presses={row})"] if row else [])
    return [hotkey("ctrl", "home") + moves]


def calc_task(kit, tid: str, name: str, instruction: str, steps: list, gold_extra=None, gold_rows=None) -> None:
    kit.xlsx(tid, name, SALES)
    gold_name = name.replace(".xlsx", "_gold.xlsx")
    kit.xlsx(tid, gold_name, gold_rows or SALES, gold_extra)
    path = f"/home/user/{name}"
    kit.task("libreoffice_calc", tid, instruction, office_doc(tid, name),
             {"postconfig": [saved_after_mark(tid, path)], "func": "compare_table",
              "result": vm_file(path), "expected": gold(tid, gold_name)},
             steps + SAVE_KEEP_FORMAT + [DONE], ["libreoffice_calc"])


def build(kit) -> None:
    calc_task(kit, SUM, "sales.xlsx",
              "In sales.xlsx, put the total of the Units column in cell B7 (just below the data) and save the file, "
              "keeping its format.",
              goto("B7") + [type_text("=SUM(B2:B6)\n")], {"B7": sum(r[1] for r in SALES[1:])})
    calc_task(kit, PRODUCT, "revenue.xlsx",
              "Add a column D titled \"Revenue\" holding Units times Price for every region of revenue.xlsx, then "
              "save it in its current format.",
              goto("D1") + [type_text("Revenue\n")
                            + [f"pyautogui.write('=B{r}*C{r}\\n', interval=0.01)" for r in range(2, 7)]],
              gold_rows=[r + (("Revenue",) if i == 0 else (r[1] * r[2],)) for i, r in enumerate(SALES)])
    calc_task(kit, AVG, "prices.xlsx",
              "In prices.xlsx, write the average Price of the five regions into cell C7 and save the file (keep the "
              "xlsx format).",
              goto("C7") + [type_text("=AVERAGE(C2:C6)\n")], {"C7": sum(r[2] for r in SALES[1:]) / 5})
    calc_task(kit, MAX, "units.xlsx",
              "In units.xlsx, put the largest value of the Units column into cell E1 and save the file as xlsx.",
              goto("E1") + [type_text("=MAX(B2:B6)\n")], {"E1": max(r[1] for r in SALES[1:])})
    calc_task(kit, SORT, "regions.xlsx",
              "Sort the table in regions.xlsx by Units, largest first (keep the header row on top), and save it as "
              "xlsx.",
              # Data > Sort: the dialog opens on the current region with its header detected
              goto("B2") + [hotkey("alt", "d"), ["pyautogui.press('s')"], [wait_window_code("Sort")],
                            press("tab"), press("down"), press("enter")],
              gold_rows=[SALES[0]] + sorted(SALES[1:], key=lambda r: -r[1]))
