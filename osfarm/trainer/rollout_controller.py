"""The rollout controller: which tasks to roll out, how many times, and when (DART + AReaL).

Rollout-wise scheduling (DART): a queue of (task, n) blocks, planned one round at a time — every
task with its dynamic rollout number (DART) or a budget split by the XRPO allocator — is fed to
the farm through ``submit(task_id, n, policy_version)`` the moment there is room, with no batch
barrier. Room is AReaL's staleness capacity (staleness.py): at most (η + version + 1)·batch_size
rollouts accepted or running, and at most ``max_concurrent`` running.

The caller reports every finished episode (:meth:`on_episode`: accepted as training data or
not), every learner update (:meth:`set_version`) and every accepted episode that ended up unused
(:meth:`release`: its group was dropped or it went stale), so the capacity opens again. A
rejected rollout (infra error, storage rules) is re-queued at the front for the same task, at
most ``max_requeue`` times in a row, so the task's group can still fill.

Counters, the version and the unsent queue persist as JSON (:meth:`save` / :meth:`load`); a
resumed controller applies AReaL's rule (accepted = version·batch_size, nothing running), so a
restart cannot unbound staleness.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from osfarm.trainer.allocation import TaskStats, dart_rollout_n, xrpo_allocate
from osfarm.trainer.staleness import (
    StalenessGate,
    StalenessState,
    accepted_after_resume,
)

log = logging.getLogger("osfarm.trainer.rollouts")

STATE_SCHEMA = "osfarm.rollout_controller/1"
Submit = Callable[[str, int, int], Awaitable[None]]  # (task_id, rollouts, policy version)


@dataclass
class ControllerConfig:
    batch_size: int  # accepted episodes one learner update consumes
    eta: int = 1  # max staleness in versions (0 = synchronous)
    max_concurrent: int | None = None  # environments the farm runs at once (None: no limit)
    allocator: Literal["dart", "xrpo"] = "dart"
    rollout_n: int = 8
    rollout_threshold: float = 0.6
    xrpo_budget: int | None = None  # rollouts per XRPO round (None: rollout_n · tasks / 2)
    xrpo_base: int = 2
    xrpo_alpha: float = 0.05
    xrpo_lambda: float = 0.0
    max_requeue: int = 2  # re-runs of a rejected rollout in a row, per task
    shuffle: bool = True  # task order within a round
    seed: int = 0
    retry_s: float = 2.0  # wait after a failed submit before trying again

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.eta < 0:
            raise ValueError(f"eta must be >= 0, got {self.eta}")
        if self.allocator not in ("dart", "xrpo"):
            raise ValueError(f"allocator must be 'dart' or 'xrpo', got {self.allocator!r}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")


def plan_round(tasks: Sequence[str], stats: Mapping[str, TaskStats], config: ControllerConfig,
               n_for_task: Callable[[str], int] | None = None, rng: random.Random | None = None) -> list[list[Any]]:
    """One round of [task, n] blocks (n > 0) in the order they will run."""
    order = list(tasks)
    if config.shuffle:
        (rng or random.Random(config.seed)).shuffle(order)
    if config.allocator == "xrpo":
        budget = config.xrpo_budget if config.xrpo_budget is not None else max(1, config.rollout_n * len(order) // 2)
        alloc = xrpo_allocate({t: list(stats[t].recent) if t in stats else [] for t in order}, budget,
                              base=config.xrpo_base, alpha=config.xrpo_alpha, lam=config.xrpo_lambda)
        return [[t, alloc[t]] for t in order if alloc[t] > 0]
    blocks = []
    for t in order:
        if n_for_task is not None:
            n = n_for_task(t)
        else:
            st = stats.get(t)
            n = dart_rollout_n(st.success_rate if st else None, rollout_n=config.rollout_n,
                               threshold=config.rollout_threshold)
        if n > 0:
            blocks.append([t, n])
    return blocks


class RolloutController:
    def __init__(self, tasks: Sequence[str], submit: Submit, config: ControllerConfig, *,
                 task_stats: Mapping[str, TaskStats] | None = None, n_for_task: Callable[[str], int] | None = None,
                 state_path: Path | None = None):
        if not tasks:
            raise ValueError("the rollout controller needs at least one task")
        self.tasks = list(dict.fromkeys(tasks))
        self.submit_fn = submit
        self.config = config
        # shared with the data manager (its task_stats dict) so the plan follows the latest outcomes
        self.task_stats: Mapping[str, TaskStats] = task_stats if task_stats is not None else {}
        self.n_for_task = n_for_task
        self.state_path = Path(state_path) if state_path else None
        self.gate = StalenessGate(config.eta, config.batch_size, config.max_concurrent)
        self.queue: deque[list[Any]] = deque()
        self.rounds = 0
        self.submitted_by_task: dict[str, int] = {}
        self.requeues: dict[str, int] = {}
        self.released = 0
        self._rng = random.Random(config.seed)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ planning and submitting

    @property
    def version(self) -> int:
        return self.gate.state.version

    def capacity(self) -> int:
        return self.gate.capacity()

    def _next_block(self) -> list[Any]:
        if not self.queue:
            blocks = plan_round(self.tasks, self.task_stats, self.config, self.n_for_task, self._rng)
            if not blocks:
                raise RuntimeError("the allocator planned no rollouts for any task")
            self.queue.extend(blocks)
            self.rounds += 1
        return self.queue[0]

    async def fill(self) -> int:
        """Submit rollouts while the staleness capacity allows; returns how many were submitted."""
        sent = 0
        async with self._lock:
            while (cap := self.gate.capacity()) > 0:
                block = self._next_block()
                task, n = block[0], min(block[1], cap)
                self.gate.submit(n)  # reserve before awaiting, so a concurrent report sees it running
                try:
                    await self.submit_fn(task, n, self.version)
                except BaseException:
                    self.gate.state.running -= n
                    self.gate.state.submitted -= n
                    raise
                block[1] -= n
                if block[1] <= 0:
                    self.queue.popleft()
                self.submitted_by_task[task] = self.submitted_by_task.get(task, 0) + n
                sent += n
        return sent

    # ------------------------------------------------------------------ reports

    def on_episode(self, task_id: str, accepted: bool) -> None:
        """A rollout finished: ``accepted`` when it became training data (the data manager's
        ``add`` returned "accepted"); otherwise its slot is given back and the task re-queued."""
        if accepted:
            self.gate.accept()
            self.requeues[task_id] = 0
        else:
            self.gate.reject()
            if task_id in self.tasks and self.requeues.get(task_id, 0) < self.config.max_requeue:
                self.requeues[task_id] = self.requeues.get(task_id, 0) + 1
                if self.queue and self.queue[0][0] == task_id:
                    self.queue[0][1] += 1
                else:
                    self.queue.appendleft([task_id, 1])
        self._wake.set()

    def release(self, n: int = 1) -> None:
        """``n`` accepted episodes will never be trained on (dropped group, gone stale): without
        this the capacity would stay taken and the learner could wait for a batch forever."""
        n = min(n, self.gate.state.accepted)
        self.gate.state.accepted -= n
        self.gate.state.rejected += n
        self.released += n
        self._wake.set()

    def set_version(self, version: int) -> None:
        self.gate.set_version(version)
        self._wake.set()
        if self.state_path:
            self.save(self.state_path)

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the farm busy until ``stop`` is set: fill whenever a report opens capacity."""
        while not stop.is_set():
            self._wake.clear()
            try:
                await self.fill()
            except Exception as e:  # noqa: BLE001 - the queue may be down for a moment: retry, keep the loop
                log.warning("submitting rollouts failed (%s); retrying in %.1f s", e, self.config.retry_s)
                await _wait_any(stop, None, self.config.retry_s)
                continue
            await _wait_any(stop, self._wake, None)

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        return {"schema": STATE_SCHEMA, "gate": asdict(self.gate.state), "queue": [list(b) for b in self.queue],
                "rounds": self.rounds, "submitted_by_task": self.submitted_by_task, "requeues": self.requeues,
                "released": self.released, "eta": self.config.eta, "batch_size": self.config.batch_size}

    def save(self, path: Path | None = None) -> Path:
        p = Path(path or self.state_path or "rollout_controller.json")
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.state(), indent=1))
        tmp.replace(p)
        return p

    def load(self, path: Path | None = None) -> bool:
        """Restore counters and the unsent queue; False when there is no state file."""
        p = Path(path or self.state_path or "rollout_controller.json")
        if not p.is_file():
            return False
        try:
            d = json.loads(p.read_text())
            if d.get("schema") != STATE_SCHEMA:
                raise ValueError(f"schema {d.get('schema')!r}, expected {STATE_SCHEMA}")
            g = d["gate"]
            version = int(g["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}: not a rollout controller state ({e}); delete it to start afresh") from None
        # AReaL's resume rule: what versions 0..v−1 consumed, nothing in flight
        self.gate.state = StalenessState(version=version, accepted=accepted_after_resume(version, self.config.batch_size),
                                         running=0, rejected=int(g.get("rejected", 0)),
                                         submitted=int(g.get("submitted", 0)))
        self.queue = deque([str(t), int(n)] for t, n in d.get("queue", []) if t in self.tasks and int(n) > 0)
        self.rounds = int(d.get("rounds", 0))
        self.submitted_by_task = {str(k): int(v) for k, v in d.get("submitted_by_task", {}).items()}
        self.requeues = {str(k): int(v) for k, v in d.get("requeues", {}).items()}
        self.released = int(d.get("released", 0))
        return True


async def _wait_any(stop: asyncio.Event, wake: asyncio.Event | None, timeout: float | None) -> None:
    waits = [asyncio.ensure_future(stop.wait())]
    if wake is not None:
        waits.append(asyncio.ensure_future(wake.wait()))
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
