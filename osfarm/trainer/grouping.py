"""GRPO groups: which episodes train together, and whether a group carries a signal at all.

GRPO learns only from differences inside a group, so what makes a group decides what is learnt.
A planned group is exactly the rollouts the controller planned together; otherwise a group is
``n`` not-yet-used episodes of one task, n the task's dynamic rollout number (DART) unless
``group_size`` fixes it. The group is trimmed to the newest n keeping at least one success and
one failure when it has them; a group that is all failures swaps its oldest episode for the
newest stored success of that task from the experience pool (or is dropped this round when there
is none; failures with differing partial scores already carry a signal and train as they are); a
group whose mean reward reaches ``acc_max`` or whose rewards are all equal carries no GRPO signal
and is dropped (``drop_no_signal=False`` keeps it, with zero advantages).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from osfarm.trainer.advantages import grpo_advantages, sharpen_advantages
from osfarm.trainer.allocation import TaskStats, dart_rollout_n
from osfarm.trainer.data_config import DataConfig
from osfarm.trainer.episodes import Episode

CountFn = Callable[[str], None]  # (counter)
DiscardEpisodesFn = Callable[[str, list[Episode], str], None]  # (task_id, episodes, reason)


@dataclass(eq=False)
class PlannedGroup:
    """A group the rollout controller planned: its task, its size n and the episodes so far."""

    task_id: str
    size: int
    episodes: list[Episode] = field(default_factory=list)
    closed: bool = False
    order: int = 0  # planning order: a batch lists its groups in it, whichever closed first


@dataclass
class Group:
    task_id: str
    group_id: str
    episodes: list[Episode]
    advantages: list[float]


def group_size_for(config: DataConfig, stats: TaskStats | None) -> int:
    """A task's group size n: ``group_size`` when set, else its dynamic rollout number (DART)."""
    c = config
    if c.group_size is not None:
        return max(c.min_group_size, c.group_size)
    n = dart_rollout_n(stats.success_rate if stats else None, rollout_n=c.rollout_n, threshold=c.rollout_threshold)
    return max(c.min_group_size, n)


def choose(eps: list[Episode], n: int) -> list[Episode]:
    """The newest n, keeping at least one success and one failure when the candidates have them."""
    by_new = sorted(eps, key=lambda e: -e.seq)
    chosen = by_new[:n]
    for want in (True, False):
        if not any(e.success == want for e in chosen):
            extra = next((e for e in by_new[n:] if e.success == want), None)
            if extra is not None:  # all chosen are of the other kind: the oldest makes room
                chosen.remove(min(chosen, key=lambda e: e.seq))
                chosen.append(extra)
    return sorted(chosen, key=lambda e: e.seq)


def canonical_order(ep: Episode) -> tuple[float, str]:
    """An order of a group's episodes that does not depend on when each finished."""
    steps = [(s.get("model") or {}).get("response_token_ids") or (s.get("model") or {}).get("response_text")
             for s in ep.record.get("steps", [])]
    return (-ep.reward, json.dumps(steps))


def grpo_group(task: str, chosen: list[Episode], group_id: str, config: DataConfig,
               pool: dict[str, list[Episode]], count: CountFn, discard: DiscardEpisodesFn) -> Group | None:
    """GRPO group of ``chosen`` (the pool's success in for an all-failure group, no-signal
    groups dropped, advantages); None when it does not train (its episodes are discarded).
    ``count`` and ``discard`` are the data manager's: what is dropped here is counted there and
    its staleness capacity given back to the rollout controller."""
    c = config
    rewards = [e.reward for e in chosen]
    if max(rewards) == min(rewards) and not any(e.success for e in chosen):
        # all failures, no signal: the newest stored success of the task replaces the oldest
        stored = pool.get(task) if c.use_pool else None
        if not stored:
            count("groups_all_fail_dropped")
            discard(task, chosen, "all_fail")
            return None
        oldest, *rest = sorted(chosen, key=lambda e: e.seq)
        discard(task, [oldest], "replaced_by_pool")
        chosen = [*rest, stored[-1]]
        rewards = [e.reward for e in chosen]
        count("pool_replacements")
    if sum(rewards) / len(rewards) >= c.acc_max:
        count("groups_too_easy")
        if c.drop_no_signal:
            discard(task, chosen, "too_easy")
            return None
    elif max(rewards) == min(rewards):
        count("groups_zero_variance")
        if c.drop_no_signal:
            discard(task, chosen, "zero_variance")
            return None
    adv = grpo_advantages(rewards, std_normalize=c.std_normalize, eps=c.eps, unbiased=c.unbiased_std)
    if c.novelty_lambda > 0:
        adv = sharpen_advantages(adv, [e.success for e in chosen], [e.likelihood() for e in chosen],
                                 c.novelty_lambda)
    count("groups")
    return Group(task, group_id, chosen, adv)
