"""The curriculum: which tasks join a planning round of the rollout controller.

Off by default (every task, every round). ``retire_at`` retires a task once its recent success
rate reaches it over at least ``min_episodes`` episodes: its groups would have no GRPO signal and
only cost desktop time. ``by_difficulty`` lets a task join a round with probability
max(``min_weight``, 1 − success rate), so hard tasks get more rollouts than nearly solved ones
(a task not seen yet always joins). When every task is retired they all come back: a run that
has solved its suite keeps its updates going rather than stalling on an empty plan.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from osfarm.trainer.allocation import TaskStats


class Curriculum(BaseModel):
    model_config = ConfigDict(extra="forbid")

    retire_at: float | None = Field(default=None, gt=0, le=1, description="retire a task whose recent success "
                                    "rate reaches this (None: never)")
    min_episodes: int = Field(default=8, ge=1, description="retire_at: episodes a task needs before it can retire")
    by_difficulty: bool = Field(default=False, description="a task joins a round with probability "
                                "max(min_weight, 1 - its success rate)")
    min_weight: float = Field(default=0.1, gt=0, le=1, description="by_difficulty: the least chance of a task")

    @property
    def active(self) -> bool:
        return self.retire_at is not None or self.by_difficulty


def retired(stats: TaskStats | None, c: Curriculum) -> bool:
    if c.retire_at is None or stats is None or stats.success_rate is None:
        return False
    return len(stats.recent) >= c.min_episodes and stats.success_rate >= c.retire_at


def difficulty_weight(stats: TaskStats | None, c: Curriculum) -> float:
    """A task's chance to join a round (1 before its first episode)."""
    rate = stats.success_rate if stats is not None else None
    return 1.0 if rate is None else max(c.min_weight, 1.0 - rate)


def round_tasks(tasks: Sequence[str], stats: Mapping[str, TaskStats], c: Curriculum | None,
                rng: random.Random) -> list[str]:
    """The tasks of the next round, in ``tasks``' order (at least one)."""
    if c is None or not c.active:
        return list(tasks)
    live = [t for t in tasks if not retired(stats.get(t), c)] or list(tasks)
    if not c.by_difficulty:
        return live
    weights = {t: difficulty_weight(stats.get(t), c) for t in live}
    chosen = [t for t in live if rng.random() < weights[t]]
    return chosen or [max(live, key=lambda t: weights[t])]
