"""`osfarm eval` end to end: a real farm, real sandbox desktops, the tiny suite in suites/mini."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from osfarm.agents import make_agent
from osfarm.agents.replay import ReplayError
from osfarm.farm.server import FarmServer
from osfarm.runner.cli import eval_command
from osfarm.runner.results import SCHEMA, SchemaError, check_record, read_episodes
from osfarm.tasks.model import load_task
from osfarm.tasks.suite import load_suite

SUITE = Path(__file__).resolve().parent.parent / "suites" / "mini"
HELLO, MKDIR, INFEASIBLE = (f"5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0a0{i}" for i in (1, 2, 3))
MISSING_URL = "https://osfarm.invalid/suite_mini/missing-input.xlsx"

app = typer.Typer()
app.command()(eval_command)
app.command("unused")(lambda: None)  # two commands: typer keeps "eval-command" as a sub-command name


def run_eval(out: Path, *args: str, farm: FarmServer | None = None, suite: Path = SUITE) -> dict:
    argv = ["eval-command", "--suite", str(suite), "--out", str(out), "--envs", "2", "--max-steps", "15",
            "--no-progress", *args]
    if farm is not None:
        argv += ["--url", farm.url, "--token", farm.token]
    r = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads((out / "results.json").read_text())


def by_id(results: dict) -> dict[str, dict]:
    return {t["task_id"]: t for t in results["tasks"]}


def test_replay_solves_every_task_with_the_full_record(farm: FarmServer, tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_eval(out, "--agent", "replay", "--record", farm=farm)
    assert res["agent"] == "replay" and res["run_id"]
    assert res["n_tasks"] == 3 and res["success_rate"] == 1.0 and res["infra_errors"] == 0
    assert res["by_domain"] == {"os": pytest.approx(res["by_domain"]["os"])} and res["by_domain"]["os"]["n"] == 3
    assert res["by_domain"]["os"]["success_rate"] == 1.0
    assert [t["task_id"] for t in res["tasks"]] == [HELLO, MKDIR, INFEASIBLE]  # the index's order
    assert all(t["status"] == "success" and t["score"] == 1.0 and t["domain"] == "os" for t in res["tasks"])

    # OSWorld's per-task layout
    for tid, n_steps in ((HELLO, 2), (MKDIR, 2), (INFEASIBLE, 1)):
        d = out / "os" / tid
        assert float((d / "result.txt").read_text()) == 1.0
        lines = [json.loads(x) for x in (d / "traj.jsonl").read_text().splitlines()]
        assert [x["step_num"] for x in lines] == list(range(1, n_steps + 1))
        for x in lines:
            assert re.fullmatch(rf"step_{x['step_num']}_\d{{8}}@\d{{12}}\.png", x["screenshot_file"])
            assert (d / x["screenshot_file"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        probe = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "stream=codec_type,width",
                                "-of", "csv=p=0", str(d / "recording.mp4")], capture_output=True, text=True)
        assert probe.returncode == 0 and "video,1024" in probe.stdout, probe.stderr
    hello_traj = [json.loads(x) for x in (out / "os" / HELLO / "traj.jsonl").read_text().splitlines()]
    assert hello_traj[0]["actions"][0]["action_type"] == "TYPING" and hello_traj[0]["response"]

    # osfarm.episode/1 records, screenshots as content-addressed blobs
    recs = read_episodes(out / "episodes.jsonl")
    assert sorted(r["task_id"] for r in recs) == sorted([HELLO, MKDIR, INFEASIBLE])
    for r in recs:
        assert r["schema"] == SCHEMA and r["run_id"] == res["run_id"] and r["status"] == "success"
        assert r["attempt"] == 1 and r["agent"] == "replay" and r["policy"]["name"] == "replay"
        for s in r["steps"]:
            ref = s["observation"]["screenshot"]
            blob = out / ref["path"]
            import hashlib

            assert hashlib.sha256(blob.read_bytes()).hexdigest() == ref["sha256"] == blob.stem
            assert s["model"]["response_text"] and isinstance(s["actions"], list)
    mk = next(r for r in recs if r["task_id"] == MKDIR)
    assert mk["steps"][0]["actions"][1] == "pyautogui.press('enter')" and mk["steps"][0]["action_error"] is None

    # the static report: every task, with relative image links that resolve
    html = (out / "report.html").read_text()
    for tid in (HELLO, MKDIR, INFEASIBLE):
        assert tid in html
    imgs = re.findall(r"<img src='([^']+)'", html)
    assert len(imgs) == 5 and all((out / p).is_file() for p in imgs)


def test_noop_scores_zero_on_fresh_desktops(farm: FarmServer, tmp_path: Path) -> None:
    # The replay test ran first on the same two desktops: a lease must come back reset.
    res = run_eval(tmp_path / "run", "--agent", "noop", farm=farm)
    assert res["n_tasks"] == 3 and res["success_rate"] == 0.0 and res["infra_errors"] == 0
    assert {t["status"] for t in res["tasks"]} == {"failure"}


def test_fail_solves_exactly_the_infeasible_task_and_resume_skips(farm: FarmServer, tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_eval(out, "--agent", "fail", farm=farm)
    assert {k: v["status"] for k, v in by_id(res).items()} == {
        HELLO: "failure", MKDIR: "failure", INFEASIBLE: "success"}
    assert res["success_rate"] == pytest.approx(1 / 3)
    assert len(read_episodes(out / "episodes.jsonl")) == 3

    (out / "os" / MKDIR / "result.txt").unlink()  # as if the run had been killed before this task
    res2 = run_eval(out, "--agent", "fail", "--resume", farm=farm)
    assert res2["resumed"] == 2 and res2["ran"] == 1
    recs = read_episodes(out / "episodes.jsonl")
    assert len(recs) == 4 and recs[-1]["task_id"] == MKDIR and recs[-1]["run_id"] == res2["run_id"]
    assert {k: v["status"] for k, v in by_id(res2).items()} == {
        HELLO: "failure", MKDIR: "failure", INFEASIBLE: "success"}


def test_missing_offline_asset_is_a_counted_infra_error(farm: FarmServer, tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    shutil.copytree(SUITE, suite)
    bad = "5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0aff"
    (suite / "os" / f"{bad}.json").write_text(json.dumps({
        "id": bad, "snapshot": "os", "instruction": "Sum column A.", "source": "test", "trajectory": "",
        "config": [{"type": "download", "parameters": {"files": [{"url": MISSING_URL, "path": "/home/user/in.xlsx"}]}}],
        "evaluator": {"func": "exact_match", "result": {"type": "vm_command_line", "command": "true"},
                      "expected": {"type": "rule", "rules": {"expected": "x"}}}}))
    (suite / "test_all.json").write_text(json.dumps({"os": [HELLO, MKDIR, INFEASIBLE, bad]}))
    out = tmp_path / "run"
    res = run_eval(out, "--agent", "replay", "--retries", "1", farm=farm, suite=suite)
    assert res["n_tasks"] == 4 and res["infra_errors"] == 1 and res["infra_retries"] == 1
    assert res["success_rate"] == 0.75  # the crashed task stays in the denominator
    row = by_id(res)[bad]
    assert row["status"] == "infra_error" and row["score"] == 0.0 and row["attempts"] == 2
    assert MISSING_URL in row["error"] and "setup step 0 (download)" in row["error"]
    assert not (out / "os" / bad / "result.txt").exists()  # --resume will try it again
    assert MISSING_URL in (out / "os" / bad / "error.txt").read_text()
    rec = [r for r in read_episodes(out / "episodes.jsonl") if r["task_id"] == bad]
    assert len(rec) == 1 and rec[0]["status"] == "infra_error" and rec[0]["attempt"] == 2
    assert res["by_domain"]["os"]["infra_errors"] == 1 and res["by_domain"]["os"]["success_rate"] == 0.75
    assert "infra_error" in (out / "report.html").read_text()


def test_a_setup_step_that_needs_the_network_is_an_infra_error(farm: FarmServer, tmp_path: Path) -> None:
    # Offline means offline: a package a step installs that the desktop lacks fails its step (config
    # or postconfig), never a silent failure that leaves the task unsolvable or already solved.
    suite = tmp_path / "suite"
    (suite / "os").mkdir(parents=True)
    apt, pip = "5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0c01", "5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0c02"
    echo = {"func": "exact_match", "result": {"type": "vm_command_line", "command": "echo yes", "shell": True},
            "expected": {"type": "rule", "rules": {"expected": "yes\n"}}}
    sysstat = ("echo {CLIENT_PASSWORD} | sudo -S apt-get update && echo {CLIENT_PASSWORD} | "
               "sudo -S apt-get install sysstat")  # multi_apps/2373b66a's step
    (suite / "os" / f"{apt}.json").write_text(json.dumps({
        "id": apt, "snapshot": "os", "instruction": "x", "evaluator": echo,
        "config": [{"type": "command", "parameters": {"command": sysstat, "shell": True}}]}))
    (suite / "os" / f"{pip}.json").write_text(json.dumps({  # multi_apps/da922383's postconfig
        "id": pip, "snapshot": "os", "instruction": "x", "config": [],
        "evaluator": {**echo, "postconfig": [{"type": "execute", "parameters": {"command": "pip install PyMuPDF",
                                                                                "shell": "true"}}]}}))
    (suite / "test_all.json").write_text(json.dumps({"os": [apt, pip]}))
    res = run_eval(tmp_path / "run", "--agent", "noop", "--retries", "0", farm=farm, suite=suite)
    rows = by_id(res)
    assert res["infra_errors"] == 2 and res["success_rate"] == 0.0  # noop would have scored 1 on both
    assert rows[apt]["status"] == "infra_error" and rows[apt]["steps"] == 0
    assert "setup step 0 (command) failed: " in rows[apt]["error"]
    assert "$.config[0]: needs the network: apt package 'sysstat' is not installed" in rows[apt]["error"]
    assert rows[pip]["status"] == "infra_error" and "postconfig: setup step 0 (execute) failed: " in rows[pip]["error"]
    assert "$.evaluator.postconfig[0]: needs the network: pip package 'PyMuPDF'" in rows[pip]["error"]


def test_refused_task_files_are_infra_errors_and_the_others_run(farm: FarmServer, tmp_path: Path) -> None:
    # One bad task file must cost that task only: it is an infra_error naming the file and the JSON
    # path, the others run. A func list shorter than its result list loads (OSWorld indexes by metric).
    suite = tmp_path / "suite"
    shutil.copytree(SUITE, suite)
    broken, uneven, absent = (f"5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0b0{i}" for i in (1, 2, 3))
    (suite / "os" / f"{broken}.json").write_text(json.dumps({
        "id": broken, "instruction": "x", "config": [{"type": 3}],
        "evaluator": {"func": "exact_match", "result": {"type": "vm_command_line", "command": "true"}}}))
    (suite / "os" / f"{uneven}.json").write_text(json.dumps({
        "id": uneven, "snapshot": "os", "instruction": "Say no.", "source": ["https://a.example", "b"],
        "proxy": True, "my_key": {"kept": 1}, "config": [],
        "evaluator": {"func": ["exact_match"], "conj": "and",
                      "result": [{"type": "vm_command_line", "command": "echo yes"},
                                 {"type": "no_such_getter"}],
                      "expected": [{"type": "rule", "rules": {"expected": "yes\n"}}, None]}}))
    (suite / "test_all.json").write_text(json.dumps({"os": [HELLO, broken, uneven, absent, INFEASIBLE]}))
    out = tmp_path / "run"
    res = run_eval(out, "--agent", "noop", farm=farm, suite=suite)
    rows = by_id(res)
    assert res["n_tasks"] == 5 and res["refused"] == 2 and res["infra_errors"] == 2
    assert rows[HELLO]["status"] == "failure" and rows[INFEASIBLE]["status"] == "failure"
    # the uneven task ran: its second (never evaluated) getter does not exist, yet it scored
    assert rows[uneven]["status"] == "success" and rows[uneven]["score"] == 1.0
    bad = rows[broken]
    assert bad["status"] == "infra_error" and bad["score"] == 0.0 and bad["steps"] == 0
    assert f"{suite / 'os' / broken}.json: $.config[0].type" in bad["error"]
    assert f"{suite / 'os' / broken}.json: $.snapshot" not in bad["error"]  # a key OSWorld never reads
    assert f"{suite / 'test_all.json'}: $.os[3]: task {absent} has no file" in rows[absent]["error"]
    for tid in (broken, absent):
        assert not (out / "os" / tid / "result.txt").exists()  # --resume tries them again
        assert "$." in (out / "os" / tid / "error.txt").read_text()
    recs = {r["task_id"]: r for r in read_episodes(out / "episodes.jsonl")}
    assert set(recs) == {HELLO, broken, uneven, absent, INFEASIBLE}
    assert recs[broken]["status"] == "infra_error" and recs[broken]["steps"] == []


def test_in_process_farm_when_no_url_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its own state dir: the in-process farm takes the state dir's lock, like `osfarm serve`.
    monkeypatch.setenv("OSFARM_STATE_DIR", tempfile.mkdtemp(prefix="ofr", dir="/tmp"))
    idx = tmp_path / "one.json"
    idx.write_text(json.dumps({"os": [INFEASIBLE]}))
    res = run_eval(tmp_path / "run", "--agent", "fail", "--index", str(idx), "--width", "1024", "--height", "768")
    assert res["n_tasks"] == 1 and res["success_rate"] == 1.0 and res["envs"] == 2


def test_replay_agent_and_record_schema_errors(tmp_path: Path) -> None:
    t = load_task(SUITE / "os" / f"{MKDIR}.json")
    a = make_agent("replay")
    a.reset(t)
    assert a.predict("", {})[1] == ["pyautogui.write('mkdir -p ~/projects/osfarm', interval=0.01)",
                                     "pyautogui.press('enter')"]
    assert a.predict("", {})[1] == ["DONE"] and a.predict("", {})[1] == ["DONE"]  # ran out: DONE
    t2 = t.model_copy()
    t2.trajectory = "solutions/nope.json"
    t2._path = t.path
    with pytest.raises(ReplayError, match="nope.json"):
        make_agent("replay").reset(t2)
    assert len(load_suite(SUITE)) == 3  # the suite's own test_all.json / os/solutions do not confuse it
    with pytest.raises(SchemaError, match="unsupported episode schema"):
        check_record({"schema": "osfarm.episode/2"})
    with pytest.raises(SchemaError, match="missing fields"):
        check_record({"schema": SCHEMA, "episode_id": "x"})


def test_an_agent_may_answer_typed_actions(farm: FarmServer, tmp_path: Path) -> None:
    """An agent's typed actions run, end the episode and reach the record as the JSON a dict would be."""
    import asyncio

    from osfarm.agents import BaseAgent
    from osfarm.client import AsyncFarm
    from osfarm.runner.episode import EpisodeConfig, run_episode
    from osfarm.runner.results import write_task
    from osfarm.schema.actions import AgentAction, Fail
    from osfarm.stream.blobs import LocalBlobStore
    from osfarm.tasks.filecache import FileCache

    class TypedFail(BaseAgent):
        name = "typed-fail"

        def predict(self, instruction: str, obs: dict) -> tuple[str, list[AgentAction]]:
            return "infeasible", [Fail(action_type="FAIL")]

    async def go() -> Any:
        async with AsyncFarm(farm.url, farm.token) as client:
            cfg = EpisodeConfig(max_steps=2, infra_retries=0, work_dir=tmp_path / "work")
            return await run_episode(client, load_suite(SUITE)[INFEASIBLE], TypedFail(),
                                     FileCache(tmp_path / "cache", offline=True), cfg, "run")

    res = asyncio.run(go())
    assert (res.status, res.score, res.last_action) == ("success", 1.0, {"action_type": "FAIL"})
    records: list[dict] = []
    write_task(tmp_path / "out", res, "run", LocalBlobStore(tmp_path / "out"), emit=records.append)
    assert records[0]["steps"][0]["actions"] == [{"action_type": "FAIL", "parameters": {}}]


def test_the_record_names_the_leases_desktop_and_what_it_cost(tmp_path: Path) -> None:
    """TaskEnv's typed lease and usage reach the record and the results row as the same JSON as ever."""
    from osfarm.env import DesktopUsage
    from osfarm.runner.episode import EpisodeResult
    from osfarm.runner.results import write_task
    from osfarm.schema.lease import LeaseInfo
    from osfarm.schema.observation import ScreenSize
    from osfarm.stream.blobs import LocalBlobStore
    from osfarm.tasks.model import parse_task

    task = parse_task({"id": "t1", "instruction": "x", "config": [], "evaluator": {"func": "infeasible"}}, file="t")
    lease = LeaseInfo(id="l1", desktop_id="d1", created_at=0.0, expires_at=60.0, ttl_s=60.0, guest_url="/g",
                      screen=ScreenSize(width=8, height=8), provider="docker", image="img", desktop="light")
    res = EpisodeResult(task=task, status="success", score=1.0, error=None, episode_id="e1", attempt=1,
                        infra_retries=0, steps=[], started_at=1.0, finished_at=30.0, agent="replay", desktop=lease,
                        desktop_usage=DesktopUsage(cpu_s=1.5, reset="warm"))
    records: list[dict] = []
    row = write_task(tmp_path, res, "run", LocalBlobStore(tmp_path), emit=records.append)
    rec = check_record(records[0])
    assert rec["desktop"] == {"provider": "docker", "image": "img", "session": "light"}
    assert rec["desktop_cpu_s"] == 1.5 and rec["desktop_reset"] == "warm" and "desktop_reset_fallback" not in rec
    assert row["desktop"] == "light" and row["desktop_cpu_s"] == 1.5 and row["desktop_reset"] == "warm"
    no_lease = EpisodeResult(task=task, status="infra_error", score=0.0, error="lease", episode_id="e2", attempt=1,
                             infra_retries=0, steps=[], started_at=1.0, finished_at=2.0, agent="replay")
    write_task(tmp_path, no_lease, "run", LocalBlobStore(tmp_path), emit=records.append)
    assert records[1]["desktop"] == {"provider": "sandbox", "image": None, "session": None}
    assert not any(k.startswith("desktop_") for k in records[1])
