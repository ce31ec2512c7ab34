"""The offline suite suites/osfarm-offline, its acceptance runs on real desktops: every task
validates, the replay agent solves all of them through the GUI, noop solves none, and fail
solves exactly the infeasible ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from osfarm.farm.server import FarmServer
from osfarm.runner.cli import eval_command
from osfarm.tasks.suite import load_suite
from osfarm.testing.backend_parity import offline_tasks, remember, scores_of

SUITE = Path(__file__).resolve().parent.parent / "suites" / "osfarm-offline"

def test_suite_loads_and_has_infeasible_tasks() -> None:
    suite = load_suite(SUITE)
    tasks = list(suite.tasks)
    funcs = [t.evaluator.func for t in tasks]
    assert len(tasks) - funcs.count("infeasible") >= 40 and funcs.count("infeasible") >= 3
    domains = {t.domain for t in tasks}
    assert {"os", "libreoffice_calc", "libreoffice_writer", "libreoffice_impress", "chrome", "gimp", "vlc",
            "thunderbird", "multi_apps"} <= domains
    for t in tasks:
        assert t.trajectory, f"{t.id} has no reference solution"


def test_committed_suite_matches_its_generator() -> None:
    """The task JSONs, solutions and index are what domains/*.py build, and every input exists."""
    r = subprocess.run([sys.executable, str(SUITE / "build_suite.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def run_suite(agent: str, out: Path, monkeypatch: pytest.MonkeyPatch, index: dict[str, list[str]] | None = None,
              farm: FarmServer | None = None) -> dict:
    """`osfarm eval --agent AGENT` on the suite (or ``index``'s tasks): on ``farm`` when given (the
    session's warm farm: no desktop boots), else on a farm of the eval's own. Its scores are kept
    for the session: tests/test_provider_conformance.py compares other backends with them."""
    monkeypatch.setenv("OSFARM_STATE_DIR", tempfile.mkdtemp(prefix="ofo", dir="/tmp"))
    if index is None:
        index = {}
        for t in load_suite(SUITE).tasks:
            index.setdefault(t.domain, []).append(t.id)
    index_file = out.parent / f"{out.name}-index.json"
    index_file.write_text(json.dumps(index))
    where = ["--url", farm.url, "--token", farm.token] if farm is not None else []
    app = typer.Typer()
    app.command()(eval_command)
    res = CliRunner().invoke(app, ["--suite", str(SUITE), "--agent", agent, "--envs", "2", *where,
                                   "--out", str(out), "--no-progress", "--index", str(index_file)])
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    desktop = farm.settings.desktop if farm is not None and farm.settings.desktop else os.environ["OSFARM_DESKTOP"]
    remember("sandbox", desktop, agent, offline_tasks(index), scores_of(results))
    return results


@pytest.mark.acceptance
@pytest.mark.slow
@pytest.mark.timeout(1800)  # the whole suite: about 6 min on 2 cores
def test_replay_solves_every_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """...on the GNOME desktop, the default (the noop and fail runs below are on the light one;
    the solutions click where each desktop draws a target), reset warm between tasks (the default,
    pinned here): every task's setup and solution dirty a desktop, and every warm reset after it
    must prove itself by its fingerprint (a mismatch, an error or a timeout would be a cold
    restart, named in the next episode's record)."""
    monkeypatch.setenv("OSFARM_RESET_MODE", "warm")
    monkeypatch.setenv("OSFARM_DESKTOP", "gnome")
    results = run_suite("replay", tmp_path / "run", monkeypatch)
    failed = [t for t in results["tasks"] if t["status"] != "success"]
    assert not failed, f"replay did not solve: {failed}"
    assert results["infra_errors"] == 0 and results["success_rate"] == 1.0
    assert results["desktops"] == ["gnome"]
    records = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    fallbacks = [(r["task_id"], r["desktop_reset_fallback"]) for r in records
                 if r.get("desktop_reset_fallback") not in (None, "every_n")]
    assert not fallbacks, f"warm resets that fell back to cold (the episode after the dirtying one): {fallbacks}"
    assert sum(r.get("desktop_reset") == "warm" for r in records) >= len(records) // 2, records


@pytest.mark.acceptance
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_noop_solves_nothing_and_fail_solves_exactly_the_infeasible_tasks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, farm: FarmServer) -> None:
    """...on the session's warm farm (light desktops, as the eval's own farm would start), both
    runs: two farms' desktop boots saved."""
    infeasible = {t.id for t in load_suite(SUITE).tasks if t.evaluator.func == "infeasible"}
    noop = run_suite("noop", tmp_path / "noop", monkeypatch, farm=farm)
    assert noop["infra_errors"] == 0
    assert [t["task_id"] for t in noop["tasks"] if t["status"] == "success"] == []
    # FAIL on a feasible task scores 0 by the scoring rule, before any getter runs: one feasible
    # task per domain shows that; every infeasible task must score 1.
    tasks = load_suite(SUITE).tasks
    subset: dict[str, list[str]] = {}
    feasible_taken: set[str] = set()  # domains
    for t in tasks:
        if t.id in infeasible or t.domain not in feasible_taken:
            subset.setdefault(t.domain, []).append(t.id)
            if t.id not in infeasible:
                feasible_taken.add(t.domain)
    fail = run_suite("fail", tmp_path / "fail", monkeypatch, subset, farm=farm)
    assert fail["infra_errors"] == 0
    assert {t["task_id"] for t in fail["tasks"]} == {i for ids in subset.values() for i in ids}
    assert {t["task_id"] for t in fail["tasks"] if t["status"] == "success"} == infeasible
