"""OSWorld's own task files (../shared/osworld/tasks: one real task per domain) on our desktops.

The JSON files are read in place with osfarm's loader, never copied or edited. Every file they
download is generated (tests/osworld_compat/generate.py) into an offline cache, and the tasks our
desktop can host run end to end through ``osfarm eval`` with a scripted GUI solution each
(tests/osworld_compat/solutions/<task id>.json, given to the replay agent with ``--solutions``):
replay must score 1.0 and noop 0.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from osfarm.evaluators.metrics import METRICS
from osfarm.runner.cli import eval_command
from osfarm.tasks.coverage import UNSUPPORTED, coverage_of_suite
from osfarm.tasks.filecache import FileCache, load_url_map
from osfarm.tasks.model import Task, load_task
from osfarm.tasks.setup import UNSUPPORTED_TYPES
from osfarm.tasks.suite import load_suite
from osfarm.testing.backend_parity import TaskSet, remember, scores_of

HERE = Path(__file__).resolve().parent
TASKS = HERE.parent.parent / "shared" / "osworld" / "tasks"
COMPAT = HERE / "osworld_compat"
SOLUTIONS = COMPAT / "solutions"
DOMAINS = {"chrome", "gimp", "libreoffice_calc", "libreoffice_impress", "libreoffice_writer", "os",
           "thunderbird", "vlc"}

# Tasks our desktop cannot host, with the reason. None of the eight does: none needs Google Drive
# or a Google login, opens a live website, reads one at evaluation time, or runs behind a proxy
# (``why_not_hostable`` checks exactly that, and must agree with this list).
NOT_HOSTABLE: dict[str, str] = {}

pytestmark = pytest.mark.skipif(not TASKS.is_dir(), reason=f"OSWorld's task files are not in {TASKS}")

_URL = re.compile(r"https?://[^\s\"']+")


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"osworld_compat_{name}", COMPAT / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("osworld") / "cache"
    _module("generate").build_cache(root)
    return root


def tasks() -> list[Task]:
    return list(load_suite(TASKS))


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def why_not_hostable(task: Task) -> str | None:
    """Why an offline desktop cannot run ``task`` (None when it can)."""
    if task.proxy:
        return "runs behind OSWorld's proxy"
    steps = [*task.config, *task.evaluator.postconfig]
    for step in steps:
        if step.type in UNSUPPORTED_TYPES:
            return f"setup step {step.type!r} needs a Google account"
    for name in [g.type for g in task.evaluator.getters()] + task.evaluator.funcs:
        if name in UNSUPPORTED:
            return f"{name}: {UNSUPPORTED[name]}"
    used = [s.to_json() for s in steps] + [task.evaluator.to_json()]
    live = [u for u in _URL.findall(" ".join(_strings(used))) if "huggingface.co" not in u]
    if live:
        return f"opens live web pages ({', '.join(live[:3])})"
    return None


def downloads(task: Task) -> list[tuple[str, str | None]]:
    """(url, name the file is cached under) for every file the task fetches: ``download`` steps
    (under the name of their destination) and ``cloud_file`` getters (under the URL's name)."""
    out: list[tuple[str, str | None]] = []
    for step in [*task.config, *task.evaluator.postconfig]:
        if step.type == "download":
            out += [(f["url"], Path(f["path"]).name) for f in step.parameters["files"]]
    for g in task.evaluator.getters():
        if g.type == "cloud_file":
            spec = g.to_json()
            paths = spec["path"] if isinstance(spec["path"], list) else [spec["path"]]
            out += [(p, None) for p in paths]
    return out


def _digest() -> str:
    h = hashlib.sha256()
    for p in sorted(TASKS.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(TASKS)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------- (1) load


def test_task_files_load_and_validate_unchanged() -> None:
    suite = load_suite(TASKS)
    assert {t.domain for t in suite} == DOMAINS and len(suite) == len(DOMAINS)
    for t in suite:
        assert t.path is not None and t.path.parent.parent == TASKS
        assert t.to_json() == json.loads(t.path.read_text()), f"{t.path}: not read back unchanged"
        assert load_task(t.path).to_json() == t.to_json()
        assert not t.evaluator.alignment_issues(), t.path
    cov = coverage_of_suite(suite)
    missing = [f"{n.kind} {n.name}: {n.status}" for n in cov.needs if n.status != "implemented"]
    assert not missing, missing


def test_hostable_tasks_are_the_listed_ones_and_have_solutions() -> None:
    found = {t.id: why for t in tasks() if (why := why_not_hostable(t)) is not None}
    assert found == NOT_HOSTABLE
    written = _module("solutions")
    assert set(written.SOLUTIONS) == {t.id for t in tasks()} - set(NOT_HOSTABLE)
    for tid, steps in written.SOLUTIONS.items():
        assert steps and steps[-1] in (["DONE"], ["FAIL"]), tid
        path = SOLUTIONS / f"{tid}.json"
        assert path.is_file() and path.read_text() == written.dumps(steps), f"{path} is stale: run solutions.py"


# ---------------------------------------------------------------------------------- (2) cache


def test_generated_cache_covers_every_download(cache: Path) -> None:
    url_map = load_url_map(cache / "url_map.json")
    files = FileCache(cache, url_map, offline=True)
    seen: list[str] = []
    for t in tasks():
        for url, name in downloads(t):
            path = files.fetch(url, t.id, name=name)  # raises AssetMissing naming the URL
            assert path.stat().st_size > 0, url
            seen.append(url)
    assert len(seen) == 10  # 5 download steps, 5 cloud files (the Writer gold twice, GIMP's input once more)
    assert set(seen) == set(url_map), "the generator makes files no task asks for"


def test_generated_files_have_their_formats(cache: Path) -> None:
    import docx
    import openpyxl
    from PIL import Image
    from pptx import Presentation

    by_name = {p.name: p for p in cache.rglob("*") if p.is_file()}
    assert openpyxl.load_workbook(by_name["NetIncome.xlsx"]).sheetnames == ["Sheet1"]
    assert openpyxl.load_workbook(by_name["3_NetIncome_gt1.xlsx"]).sheetnames == ["Sheet1", "Sheet2"]
    assert "H2O" in docx.Document(by_name["H2O_Factsheet_WA.docx"]).paragraphs[0].text
    assert len(Presentation(by_name["109_4.pptx"]).slides) == 3
    with Image.open(by_name["berry.jpeg"]) as img:
        assert img.format == "JPEG"
    with tarfile.open(by_name["thunderbird-profile.tar.gz"]) as tar:
        names = tar.getnames()
    assert ".thunderbird/profiles.ini" in names
    assert ".thunderbird/t5q2a5hp.default-release/Mail/Local Folders/Inbox" in names


def test_gold_files_separate_solved_from_unsolved(cache: Path, tmp_path: Path) -> None:
    # The evaluators' metrics on the generated files: the gold passes against itself, the
    # untouched input fails, so a replay scoring 1 and noop scoring 0 means something.
    from PIL import Image, ImageOps

    by_name = {p.name: str(p) for p in cache.rglob("*") if p.is_file()}
    rules = {"rules": [{"type": "sheet_data", "sheet_idx0": "RNSheet2", "sheet_idx1": "ENSheet2"}]}
    gold, start = by_name["3_NetIncome_gt1.xlsx"], by_name["NetIncome.xlsx"]
    assert METRICS["compare_table"](gold, gold, **rules) == 1.0
    assert METRICS["compare_table"](start, gold, **rules) == 0.0
    gold, start = by_name["109_4_Gold.pptx"], by_name["109_4.pptx"]
    assert METRICS["compare_pptx_files"](gold, gold) == 1.0 and METRICS["compare_pptx_files"](start, gold) == 0.0
    gold, start = by_name["H2O_Factsheet_WA_Gold.docx"], by_name["H2O_Factsheet_WA.docx"]
    assert METRICS["compare_subscript_contains"](gold, gold) == 1.0
    assert METRICS["compare_subscript_contains"](start, gold) == 0.0
    assert METRICS["compare_docx_files"](start, gold) == 1.0  # the text is the same; only the 2 changes
    berry = by_name["berry.jpeg"]
    mirrored = tmp_path / "berry_mirror.png"
    with Image.open(berry) as img:
        ImageOps.mirror(img.convert("RGB")).save(mirrored)
        img.convert("RGB").save(tmp_path / "berry.png")
    assert METRICS["check_image_mirror"](berry, str(mirrored)) == 1.0
    assert METRICS["check_image_mirror"](berry, str(tmp_path / "berry.png")) == 0.0


# ---------------------------------------------------------------------------------- (3) end to end


@pytest.fixture
def state_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The in-process farm's own state dir (short: unix socket paths live below it)."""
    d = Path(tempfile.mkdtemp(prefix="ofw", dir="/tmp"))
    monkeypatch.setenv("OSFARM_STATE_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class _ErrorRecords(logging.Handler):
    """Errors logged while it is attached (under pytest the root logger's handlers are pytest's,
    so an event loop's "Exception in callback" never reaches stderr here)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(self.format(record))


def _eval(cache: Path, out: Path, agent: str, *extra: str) -> dict[str, Any]:
    index = out.parent / f"{out.name}-index.json"
    hostable: dict[str, list[str]] = {}
    for t in tasks():
        if t.id not in NOT_HOSTABLE:
            hostable.setdefault(t.domain, []).append(t.id)
    index.write_text(json.dumps(hostable))
    app = typer.Typer()
    app.command()(eval_command)
    loop_errors = _ErrorRecords()
    logging.getLogger("asyncio").addHandler(loop_errors)  # where the in-process farm's event loop reports
    try:
        res = CliRunner().invoke(app, ["--suite", str(TASKS), "--index", str(index), "--cache", str(cache),
                                       "--agent", agent, *extra, "--envs", "2", "--out", str(out), "--no-progress"])
    finally:
        logging.getLogger("asyncio").removeHandler(loop_errors)
    assert res.exit_code == 0, res.output
    # e.g. "Exception in callback <built-in method set_result of _asyncio.Future> ... InvalidStateError"
    assert loop_errors.messages == [] and "InvalidStateError" not in res.output, loop_errors.messages
    results = json.loads((out / "results.json").read_text())
    assert results["n_tasks"] == sum(map(len, hostable.values()))
    # sandbox's scores, for tests/test_provider_conformance.py to compare other backends with
    remember("sandbox", os.environ["OSFARM_DESKTOP"], agent, TaskSet("osworld", TASKS, hostable), scores_of(results))
    return results


@pytest.mark.acceptance
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_replay_solves_the_hostable_tasks(cache: Path, tmp_path: Path, state_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """...on the GNOME desktop, the default: OSWorld's screen (the suite's other runs are on light)."""
    monkeypatch.setenv("OSFARM_DESKTOP", "gnome")
    before = _digest()
    results = _eval(cache, tmp_path / "replay", "replay", "--solutions", str(SOLUTIONS))
    failed = [(t["task_id"], t["status"], t.get("error")) for t in results["tasks"] if t["status"] != "success"]
    assert not failed, f"replay did not solve: {failed}"
    assert results["infra_errors"] == 0 and results["success_rate"] == 1.0
    assert {t["desktop"] for t in results["tasks"]} == {"gnome"}, results["tasks"][0]
    assert _digest() == before, f"{TASKS} was modified"


@pytest.mark.acceptance
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_noop_solves_none_of_them(cache: Path, tmp_path: Path, state_dir: Path) -> None:
    results = _eval(cache, tmp_path / "noop", "noop")
    assert results["infra_errors"] == 0
    solved = [t["task_id"] for t in results["tasks"] if t["score"] != 0]
    assert not solved, f"noop scored on {solved}"
