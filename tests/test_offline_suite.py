"""The offline suite tasks/osfarm-offline: every task validates, and the replay agent solves all
of them through the GUI on real desktops (the suite's acceptance run)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from osfarm.runner.cli import eval_command
from osfarm.tasks.suite import load_suite

SUITE = Path(__file__).resolve().parent.parent / "tasks" / "osfarm-offline"

pytestmark = pytest.mark.slow


def test_suite_loads_and_has_infeasible_tasks() -> None:
    suite = load_suite(SUITE)
    tasks = list(suite.tasks)
    assert len(tasks) >= 17
    funcs = [t.evaluator.func for t in tasks]
    assert funcs.count("infeasible") >= 3
    for t in tasks:
        assert t.trajectory, f"{t.id} has no reference solution"


def test_committed_suite_matches_its_generator() -> None:
    """The task JSONs, solutions and index are what domains/*.py build, and every input exists."""
    r = subprocess.run([sys.executable, str(SUITE / "build_suite.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_replay_solves_every_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OSFARM_STATE_DIR", tempfile.mkdtemp(prefix="ofo", dir="/tmp"))
    app = typer.Typer()
    app.command()(eval_command)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["--suite", str(SUITE), "--agent", "replay", "--envs", "2",
                                   "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    failed = [t for t in results["tasks"] if t["status"] != "success"]
    assert not failed, f"replay did not solve: {failed}"
    assert results["infra_errors"] == 0 and results["success_rate"] == 1.0
