"""The metrics row of one policy update (a line of ``metrics.jsonl``): what the farm did since the
previous update (a :class:`Window` of finished episodes and busy time) next to what the update
did (its samples and their staleness, the learner's statistics, the weight sync).

The trainer (``loop.py``) keeps one window open, adds every finished training episode to it, and
at each update closes it into a row with :func:`update_row` and opens the next.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from osfarm.trainer.data_manager import Batch, Sample
from osfarm.trainer.learner import UpdateStats
from osfarm.trainer.weight_sync import SyncResult


@dataclass
class Window:
    """What happened since the previous update (the metrics of the next row)."""

    started: float = field(default_factory=time.monotonic)
    episodes: int = 0
    scores: list[float] = field(default_factory=list)
    successes: int = 0
    infra_errors: int = 0
    env_busy_s: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)

    def add(self, rec: dict[str, Any] | None, outcome: str, started: float, finished: float) -> None:
        """One finished training episode (``rec``: its osfarm.episode/1 record, None when it failed)."""
        self.episodes += 1
        self.env_busy_s += overlap(started, finished, self.started, finished)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if rec is None or rec["status"] == "infra_error":
            self.infra_errors += 1
            return
        self.scores.append(float(rec["score"] or 0.0))
        self.successes += rec["status"] == "success"


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    """Length of the intersection of the intervals [a0, a1] and [b0, b1]."""
    return max(0.0, min(a1, b1) - max(a0, b0))


def staleness_of(samples: list[Sample], version: int) -> list[int]:
    return [version - int(s.policy_version) for s in samples if s.policy_version is not None and not s.from_pool]


def update_row(w: Window, now: float, running_since: Iterable[float], stats: UpdateStats, samples: list[Sample],
               stale: list[int], batch: Batch, results: list[SyncResult], *, update_s: float, sync_s: float,
               capacity: int, envs: int, eta: int, ranks: int, counters: dict[str, Any],
               last_eval: dict[str, Any] | None) -> dict[str, Any]:
    """The row of the update that closes window ``w`` at ``now`` (``running_since``: when the
    episodes still running started; ``last_eval``: the latest held-out evaluation, if any)."""
    wall = max(1e-9, now - w.started)
    # episodes still running were busy in this window too (the next window counts the rest)
    w.env_busy_s += sum(overlap(t0, now, w.started, now) for t0 in running_since)
    row: dict[str, Any] = {
        "version": stats.version,
        "reward": sum(w.scores) / len(w.scores) if w.scores else None,
        "success_rate": w.successes / len(w.scores) if w.scores else None,
        "episodes": w.episodes,
        "infra_errors": w.infra_errors,
        "episodes_per_s": w.episodes / wall,
        "env_utilisation": w.env_busy_s / (envs * wall),
        "samples": len(samples),
        "samples_per_s": len(samples) / wall,
        "batch_reward": sum(s.reward for s in samples) / len(samples),
        "batch_episodes": batch.size,
        "batch_rollouts": batch.episodes,
        "pool_samples": sum(1 for s in samples if s.from_pool),
        "staleness_max": max(stale) if stale else 0,
        "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
        "staleness_hist": {str(k): stale.count(k) for k in sorted(set(stale))},  # samples per staleness
        "sample_versions": sorted({s.policy_version for s in samples
                                   if s.policy_version is not None and not s.from_pool}),
        "loss": stats.loss,
        "kl": stats.extra.get("loss/approx_kl"),
        "kl_behav": stats.extra.get("loss/behav_kl"),
        "entropy": stats.entropy,
        "grad_norm": stats.grad_norm,
        "clip_frac": stats.extra.get("loss/clip_frac"),
        "lr": stats.lr,
        "skipped_steps": stats.skipped_steps,
        "update_s": update_s,
        "sync_s": sync_s,
        "sync_ok": all(r.ok for r in results),
        "server_versions": [r.version for r in results if r.ok],
        "groups": len(batch.groups),
        "group_sizes": [len(g.episodes) for g in batch.groups],
        "capacity": capacity,
        "outcomes": w.outcomes,
        "eta": eta,
        "ranks": ranks,
        "counters": counters,
    }
    if "episode_samples" in batch.counts:  # granularity episode: what trained as one sequence, and why not
        row.update(episode_row(batch.counts, stats.extra))
    if last_eval is not None:
        row["eval_version"], row["eval_success_rate"] = last_eval["version"], last_eval["success_rate"]
    return row


def episode_row(joined: dict[str, int], trained: dict[str, float]) -> dict[str, int]:
    """``episode_samples``: the episodes the update trained as one sequence; ``episode_fallback_<reason>``:
    those trained per step instead, whether the data manager could not join them (``joined``: the
    batch's counts) or the learner found the joined sequence not the policy's own (``trained``: the
    update's extras), and ``episode_fallback_turn_retokenized`` the single turns trained apart."""
    row = {"episode_samples": int(trained.get("episode_samples", 0))}
    for counts in (joined, trained):
        for k, v in counts.items():
            if k.startswith("episode_fallback_"):
                row[k] = row.get(k, 0) + int(v)
    return row
