#!/usr/bin/env python3
"""(Re)build every input and expected file of the osfarm-offline suite under cache/<task_id>/.

Nothing is downloaded: files are made with openpyxl and plain text.
The tasks' download URLs (https://osfarm.invalid/offline/<task_id>/<name>) resolve offline via
OSWorld's cache layout, cache/<task_id>/<name>.  Run: python generate_assets.py [--check]
"""
from __future__ import annotations

import sys
from pathlib import Path

import openpyxl

HERE = Path(__file__).resolve().parent
CACHE = HERE / "cache"

# task ids (must match <domain>/<id>.json)
OS_COUNT = "0f5d2a10-0000-4000-8000-000000000001"
OS_RENAME = "0f5d2a10-0000-4000-8000-000000000002"
OS_CHMOD = "0f5d2a10-0000-4000-8000-000000000003"
OS_COPYCSV = "0f5d2a10-0000-4000-8000-000000000004"
OS_TAR = "0f5d2a10-0000-4000-8000-000000000005"
OS_SORT = "0f5d2a10-0000-4000-8000-000000000006"
OS_MOUSEPAD = "0f5d2a10-0000-4000-8000-000000000007"
OS_SED = "0f5d2a10-0000-4000-8000-000000000008"
OS_LINK = "0f5d2a10-0000-4000-8000-000000000009"
CALC_SUM = "0f5d2a10-0000-4000-8000-000000000101"
CALC_PRODUCT = "0f5d2a10-0000-4000-8000-000000000102"
CALC_AVG = "0f5d2a10-0000-4000-8000-000000000103"
CALC_MAX = "0f5d2a10-0000-4000-8000-000000000104"
CHROME_LOCAL = "0f5d2a10-0000-4000-8000-000000000401"


def d(task_id: str) -> Path:
    p = CACHE / task_id
    p.mkdir(parents=True, exist_ok=True)
    return p


def text(task_id: str, name: str, body: str) -> None:
    (d(task_id) / name).write_text(body)


SALES = [("Region", "Units", "Price"), ("North", 12, 3.5), ("South", 7, 4.0), ("East", 20, 2.25),
         ("West", 15, 5.0), ("Central", 9, 6.5)]


def xlsx(path: Path, rows, extra=None) -> None:
    wb = openpyxl.Workbook()
    ws = wb.active
    ws.title = "Sheet1"
    for r in rows:
        ws.append(list(r))
    for (cell, value) in (extra or {}).items():
        ws[cell] = value
    wb.save(path)


def build() -> None:
    # os
    text(OS_COUNT, "notes.txt", "".join(f"note number {i}\n" for i in range(1, 38)))
    text(OS_RENAME, "draft.txt", "draft of the annual report\n")
    text(OS_CHMOD, "run.sh", "#!/bin/sh\necho running\n")
    for n in ("a.csv", "b.csv", "c.txt"):
        text(OS_COPYCSV, n, f"col1,col2\n{n},1\n")
    for n in ("one.txt", "two.txt"):
        text(OS_TAR, n, f"content of {n}\n")
    text(OS_SORT, "names.txt", "mallory\nalice\ntrent\nbob\ncarol\n")
    text(OS_SED, "app.conf", "name=demo\nport=8080\ndebug=true\n")
    text(OS_LINK, "v2.txt", "release notes v2\n")
    # calc: largest Units value into E1
    xlsx(d(CALC_MAX) / "units.xlsx", SALES)
    xlsx(d(CALC_MAX) / "units_gold.xlsx", SALES, {"E1": max(r[1] for r in SALES[1:])})
    # calc: sum of Units into B7
    xlsx(d(CALC_SUM) / "sales.xlsx", SALES)
    xlsx(d(CALC_SUM) / "sales_gold.xlsx", SALES, {"B7": sum(r[1] for r in SALES[1:])})
    # calc: revenue column D = Units*Price
    xlsx(d(CALC_PRODUCT) / "revenue.xlsx", SALES)
    xlsx(d(CALC_PRODUCT) / "revenue_gold.xlsx", [r + (("Revenue",) if i == 0 else (r[1] * r[2],))
                                                  for i, r in enumerate(SALES)])
    # calc: average price into C7
    xlsx(d(CALC_AVG) / "prices.xlsx", SALES)
    xlsx(d(CALC_AVG) / "prices_gold.xlsx", SALES, {"C7": sum(r[2] for r in SALES[1:]) / 5})
    # chrome
    text(CHROME_LOCAL, "welcome.html", "<!doctype html><html><head><title>Welcome to osfarm</title></head>"
         "<body><h1>Welcome</h1><p>An offline page.</p></body></html>\n")
    # os: GUI text editor
    text(OS_MOUSEPAD, "todo.txt", "buy milk\ncall the bank\n")
    text(OS_MOUSEPAD, "todo_gold.txt", "buy milk\ncall the bank\nwater the plants\n")

if __name__ == "__main__":
    build()
    print(f"assets written under {CACHE}", file=sys.stderr)
