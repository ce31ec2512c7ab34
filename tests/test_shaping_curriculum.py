"""Reward shaping (parse-error and step penalties) and the curriculum (retire solved tasks, weight
the rest by difficulty): both off by default, their numbers checked by hand, and wired through
the data manager, the rollout controller and train.yaml."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from test_data_manager import Cfg, make_record

from osfarm.trainer.allocation import TaskStats
from osfarm.trainer.config import load_train_config
from osfarm.trainer.curriculum import Curriculum, difficulty_weight, round_tasks
from osfarm.trainer.data_manager import DataManager
from osfarm.trainer.distributed import DistContext
from osfarm.trainer.reward_shaping import parse_errors, shaped_reward
from osfarm.trainer.rollout_controller import ControllerConfig, RolloutController
from osfarm.trainer.run_wiring import controller_config, data_config


def _stats(*rewards: float) -> TaskStats:
    st = TaskStats()
    for r in rewards:
        st.add(r, r >= 1.0)
    return st


def _steps(n: int, unparsable: int) -> list[dict]:
    return [{"action_error": "parse error: no action in the reply" if i < unparsable else None} for i in range(n)]


def test_shaped_reward_numbers() -> None:
    steps = _steps(5, 2) + [{"action_error": "xdotool failed"}]  # an action that failed is not a parse error
    assert parse_errors(steps) == 2
    assert shaped_reward(1.0, steps) == 1.0  # off by default: the score
    # 1 − 2 × 0.1 − 6 × 0.01
    assert shaped_reward(1.0, steps, parse_error_penalty=0.1, step_penalty=0.01) == pytest.approx(0.74)
    assert shaped_reward(0.0, steps, parse_error_penalty=0.5) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="step_penalty"):
        shaped_reward(1.0, steps, step_penalty=-0.1)


def test_the_data_manager_trains_on_the_shaped_reward_and_keeps_the_score_in_task_stats(tmp_path: Path) -> None:
    dm = DataManager(Cfg(group_size=2, parse_error_penalty=0.25, step_penalty=0.05, use_pool=False),
                     blob_root=tmp_path)
    bad = make_record(tmp_path, status="success", steps=3)
    bad["steps"][0]["action_error"] = "parse error: no action"
    assert dm.add(bad) == "accepted" and dm.add(make_record(tmp_path, status="success", steps=2)) == "accepted"
    batch = dm.take_batch()
    assert sorted({s.reward for s in batch.samples}) == pytest.approx([1 - 0.25 - 3 * 0.05, 1 - 2 * 0.05])
    assert dm.task_stats["t1"].recent == [1.0, 1.0]  # the success rate is of the scores
    with pytest.raises(ValueError, match="step_penalty"):
        Cfg(step_penalty=-1)


def test_curriculum_numbers() -> None:
    stats = {"solved": _stats(*[1.0] * 8), "young": _stats(1.0, 1.0), "hard": _stats(0.0, 0.0, 1.0, 0.0)}
    tasks = ["solved", "young", "hard", "unseen"]
    rng = random.Random(0)
    assert round_tasks(tasks, stats, None, rng) == tasks and round_tasks(tasks, stats, Curriculum(), rng) == tasks
    retire = Curriculum(retire_at=0.9, min_episodes=8)
    assert round_tasks(tasks, stats, retire, rng) == ["young", "hard", "unseen"]  # young: 2 < 8 episodes
    assert round_tasks(["solved"], stats, retire, rng) == ["solved"]  # all retired: all come back
    c = Curriculum(by_difficulty=True, min_weight=0.2)
    assert difficulty_weight(stats["hard"], c) == pytest.approx(0.75)
    assert difficulty_weight(stats["young"], c) == pytest.approx(0.2)  # solved so far: the floor
    assert difficulty_weight(None, c) == 1.0
    joined = {t: 0 for t in tasks}
    for _ in range(2000):
        for t in round_tasks(tasks, stats, c, rng):
            joined[t] += 1
    assert joined["unseen"] == 2000
    assert joined["hard"] / 2000 == pytest.approx(0.75, abs=0.04)
    assert joined["solved"] / 2000 == pytest.approx(0.2, abs=0.04)


def test_the_controller_plans_no_group_for_a_retired_task() -> None:
    planned: list[str] = []

    async def submit(task: str, k: int, version: int, group_id: str) -> None:
        planned.append(task)

    stats = {"a": _stats(*[1.0] * 4)}
    ctl = RolloutController(["a", "b"], submit, ControllerConfig(
        batch_size=4, eta=0, allocator="fixed", group_size=2, curriculum=Curriculum(retire_at=1.0, min_episodes=4)),
        task_stats=stats)
    asyncio.run(ctl.fill())
    assert planned and set(planned) == {"b"}


def test_train_yaml_wires_shaping_and_curriculum(tmp_path: Path) -> None:
    f = tmp_path / "train.yaml"
    f.write_text("rollout: {curriculum: {retire_at: 0.9, by_difficulty: true}}\n"
                 "data: {options: {parse_error_penalty: 0.1, step_penalty: 0.01}}\n")
    cfg = load_train_config(f)
    dcfg = data_config(cfg, DistContext())
    assert (dcfg.parse_error_penalty, dcfg.step_penalty) == (0.1, 0.01)
    assert controller_config(cfg, dcfg).curriculum == Curriculum(retire_at=0.9, by_difficulty=True)
    f.write_text("rollout: {curriculum: {retire_at: 2}}\n")
    with pytest.raises(ValueError, match="rollout.curriculum.retire_at"):
        load_train_config(f)
