"""Recipe details of issue 28: seeded (XRPO) successes are not the task's own, a run whose every
group is dropped says it is starving, and the reply budget follows the agent's prompt format."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_data_manager import Cfg, make_record

from osfarm.trainer.config import load_train_config
from osfarm.trainer.data_manager import STARVING_GROUPS, DataManager
from osfarm.trainer.run_wiring import rollout_agent_options


@pytest.fixture
def run(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


def test_a_seeded_success_is_not_the_tasks_own(run: Path) -> None:
    """A rollout with a solved task's episode in its prompt (``seeded``) trains with its group,
    but the task stays unsolved (no success in its stats, nothing in the experience pool), so it
    keeps being seeded; the seeded successes are counted apart."""
    dm = DataManager(Cfg(group_size=2), blob_root=run)
    seeded = make_record(run, status="success")
    seeded["seeded"] = True
    assert dm.add(seeded) == "accepted"
    assert dm.add(make_record(run, status="failure")) == "accepted"
    st = dm.task_stats["t1"]
    assert st.successes == 0 and st.episodes == 1  # the failure alone: the task's own rollouts
    assert not dm.pool.get("t1") and dm.counters["seeded_successes"] == 1
    batch = dm.take_batch()
    assert len(batch.groups) == 1 and len(batch.samples) == 4  # it still trains with its group
    dm.add(make_record(run, status="success"))  # an unseeded success is the task's own
    assert dm.task_stats["t1"].successes == 1 and dm.pool.get("t1")


def test_a_run_whose_every_group_is_dropped_says_it_is_starving(run: Path, caplog: pytest.LogCaptureFixture) -> None:
    dm = DataManager(Cfg(group_size=2, use_pool=False), blob_root=run)
    with caplog.at_level(logging.WARNING, logger="osfarm.trainer.data"):
        for _ in range(STARVING_GROUPS + 3):  # all-failure groups: no signal, each dropped
            dm.add(make_record(run, status="failure"))
            dm.add(make_record(run, status="failure"))
            assert dm.take_batch().groups == []
    assert dm.counters["starving"] == 1 and dm.dropped_in_a_row == STARVING_GROUPS + 3
    warnings = [r.getMessage() for r in caplog.records if "starving" in r.getMessage()]
    assert len(warnings) == 1 and f"last {STARVING_GROUPS} groups" in warnings[0], warnings
    dm.add(make_record(run, status="success"))
    dm.add(make_record(run, status="failure"))
    assert len(dm.take_batch().groups) == 1 and dm.dropped_in_a_row == 0  # a group trains: the streak ends


def test_the_reply_budget_follows_the_prompt_format(tmp_path: Path) -> None:
    """64 tokens (the old default) cut UI-TARS's thought + action replies."""
    f = tmp_path / "train.yaml"
    f.write_text("agent: {kind: vlm, prompt_format: uitars}\n")
    assert rollout_agent_options(load_train_config(f).agent, "http://127.0.0.1:1", "policy")["max_tokens"] == 1024
    f.write_text("agent: {kind: vlm, prompt_format: pyautogui}\n")
    assert rollout_agent_options(load_train_config(f).agent, "http://127.0.0.1:1", "policy")["max_tokens"] == 512
    f.write_text("agent: {kind: vlm, prompt_format: uitars, max_tokens: 300}\n")
    assert rollout_agent_options(load_train_config(f).agent, "http://127.0.0.1:1", "policy")["max_tokens"] == 300


def test_a_trimmed_context_keeps_no_behaviour_logprobs_of_the_prompt_it_was_not(run: Path) -> None:
    """``context_turns`` cuts a step's request shorter than the agent sent it: the recorded log-probs
    were of the longer prompt, so the sample carries none (the learner takes π_prox, weight 1);
    a step whose request was not cut keeps its own."""
    dm = DataManager(Cfg(group_size=2, context_turns=0), blob_root=run)
    dm.add(make_record(run, status="success", steps=2))
    dm.add(make_record(run, status="failure", steps=2))
    by_step = {s.step_index: s for s in dm.take_batch().samples}
    assert by_step[1].behav_logprobs == [-0.5, -0.5, -0.5]  # step 1 had no history: nothing cut
    assert by_step[2].behav_logprobs is None and [m["role"] for m in by_step[2].messages][-2:] == ["user", "user"]
