"""``osfarm train`` with ``data.options: {granularity: episode}`` end to end: real multi-step
episodes from the session farm's desktops, the choice agent's real prompts and the CPU policy
server's real replies and log-probs, two synchronous updates.

What tests/test_episode_sequence.py cannot show with hand-built episodes: that the real agent's
history makes each step's prompt the one before it plus its reply (the choice agent keeps the
whole episode once granularity is episode: train.yaml's history default), that the data manager
joins those records, and that the learner's one sequence per episode is the policy's own: at
η = 0 its log-probs of every trained turn are the server's (kl_behav ≈ 0). The tiny model samples
byte tokens whose text ('\\ufffd') encodes to other ids: those turns train apart, each on its own
prompt, and are counted; the test checks the count against the records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from osfarm.farm.server import FarmServer
from osfarm.policy.processing import load_processor
from osfarm.policy.tiny import tiny_model_dir
from osfarm.trainer.learner import Learner, latest_checkpoint

pytestmark = pytest.mark.timeout(600)

STEPS = 3
TASK = {
    "id": "3c5e7a90-1b2d-4f60-9a8e-0d2c4b6f8a13",
    "snapshot": "os",
    "instruction": "Get the letter C into the file ~/answer.txt; each of your three actions appends one letter.",
    "source": "osfarm test: a three-step choice task (granularity episode, tests/test_train_episode.py)",
    "config": [{"type": "execute", "parameters": {"command": "rm -f /home/user/answer.txt", "shell": True}}],
    "related_apps": [],
    "osfarm_choices": [f"open('/home/user/answer.txt', 'a').write('{c}')" for c in "ABCD"],
    "osfarm_choice_steps": STEPS,
    "evaluator": {
        "func": "check_include_exclude",
        "result": {"type": "vm_command_line", "command": "cat /home/user/answer.txt 2>/dev/null; true", "shell": True},
        "expected": {"type": "rule", "rules": {"include": ["C"], "exclude": []}},
    },
}
CONFIG = """\
run_dir: {run}
updates: 2
max_episodes: 24
seed: 3
suite: {suite}
farm: {{url: {url}, token: {token}}}
rollout:
  envs: 2
  eta: 0
  batch_size: 4
  max_steps: {steps}
  options: {{allocator: fixed, group_size: 4}}
agent: {{kind: choice, temperature: 0.7}}
learner: {{lr: 0.003, temperature: 0.7}}
data:
  # every step trains (no high-entropy selection), so every turn of a batch is accounted for
  options: {{granularity: episode, drop_no_signal: false, entropy_fraction: 1.0}}
metrics: {{prometheus_port: 0}}
"""


@pytest.fixture(scope="module")
def episode_run(farm: FarmServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("episode")
    suite = base / "suite"
    (suite / "choice").mkdir(parents=True)
    (suite / "choice" / f"{TASK['id']}.json").write_text(json.dumps(TASK))
    (suite / "test_all.json").write_text(json.dumps({"choice": [TASK["id"]]}))
    cfg = base / "train.yaml"
    cfg.write_text(CONFIG.format(run=base / "run", suite=suite, url=farm.url, token=farm.token, steps=STEPS))
    log = base / "train.log"
    with log.open("ab") as out:
        rc = subprocess.run([sys.executable, "-c", "from osfarm.cli import app; app()", "train", "--config", str(cfg)],
                            stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ), timeout=500).returncode
    assert rc == 0, log.read_text()[-4000:]
    run = base / "run"
    return {"dir": run, "rows": [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x],
            "episodes": [json.loads(x) for x in (run / "episodes.jsonl").read_text().splitlines() if x]}


def _trained(episodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The episodes the two updates trained: the groups with a success (a group of failures only
    is dropped; at η = 0 each update trains one whole group and nothing rolls out after the last)."""
    solved = sorted({e["group_id"] for e in episodes if e["status"] == "success"},
                    key=lambda g: int(g.rpartition("#g")[2]))[:2]  # groups are planned g1, g2, ... in order
    return [e for e in episodes if e["group_id"] in solved and e["status"] in ("success", "failure")]


def test_whole_episodes_train_as_one_sequence_each(episode_run: dict[str, Any]) -> None:
    rows = episode_run["rows"]
    assert [r["version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["sync_ok"] and r["server_versions"] == [r["version"]] and r["staleness_max"] == 0
        fallbacks = {k: v for k, v in r.items() if k.startswith("episode_fallback_")}
        # only re-tokenised byte replies: single turns apart, or a whole episode when one turn is left in place
        assert set(fallbacks) <= {"episode_fallback_turn_retokenized", "episode_fallback_reply_retokenized"}, r
        assert r["episode_samples"] > 0
        assert r["episode_samples"] + r.get("episode_fallback_reply_retokenized", 0) == r["batch_episodes"] == 4, r
        # the learner's log-probs of the joined sequences are the server's, turn by turn
        assert abs(r["kl_behav"]) < 2e-3, r
    # every sampled token trained once (one token per turn): in place or apart, none twice, none lost
    last = rows[-1]["counters"]
    trained = _trained(episode_run["episodes"])
    assert len(trained) == 8 and all(len(e["steps"]) == STEPS for e in trained)
    assert last["tokens"] == 8 * STEPS and last["samples"] < last["tokens"]


def test_turns_trained_apart_are_the_replies_that_do_not_encode_back(episode_run: dict[str, Any]) -> None:
    """A turn trains apart exactly when its reply's text, in the chat template as the next prompt
    holds it, does not encode back to the id sampled."""
    proc = load_processor(tiny_model_dir())

    def ids(messages: list[dict[str, str]], prompt: bool) -> list[int]:
        text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        return list(proc.tokenizer(text)["input_ids"])

    apart = 0
    for e in _trained(episode_run["episodes"]):
        for st in e["steps"][:-1]:  # the last turn's sampled ids close the sequence: always in place
            m = st["model"]
            ask = [{"role": "user", "content": "next?"}]
            before = ids(ask, True)
            after = ids([*ask, {"role": "assistant", "content": m["response_text"]}, *ask], True)
            apart += after[len(before):len(before) + len(m["response_token_ids"])] != m["response_token_ids"]
    rows = episode_run["rows"]
    assert apart == sum(r.get("episode_fallback_turn_retokenized", 0) + 2 * r.get(
        "episode_fallback_reply_retokenized", 0) for r in rows)


def test_the_checkpoint_resumes(episode_run: dict[str, Any]) -> None:
    ckpt = latest_checkpoint(episode_run["dir"] / "checkpoints")
    assert ckpt is not None and ckpt.name == "v2"
    learner, state = Learner.resume(ckpt)
    assert learner.version == 2 and state["version"] == 2 and learner.counters["tokens"] == 8 * STEPS
