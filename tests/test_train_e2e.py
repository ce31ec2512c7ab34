"""``osfarm train`` end to end on the CPU: real sandbox desktops, a real policy server subprocess,
the tiny model, the choice suite (tests/fixtures/train_suite), its real evaluator.

Two runs:

* asynchronous (η = 1) to version 4, killed with SIGKILL once version 2 is logged and resumed with
  the same command: versions, resume, per-step versions, the staleness bound, weight sync;
* synchronous (η = 0) to version 5, for the learning assertion (the reward of the episodes sampled
  by version 0 against those of the last versions). It is reproducible: every request carries a
  seed derived from the config's seed and the rollout's number, at η = 0 every rollout of version v
  samples from weights v, the prompt has no screenshot (a desktop's pixels, e.g. its clock, differ
  from run to run), groups are planned (fixed n), a batch lists them in plan order and their
  episodes by content, and the CPU update is deterministic — so the run makes the same episodes and
  the same updates each time, and the assertion cannot pass or fail by chance (the η = 1 run's
  reward depends on which version each request happens to reach, so it is not asserted there).
  Only an infra error (a desktop that failed, retried with a new seed) changes the sequence.
  version each request happens to reach, so it is not asserted there). Only an infra error (a
  desktop that failed, retried with a new seed) changes the sequence.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from osfarm.trainer.learner import latest_checkpoint, read_state

pytestmark = [pytest.mark.acceptance, pytest.mark.timeout(1500)]

ETA = 1
UPDATES = 4
KILL_AFTER = 2
LEARN_UPDATES = 5
CONFIG = """\
run_dir: {run}
updates: {updates}
max_episodes: 200
rollout:
  envs: 2
  eta: {eta}
  batch_size: 8
  max_steps: 1
agent:
  kind: choice
  temperature: 0.1
learner:
  lr: 0.003
  temperature: 0.1
data:
  options:
    # the choice task is often solved by version 2; its all-success groups still train (zero
    # advantages), so the run reaches `updates` instead of waiting for a signal that never comes
    drop_no_signal: false
metrics:
  prometheus_port: 0
"""

LEARN_CONFIG = """\
run_dir: {run}
updates: {updates}
max_episodes: 200
seed: 0
rollout:
  envs: 2
  eta: 0
  batch_size: 8
  max_steps: 1
  options: {{allocator: fixed, group_size: 8}}
agent:
  kind: choice
  temperature: 0.1
  screenshot: false  # a desktop's pixels (its clock) differ from run to run; the choice needs none
learner:
  lr: 0.003
  temperature: 0.1
data:
  options:
    drop_no_signal: false
metrics:
  plot: false
"""


def _rows(run: Path) -> list[dict[str, Any]]:
    p = run / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.is_file() else []


def _train(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OSFARM_STATE_DIR": os.environ.get("OSFARM_STATE_DIR", "/tmp/of-h7")}
    return subprocess.Popen([sys.executable, "-c", "from osfarm.cli import app; app()", "train", "--config", str(cfg)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("train")
    run_dir = base / "run"
    cfg = base / "train.yaml"
    cfg.write_text(CONFIG.format(run=run_dir, updates=UPDATES, eta=ETA))
    log = base / "train.log"
    proc = _train(cfg, log)
    deadline = time.monotonic() + 900
    try:
        while not any(r["version"] >= KILL_AFTER for r in _rows(run_dir)):
            if proc.poll() is not None:
                pytest.fail(f"osfarm train exited {proc.returncode} before version {KILL_AFTER}:\n"
                            f"{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no version {KILL_AFTER} in 900 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)  # a crash: no chance to save anything more
        proc.wait()
    killed_rows = _rows(run_dir)
    killed_state = read_state(latest_checkpoint(run_dir / "checkpoints"))
    proc = _train(cfg, log)
    try:
        rc = proc.wait(900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, log.read_text()[-3000:]
    return {"dir": run_dir, "killed_rows": killed_rows, "killed_state": killed_state, "rows": _rows(run_dir),
            "log": log.read_text()}


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("learn")
    cfg = base / "train.yaml"
    cfg.write_text(LEARN_CONFIG.format(run=base / "run", updates=LEARN_UPDATES))
    log = base / "train.log"
    proc = _train(cfg, log)
    try:
        rc = proc.wait(900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, log.read_text()[-3000:]
    return {"dir": base / "run", "rows": _rows(base / "run")}


def _episodes(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "episodes.jsonl").read_text().splitlines() if x.strip()]


def test_versions_advance_to_the_end(run: dict[str, Any]) -> None:
    state = read_state(latest_checkpoint(run["dir"] / "checkpoints"))
    assert state["version"] == UPDATES
    versions = [r["version"] for r in run["rows"]]
    assert sorted(set(versions)) == list(range(1, UPDATES + 1)), versions
    assert all(r["sync_ok"] and r["server_versions"] == [r["version"]] for r in run["rows"])
    assert (run["dir"] / "curves.png").stat().st_size > 1000
    assert "osfarm_train_reward" in (run["dir"] / "metrics.prom").read_text()


def test_resume_keeps_version_and_counters(run: dict[str, Any]) -> None:
    killed = run["killed_state"]
    assert killed["version"] >= KILL_AFTER
    assert "resumed from" in run["log"]
    after = [r for r in run["rows"][len(run["killed_rows"]):]]
    first = after[0]
    assert first["version"] == killed["version"] + 1
    # the learner's counters went on from the checkpoint, not from zero
    assert first["counters"]["updates"] == killed["counters"]["updates"] + 1
    assert first["counters"]["samples"] > killed["counters"]["samples"]
    ckpt = latest_checkpoint(run["dir"] / "checkpoints")
    dm_before = json.loads((ckpt / "state" / "data_manager.json").read_text())
    assert dm_before["counters"]["records"] > 0
    rc = json.loads((ckpt / "state" / "rollout_controller.json").read_text())
    assert rc["gate"]["version"] == UPDATES
    # AReaL's resume rule kept the staleness bound: what was accepted and not trained on never
    # exceeds (η + 1)·batch, plus the slack of one group less one (DART's n: 8)
    assert rc["gate"]["accepted"] - rc["gate"]["consumed"] <= (ETA + 1) * 8 + 7


def test_every_step_carries_a_policy_version(run: dict[str, Any]) -> None:
    eps = [e for e in _episodes(run["dir"]) if e["status"] != "infra_error"]
    assert len(eps) >= 8 * UPDATES
    for e in eps:
        assert e["steps"], e["episode_id"]
        for s in e["steps"]:
            m = s["model"]
            assert isinstance(m["policy_version"], int), (e["episode_id"], s["index"])
            assert m["response_token_ids"] and len(m["response_logprobs"]) == len(m["response_token_ids"])
        assert e["policy"]["version_start"] is not None and e["policy"]["version_end"] is not None
    assert {s["model"]["policy_version"] for e in eps for s in e["steps"]} >= {0, 1}
    assert {e["action_timing"] for e in eps} == {"settle"}  # rollout.action_timing's default


def test_staleness_never_exceeds_eta(run: dict[str, Any]) -> None:
    for r in run["rows"]:
        # a row's samples trained the update from version r-1 to r
        assert r["staleness_max"] <= ETA, r
        assert all((r["version"] - 1) - v <= ETA for v in r["sample_versions"]), r


def test_server_logprobs_change_after_a_sync(run: dict[str, Any], tmp_path: Path) -> None:
    import asyncio

    import httpx

    from osfarm.policy.client import PolicyServer
    from osfarm.policy.process import PolicyProcess
    from osfarm.policy.tiny import tiny_model_dir
    from osfarm.trainer.weight_sync import WeightSync

    proc = PolicyProcess(tiny_model_dir(), 0, "policy", tmp_path / "policy.log")
    body = {"model": "policy", "max_tokens": 1, "temperature": 0.0, "logprobs": True, "top_logprobs": 3,
            "messages": [{"role": "user", "content": "Write the letter C into the file ~/answer.txt."}]}

    async def scenario() -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
        await proc.wait_ready(120)
        async with httpx.AsyncClient(timeout=60) as c:
            before = (await c.post(f"{proc.url}/v1/chat/completions", json=body)).json()
            ckpt = latest_checkpoint(run["dir"] / "checkpoints")
            # a dead server first: it fails within its health timeout, the live one is still synced
            dead = PolicyServer(url="http://127.0.0.1:9", health_timeout_s=1.0, timeout_s=5.0)
            sync = WeightSync([dead, PolicyServer(url=proc.url)])
            results = await sync.sync(ckpt, UPDATES)
            assert not results[0].ok and "127.0.0.1:9" in (results[0].error or "")
            assert sync.versions == {dead.url: None, proc.url: UPDATES} and sync.min_version() is None
            results = results[1:]
            after = (await c.post(f"{proc.url}/v1/chat/completions", json=body)).json()
        return before, results, after

    try:
        before, results, after = asyncio.run(scenario())
    finally:
        proc.stop()
    assert results[0].ok, results[0].error
    assert before["policy_version"] == 0 and after["policy_version"] == UPDATES
    lp_before = before["choices"][0]["logprobs"]["content"][0]
    lp_after = after["choices"][0]["logprobs"]["content"][0]
    tops_before = {t["token"]: t["logprob"] for t in lp_before["top_logprobs"]}
    tops_after = {t["token"]: t["logprob"] for t in lp_after["top_logprobs"]}
    assert tops_before != tops_after


def test_reward_rises(learning_run: dict[str, Any]) -> None:
    """The learning test: episodes sampled by the initial policy vs by the last two versions (a
    reproducible run: see the module's docstring)."""
    eps = [e for e in _episodes(learning_run["dir"]) if e["status"] in ("success", "failure")]
    by_v: dict[int, list[float]] = {}
    for e in eps:
        by_v.setdefault(e["policy"]["version_start"], []).append(float(e["score"]))
    early = by_v.get(0, [])
    late = [x for v, xs in by_v.items() if v >= LEARN_UPDATES - 2 for x in xs]
    table = {v: (len(xs), round(sum(xs) / len(xs), 3)) for v, xs in sorted(by_v.items())}
    print(f"reward by policy version (episodes, mean): {table}")
    assert len(early) >= 8 and len(late) >= 8, table
    m_early, m_late = sum(early) / len(early), sum(late) / len(late)
    assert m_late >= m_early + 0.25, table
    # synchronous: every sample of an update came from the version it updated
    assert all(r["staleness_max"] == 0 and abs(r["kl_behav"]) < 2e-3 for r in learning_run["rows"])


def test_bad_config_names_file_and_line(tmp_path: Path) -> None:
    cfg = tmp_path / "train.yaml"
    cfg.write_text("updates: 2\nrollout:\n  envs: 2\n  eta: -1\n")
    r = subprocess.run([sys.executable, "-c", "from osfarm.cli import app; app()", "train", "--config", str(cfg)],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert f"{cfg}:4: rollout.eta" in r.stderr.replace("\n", "")
    assert "Traceback" not in r.stderr
    cfg.write_text("updates: 2\nlearning_rate: 3\n")
    r = subprocess.run([sys.executable, "-c", "from osfarm.cli import app; app()", "train", "--config", str(cfg)],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"{cfg}:2: learning_rate" in r.stderr.replace("\n", "")
