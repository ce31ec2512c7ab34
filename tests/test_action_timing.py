"""OSWorld's exact pacing on request (a new interpreter per code action, pyautogui's 0.1 s pause
after every call), the fast path on request, settle by default, and every record saying which one
ran: on real desktops of the shared farm (settle's own behaviour: tests/test_settle_timing.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from osfarm.client import Farm
from osfarm.desktop.box.coderunner import CodeRunner
from osfarm.env import SyncTaskEnv
from osfarm.farm.server import FarmServer
from osfarm.runner.cli import eval_command
from osfarm.runner.results import read_episodes
from osfarm.tasks.model import load_task

SUITE = Path(__file__).resolve().parent.parent / "suites" / "mini"
MKDIR = "5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0a02"
PROBE = "import os; print(os.getpid(), pyautogui.PAUSE, pyautogui.FAILSAFE, 'x' in globals())"

app = typer.Typer()
app.command()(eval_command)
app.command("unused")(lambda: None)


def probe(results: list) -> list[tuple[str, ...]]:
    return [tuple(r.output.split()) for r in results if r.output]


def test_osworld_is_osworlds_python_c_path_and_fast_is_one_kept_interpreter(farm: FarmServer) -> None:
    with Farm(farm.url, farm.token) as f, f.lease(wait_s=120) as desk:
        # osworld: each code action is a new `python -c` with pyautogui's defaults; nothing is kept
        sr = desk.step(["x = 1", PROBE, PROBE, "print(x)"], timing="osworld")
        (pid1, pause, failsafe, kept), (pid2, *_rest) = probe(sr.results[1:3])
        assert (pause, failsafe, kept) == ("0.1", "False", "False") and pid1 != pid2
        assert not sr.results[3].ok and "NameError: name 'x' is not defined" in (sr.results[3].error or "")
        # fast: one interpreter, no pause, state kept between actions and steps
        sr = desk.step(["x = 1", PROBE], timing="fast")
        sr2 = desk.step([PROBE, "print(x)"], timing="fast")
        (pid1, pause, failsafe, kept), (pid2, *_rest) = probe(sr.results[1:]) + probe(sr2.results[:1])
        assert (pause, failsafe, kept) == ("0", "False", "True") and pid1 == pid2
        assert sr2.results[1].ok and sr2.results[1].output == "1\n"
        # a pyautogui call is followed by OSWorld's pause, whatever the code sets beforehand in
        # an earlier action (each action starts from pyautogui's defaults again)
        sr = desk.step(["pyautogui.PAUSE = 0",
                        "t = time.monotonic(); pyautogui.moveTo(10, 10); print(round(time.monotonic() - t, 3))"],
                       timing="osworld")
        assert float(sr.results[1].output) >= 0.1
        # computer_13 actions are paced too (OSWorld runs each as a pyautogui call)
        sr = desk.step([{"action_type": "MOVE_TO", "parameters": {"x": 20, "y": 20}}] * 3, timing="osworld")
        assert all(r.ok for r in sr.results) and sr.t_env_ms >= 300
        with pytest.raises(Exception, match="timing"):
            desk.step(["print(1)"], timing="slow")  # type: ignore[arg-type]


def test_code_runner_timing_argument() -> None:
    with pytest.raises(ValueError, match="timing must be one of"):
        CodeRunner(timing="slow")  # type: ignore[arg-type]


def test_task_env_reports_its_timing(farm: FarmServer, tmp_path: Path) -> None:
    task = load_task(SUITE / "os" / f"{MKDIR}.json")
    with SyncTaskEnv(farm.url, farm.token, action_timing="fast", work_dir=tmp_path / "w") as env:
        _obs, info = env.reset(task)
        assert info["action_timing"] == "fast"
    with pytest.raises(ValueError, match="action_timing"):
        SyncTaskEnv(farm.url, farm.token, action_timing="turbo")


@pytest.mark.parametrize("timing", ["settle", "osworld"])
def test_results_and_records_say_which_timing_ran(farm: FarmServer, tmp_path: Path, timing: str) -> None:
    out = tmp_path / "run"
    idx = tmp_path / "idx.json"
    idx.write_text(json.dumps({"os": [MKDIR]}))
    argv = ["eval-command", "--suite", str(SUITE), "--index", str(idx), "--agent", "replay", "--no-progress",
            "--url", farm.url, "--token", farm.token, "--out", str(out)]
    if timing != "settle":  # settle is the default: no flag
        argv += ["--action-timing", timing]
    r = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["action_timing"] == timing and res["success_rate"] == 1.0
    assert res["tasks"][0]["action_timing"] == timing
    # which desktop session ran (issue 27): the shared farm's desktops are light ones
    assert res["desktops"] == ["light"] and res["tasks"][0]["desktop"] == "light"
    (rec,) = read_episodes(out / "episodes.jsonl")
    assert rec["action_timing"] == timing and rec["status"] == "success"
    assert rec["desktop"]["session"] == "light"
    bad = CliRunner().invoke(app, [*argv[:-2], "--out", str(tmp_path / "x"), "--action-timing", "slow"])
    assert bad.exit_code == 2 and "--action-timing must be one of osworld, settle, fast" in bad.output
