"""What a suite needs vs. what osfarm implements: setup step types, getters and metrics.

Counts come from a loaded suite or from a TSV index (``test_all_index.tsv``: columns ``domain,
id, ..., config_types, func, result_getter``; list-valued ``func``/``result_getter`` cells join
entries with ``+``, ``config_types`` with ``,``). The implementation is asked through registries
imported lazily, so this works (reporting everything missing) before they exist:

* ``osfarm.tasks.setup.SETUP_TYPES: set[str]``
* ``osfarm.evaluators.getters.GETTERS: dict[str, Callable]`` (keys ``vm_file`` or ``get_vm_file``)
* ``osfarm.evaluators.metrics.METRICS: dict[str, Callable]``

Counting rules: ``uses`` = occurrences (a metric twice in one ``func`` list counts twice),
``tasks`` = tasks using it at least once. From a suite, setup counts ``config`` and
``evaluator.postconfig`` and getters count ``result`` and ``expected``; a TSV has only
``config`` and ``result`` columns, so its counts cover those alone.
"""

from __future__ import annotations

import csv
import importlib
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from osfarm.evaluators.metrics.ocr import ocr_available
from osfarm.evaluators.scoring import INFEASIBLE
from osfarm.tasks.model import Issue, TaskError
from osfarm.tasks.suite import Suite, load_suite

Kind = Literal["setup", "getter", "metric"]
KINDS: tuple[Kind, ...] = ("setup", "getter", "metric")
Status = Literal["implemented", "unsupported", "missing"]

# Things no offline farm can do, whatever we build. Keys are setup types, getter types (without
# ``get_``) or metric names; they do not collide across kinds in OSWorld. A name here is reported
# unsupported even when registered: its function only raises UnsupportedOption with the reason.
UNSUPPORTED: dict[str, str] = {
    # setup
    "googledrive": "unsupported, because it needs a Google account and the Google Drive API (network, credentials)",
    "login": "unsupported, because it signs in to a live web service with a real account (network, credentials)",
    # getters
    "googledrive_file": "unsupported, because it downloads the result from Google Drive (network, credentials)",
    "info_from_website": "unsupported, because it reads a live website whose content changes over time",
    "gotoRecreationPage_and_get_html_content": "unsupported, because it browses the live www.recreation.gov site",
    "pdf_from_url": "unsupported, because it downloads a PDF from a live URL at evaluation time",
}

# Names that work once an optional extra is installed: (its check, the reason when it is missing).
NEEDS_EXTRA: dict[str, tuple[Callable[[], bool], str]] = {
    "compare_image_text": (ocr_available, "unsupported here, because it needs EasyOCR and its English weights: "
                                          "install osfarm[ocr]"),
}

_REGISTRIES: dict[Kind, tuple[str, str]] = {
    "setup": ("osfarm.tasks.setup", "SETUP_TYPES"),
    "getter": ("osfarm.evaluators.getters", "GETTERS"),
    "metric": ("osfarm.evaluators.metrics", "METRICS"),
}


def implemented(kind: Kind) -> set[str]:
    """Names the implementation registers for ``kind``; empty while its module does not exist."""
    module_name, attr = _REGISTRIES[kind]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only "not written yet" is tolerated; a broken import inside an existing module is a bug.
        if e.name is not None and module_name.startswith(e.name):
            return set()
        raise
    names = set(getattr(module, attr, ()) or ())
    if kind == "getter":
        names |= {n[len("get_"):] for n in names if n.startswith("get_")}
    if kind == "metric":
        names.add(INFEASIBLE)  # decided by scoring from the last action, not by a metric function
    return names


@dataclass
class Need:
    kind: Kind
    name: str
    uses: int
    tasks: int
    status: Status
    reason: str | None = None

    @property
    def label(self) -> str:
        # reasons read "unsupported, because ..."
        return self.reason or "unsupported" if self.status == "unsupported" else self.status


@dataclass
class Coverage:
    source: str
    n_tasks: int
    needs: list[Need]
    live_web_tasks: int = 0  # tasks that open non-HuggingFace URLs: need internet whatever we build
    notes: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # task files that do not load, one issue a line

    def of(self, kind: Kind) -> list[Need]:
        return [n for n in self.needs if n.kind == kind]

    def get(self, kind: Kind, name: str) -> Need | None:
        return next((n for n in self.needs if n.kind == kind and n.name == name), None)

    def summary(self, kind: Kind) -> dict[str, int]:
        c = Counter(n.status for n in self.of(kind))
        return {s: c.get(s, 0) for s in ("implemented", "unsupported", "missing")}

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "n_tasks": self.n_tasks,
            "live_web_tasks": self.live_web_tasks,
            "notes": self.notes,
            "refused": self.refused,
            "summary": {k: self.summary(k) for k in KINDS},
            "needs": {k: [_need_json(n) for n in self.of(k)] for k in KINDS},
        }


def _need_json(n: Need) -> dict[str, Any]:
    d = asdict(n)
    d.pop("kind")
    return d


# Each task contributes, per kind, the list of names it uses (with repeats).
TaskNeeds = dict[Kind, list[str]]


def _build(source: str, per_task: list[TaskNeeds], live_web: int, notes: list[str]) -> Coverage:
    needs: list[Need] = []
    for kind in KINDS:
        uses: Counter[str] = Counter()
        tasks: Counter[str] = Counter()
        for t in per_task:
            names = [n for n in t.get(kind, []) if n]
            uses.update(names)
            tasks.update(set(names))
        have = implemented(kind)
        for name, count in sorted(uses.items(), key=lambda kv: (-kv[1], kv[0])):
            if name in UNSUPPORTED:
                status: Status = "unsupported"
                reason = UNSUPPORTED[name]
            elif name in NEEDS_EXTRA and not NEEDS_EXTRA[name][0]():
                status, reason = "unsupported", NEEDS_EXTRA[name][1]
            elif name in have:
                status, reason = "implemented", None
            else:
                status, reason = "missing", None
            needs.append(Need(kind, name, count, tasks[name], status, reason))
    return Coverage(source, len(per_task), needs, live_web, notes)


_URL = re.compile(r"https?://[^\s\"'<>]+")


def _live_urls(value: Any) -> Iterable[str]:
    """URLs in a JSON value that are not OSWorld's HuggingFace file cache (or its hf-mirror.com
    copy): those are files ``osfarm tasks fetch`` caches, not live pages."""
    if isinstance(value, str):
        for u in _URL.findall(value):
            if "huggingface.co" not in u and "hf-mirror.com" not in u:
                yield u
    elif isinstance(value, dict):
        for v in value.values():
            yield from _live_urls(v)
    elif isinstance(value, list):
        for v in value:
            yield from _live_urls(v)


def coverage_of_suite(suite: Suite, source: str | None = None) -> Coverage:
    per_task: list[TaskNeeds] = []
    live = 0
    for t in suite:
        ev = t.evaluator
        per_task.append(
            {
                "setup": t.config_types() + [c.type for c in ev.postconfig],
                "getter": [g.type for g in ev.getters()],
                "metric": ev.funcs,
            }
        )
        if any(True for _ in _live_urls([c.to_json() for c in t.config])):
            live += 1
    notes = ["setup counts config and evaluator.postconfig; getters count result and expected"]
    cov = _build(source or str(suite.root), per_task, live, notes)
    cov.refused = [str(i) for r in suite.refused for i in r.issues]
    if suite.refused:
        cov.notes.append(f"{len(suite.refused)} task file(s) refused (not counted): see 'refused'")
    return cov


TSV_COLUMNS = ("domain", "id", "config_types", "func", "result_getter")


def coverage_of_tsv(path: str | Path) -> Coverage:
    p = Path(path)
    try:
        with p.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
            header = rows[0].keys() if rows else []
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise TaskError([Issue(str(p), f"cannot read TSV index: {e}")]) from None
    missing = [c for c in TSV_COLUMNS if c not in header]
    if missing:
        raise TaskError([Issue(str(p), f"TSV index lacks columns: {', '.join(missing)}", line=1, col=1)])
    per_task: list[TaskNeeds] = []
    live = 0
    for r in rows:
        per_task.append(
            {
                "setup": _split(r["config_types"], ","),
                "getter": _split(r["result_getter"], "+"),
                "metric": _split(r["func"], "+"),
            }
        )
        if (r.get("n_non_hf_urls") or "0").strip() not in ("", "0"):
            live += 1
    notes = ["from a TSV index: setup counts config only; getters count result getters only"]
    return _build(str(p), per_task, live, notes)


def _split(cell: str | None, sep: str) -> list[str]:
    return [x.strip() for x in (cell or "").split(sep) if x.strip()]


def coverage(target: str | Path, index: str | Path | None = None) -> Coverage:
    """Coverage of a suite folder, or of a ``.tsv`` index file."""
    p = Path(target)
    if p.is_file() and p.suffix.lower() in (".tsv", ".txt"):
        return coverage_of_tsv(p)
    return coverage_of_suite(load_suite(p, index, strict=False), source=str(p))
