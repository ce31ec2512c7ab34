"""The training loop on real parts (in-process sandbox farm, `osfarm policy serve` subprocesses, the
tiny model), at the level where the loop's own bugs showed:

* two learner ranks (``osfarm train --nproc 2``: torchrun, gloo) at η = 0 with fixed groups: the
  planned groups are exactly the groups the learner trains on, the learner's log-probs of what the
  server sampled match the server's (kl_behav ≈ 0), the 2-rank checkpoints load in the policy
  server, the held-out evaluation runs every version and TensorBoard gets train and eval scalars;
* the experience pool reaches the learner: a task no rollout can solve, with a pre-collected
  success, trains (the all-failure group takes the pool's success, whose old version does not make
  it stale), a related unsolved task's rollouts carry it as an in-context exemplar (XRPO), and
  redundant rollouts leave groups of exactly n.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from osfarm.stream.blobs import LocalBlobStore
from osfarm.stream.jsonl import JsonlSink

pytestmark = pytest.mark.timeout(1200)
ROOT = Path(__file__).resolve().parent.parent
TRAIN_SUITE = ROOT / "tests" / "fixtures" / "train_suite"


def _rows(run: Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    p = run / name
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.is_file() else []


def _train(args: list[str], log: Path, state_dir: Path, timeout: float = 900) -> int:
    env = {**os.environ, "OSFARM_STATE_DIR": str(state_dir)}  # its own farm (one farm per state dir)
    with log.open("ab") as out:
        return subprocess.run([sys.executable, "-c", "from osfarm.cli import app; app()", "train", *args],
                              stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode


RANKS_CONFIG = """\
run_dir: {run}
updates: 2
max_episodes: 80
rollout:
  envs: 2
  eta: 0
  batch_size: 8
  max_steps: 1
  options: {{allocator: fixed, group_size: 4}}
agent: {{kind: choice, temperature: 0.1}}
learner: {{lr: 0.003, temperature: 0.1, micro_batch_size: 2}}
data:
  options: {{drop_no_signal: false}}
eval_every: 1
eval_suite: {suite}
eval_episodes: 2
metrics: {{plot: true, tensorboard: true}}
"""


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("ranks")
    cfg = base / "train.yaml"
    cfg.write_text(RANKS_CONFIG.format(run=base / "run", suite=TRAIN_SUITE))
    log = base / "train.log"
    rc = _train(["--config", str(cfg), "--nproc", "2"], log, base / "state")
    assert rc == 0, log.read_text()[-4000:]
    return {"dir": base / "run", "rows": _rows(base / "run"), "log": log.read_text()}


def test_two_ranks_train_the_planned_groups(ranks_run: dict[str, Any]) -> None:
    rows = ranks_run["rows"]
    assert [r["version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ranks"] == 2 and r["sync_ok"] and r["server_versions"] == [r["version"]]  # rank 0's checkpoint loaded
        assert r["group_sizes"] == [4, 4] and r["batch_episodes"] == 8  # the controller's groups, whole
        assert r["staleness_max"] == 0
    episodes = [json.loads(x) for x in (ranks_run["dir"] / "episodes.jsonl").read_text().splitlines()]
    per_group = Counter(e["group_id"] for e in episodes if e["status"] != "infra_error")
    assert per_group and all(n == 4 for n in per_group.values()), per_group  # one record per planned rollout


def test_eta_zero_logprobs_match_the_server(ranks_run: dict[str, Any]) -> None:
    """At η = 0 every sample comes from the weights the learner holds: the learner's log-probs of
    the sampled tokens (T-scaled, as the server's processed log-probs) are the server's."""
    for r in ranks_run["rows"]:
        assert abs(r["kl_behav"]) < 2e-3, r


def test_held_out_evaluation_and_tensorboard(ranks_run: dict[str, Any]) -> None:
    run = ranks_run["dir"]
    evals = _rows(run, "eval.jsonl")
    assert sorted(r["version"] for r in evals) == [0, 1, 2]
    assert all(r["episodes"] + r["infra_errors"] == 2 for r in evals)
    assert "eval version=2" in ranks_run["log"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/reward", "train/loss", "train/kl_behav", "eval/success_rate"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]
    assert (run / "curves.png").stat().st_size > 1000
    assert (run / "checkpoints" / "v2" / "model" / "model.safetensors").is_file()


# ---- the experience pool, in-context seeding, redundant rollouts -------------------------------------

UNSOLVABLE = {
    "snapshot": "os",
    "source": "osfarm test: no choice solves it (the pool's success is what trains)",
    "config": [{"type": "execute", "parameters": {"command": "rm -f /home/user/answer.txt", "shell": True}}],
    "related_apps": [],
    "evaluator": {
        "func": "check_include_exclude",
        "result": {"type": "vm_command_line", "command": "cat /home/user/answer.txt 2>/dev/null; true", "shell": True},
        "expected": {"type": "rule", "rules": {"include": ["solved"], "exclude": []}},
    },
}
E_ID, H_ID = "0e1f2a3b-0000-4000-8000-00000000000e", "0e1f2a3b-0000-4000-8000-00000000000f"


def _suite(root: Path) -> Path:
    suite = root / "suite"
    (suite / "os").mkdir(parents=True)
    for tid, what in ((E_ID, "Write the word solved into the file ~/answer.txt."),
                      (H_ID, "Write the word solved into the file ~/answer.txt, then stop.")):
        task = {"id": tid, "instruction": what, **UNSOLVABLE,
                "osfarm_choices": [f"open('/home/user/answer.txt', 'w').write('v{i:02d}')" for i in range(16)]}
        (suite / "os" / f"{tid}.json").write_text(json.dumps(task))
    # H's group is planned first, so its (seeded) episodes run before E's group completes the only
    # update; in E-first order the update could end the run before any of H's episodes had run
    (suite / "test_all.json").write_text(json.dumps({"os": [H_ID, E_ID]}))
    return suite


def _pool_run(root: Path) -> Path:
    """An eval run dir with one success of E: its request and its action (no token ids, as a
    replay or an earlier model's episode would have)."""
    run = root / "pre"
    blobs = LocalBlobStore(run)
    messages = [{"role": "system", "content": "You control a Linux desktop."},
                {"role": "user", "content": [{"type": "text", "text": "Write the word solved into ~/answer.txt.\n"
                                                                      "Actions:\n0: the right one\n"}]}]
    req = blobs.put(json.dumps(messages).encode(), "json", "application/json")
    shot = blobs.put(b"\x89PNG\r\n\x1a\n" + b"0" * 64, "png", "image/png")
    rec = {"schema": "osfarm.episode/1", "episode_id": "pre-collected-1", "run_id": "pre", "task_id": E_ID,
           "domain": "os", "group_id": E_ID, "attempt": 1, "agent": "replay",
           "policy": {"name": "earlier", "version_start": None, "version_end": None},
           "desktop": {"provider": "sandbox", "image": None}, "status": "success", "score": 1.0, "error": None,
           "started_at": "2026-01-01T00:00:00.000+00:00", "finished_at": "2026-01-01T00:00:09.000+00:00",
           "steps": [{"index": 1, "observation": {"screenshot": shot, "a11y": None},
                      "model": {"request": req, "response_text": "0", "response_token_ids": None,
                                "response_logprobs": None, "policy_version": None, "error": None},
                      "actions": ["open('/home/user/answer.txt', 'w').write('solved')", "DONE"],
                      "action_error": None, "t_model_ms": 1.0, "t_env_ms": 1.0}]}
    JsonlSink(run / "episodes.jsonl").publish(rec)
    return run


POOL_CONFIG = """\
run_dir: {run}
updates: 1
max_episodes: 60
suite: {suite}
pool_from: [{pool}]
rollout:
  envs: 2
  eta: 1
  batch_size: 4
  max_steps: 1
  seed_exemplars: true
  options: {{allocator: fixed, group_size: 4, redundancy: 1}}
agent: {{kind: choice, temperature: 0.1, screenshot: false}}
learner: {{lr: 0.003, temperature: 0.1}}
metrics: {{plot: false, tensorboard: false}}
"""


def test_the_pool_reaches_the_learner_and_seeds_unsolved_tasks(tmp_path: Path) -> None:
    suite, pool = _suite(tmp_path), _pool_run(tmp_path)
    cfg = tmp_path / "train.yaml"
    run = tmp_path / "run"
    cfg.write_text(POOL_CONFIG.format(run=run, suite=suite, pool=pool))
    log = tmp_path / "train.log"
    rc = _train(["--config", str(cfg)], log, tmp_path / "state")
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert "experience pool: 1 successful episode(s)" in text
    [row] = _rows(run)
    # E's group failed entirely: the pool's success took the oldest failure's place and trained
    # (before the fix the loop dropped it as stale, and the failures trained alone)
    assert row["version"] == 1 and row["pool_samples"] >= 1 and row["group_sizes"] == [4]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["totals"]["stale_dropped"] == 0
    state = json.loads((run / "checkpoints" / "v1" / "state" / "data_manager.json").read_text())
    assert state["counters"]["pool_replacements"] >= 1
    # H has no success anywhere: its rollouts were seeded with E's solved episode (XRPO), and its
    # all-failure groups, with nothing in the pool, were dropped
    episodes = [json.loads(x) for x in (run / "episodes.jsonl").read_text().splitlines()]
    seeded = 0
    for e in episodes:
        req = json.loads((run / e["steps"][0]["model"]["request"]["path"]).read_text())
        text = json.dumps(req)
        if "Example of a solved related task" in text:
            assert e["task_id"] == H_ID and "write('solved')" in text
            seeded += 1
    assert seeded >= 1
    # redundancy: n + 1 started per group, the first n kept
    per_group = Counter(e["group_id"] for e in episodes)
    assert all(n <= 5 for n in per_group.values()), per_group


# ---- the trainer's own policy server dies --------------------------------------------------------

DIES_CONFIG = """\
run_dir: {run}
updates: 3
max_episodes: 80
rollout: {{envs: 2, eta: 1, batch_size: 4, max_steps: 1, options: {{allocator: fixed, group_size: 4}}}}
agent: {{kind: choice, temperature: 0.1, screenshot: false}}
learner: {{lr: 0.003, temperature: 0.1}}
data:
  options: {{drop_no_signal: false}}
metrics: {{plot: false, tensorboard: false}}
"""


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def test_a_killed_policy_server_is_started_again(tmp_path: Path) -> None:
    """SIGKILL the policy server `osfarm train` started: it is started again on the same port with
    the latest checkpoint's weights, and the run still reaches its version."""
    import signal
    import time

    cfg = tmp_path / "train.yaml"
    run = tmp_path / "run"
    cfg.write_text(DIES_CONFIG.format(run=run))
    log = tmp_path / "train.log"
    env = {**os.environ, "OSFARM_STATE_DIR": str(tmp_path / "state")}
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", "from osfarm.cli import app; app()",
                                 "train", "--config", str(cfg)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while not _rows(run) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        servers = [c for c in _children(proc.pid)
                   if b"policy\x00serve" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(servers) == 1, log.read_text()[-3000:]
        os.kill(servers[0], signal.SIGKILL)
        rc = proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = " ".join(log.read_text().split())  # the console wraps long lines
    assert rc == 0, text[-3000:]
    assert "exited (-9): starting it again on version" in text
    assert [r["version"] for r in _rows(run)][-1] == 3
    assert json.loads((run / "summary.json").read_text())["totals"].get("policy_restarts") == 1
