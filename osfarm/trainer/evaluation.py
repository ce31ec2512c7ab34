"""Periodic evaluation on held-out tasks while training goes on.

Every ``eval_every`` versions (and at the start of a fresh run, for the baseline) each task of the
eval suite is run ``eval_episodes`` times with the policy the servers then serve. The episodes go
through the same scheduler as the training rollouts (the farm's desktops are shared, nothing
waits for them) but never reach the data manager. When all of a version's episodes are back its
result is a row of ``<run>/eval.jsonl`` — ``version``, ``success_rate``, ``reward``, ``episodes``,
``infra_errors``, ``policy_versions`` (the versions that answered: a server updated in place may
already serve a newer one when an episode starts) — printed, sent to TensorBoard / W&B and drawn
in ``curves.png`` next to the training reward.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class _Round:
    version: int
    expected: int
    scores: list[float] = field(default_factory=list)
    successes: int = 0
    infra_errors: int = 0
    started: float = field(default_factory=time.monotonic)
    versions: set[int] = field(default_factory=set)  # the versions that answered (weights may move on meanwhile)

    @property
    def done(self) -> int:
        return len(self.scores) + self.infra_errors


class EvalTracker:
    """Which versions are evaluated, and their results as they come in."""

    def __init__(self, run_dir: Path, tasks: list[str], every: int | None, episodes: int = 1):
        if every is not None and every < 1:
            raise ValueError(f"eval_every must be >= 1, got {every}")
        self.path = Path(run_dir) / "eval.jsonl"
        self.tasks = list(tasks)
        self.every = every
        self.episodes = episodes
        self.rounds: dict[int, _Round] = {}
        self.results: list[dict[str, Any]] = []

    @property
    def enabled(self) -> bool:
        return self.every is not None and bool(self.tasks)

    def due(self, version: int) -> bool:
        """Whether ``version`` gets evaluated (multiples of eval_every, 0 included; each once)."""
        if self.every is None or not self.tasks:
            return False
        return version % self.every == 0 and version not in self.rounds and not any(
            r.get("version") == version for r in self.read())

    def start(self, version: int) -> list[str]:
        """Open a round for ``version``; returns the task ids to run (each ``episodes`` times)."""
        todo = [t for t in self.tasks for _ in range(self.episodes)]
        self.rounds[version] = _Round(version, len(todo))
        return todo

    def add(self, version: int, status: str | None, score: float | None,
            answered_by: int | None = None) -> dict[str, Any] | None:
        """One eval episode of ``version`` ended (``status`` None: it crashed; ``answered_by``: the
        policy version of its first step); returns the round's row when it was the last."""
        r = self.rounds.get(version)
        if r is None:
            return None
        if answered_by is not None:
            r.versions.add(int(answered_by))
        if status is None or status == "infra_error":
            r.infra_errors += 1
        else:
            r.scores.append(float(score or 0.0))
            r.successes += status == "success"
        if r.done < r.expected:
            return None
        del self.rounds[version]
        row = {"time": time.time(), "version": version,
               "success_rate": r.successes / len(r.scores) if r.scores else None,
               "reward": sum(r.scores) / len(r.scores) if r.scores else None,
               "episodes": len(r.scores), "infra_errors": r.infra_errors, "policy_versions": sorted(r.versions),
               "seconds": round(time.monotonic() - r.started, 1)}
        self.results.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    @property
    def outstanding(self) -> int:
        return sum(r.expected - r.done for r in self.rounds.values())

    def read(self) -> list[dict[str, Any]]:
        return read_eval_rows(self.path)


def read_eval_rows(path: Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
