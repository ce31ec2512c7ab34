"""The rollout controller: which tasks to roll out, in which groups, and when (DART + AReaL + ROLL).

Planning: one round at a time, every task gets a **group** — n rollouts planned together, whose
finished episodes form exactly one GRPO group in the data manager (allocation = grouping):

* ``dart`` (default): n = DART's dynamic rollout number from the task's success rate;
* ``fixed``: n = ``group_size`` for every task — BroRL's broad groups are this with hundreds
  (the learner bounds memory with micro-batches, see learner.py);
* ``xrpo``: a rollout budget split over the tasks by XRPO's uncertainty-reduction priority, each
  task's share its group (at least ``min_group_size``).

A planned group is announced (``on_plan(group_id, task_id, n)``: the data manager expects it), its
rollouts handed to the farm through ``submit(task_id, k, version, group_id)`` the moment there is
room (rollout-wise, no batch barrier) and closed (``on_close(group_id)``) once it has n accepted
episodes or nothing of it runs any more. Room is AReaL's staleness capacity (staleness.py) counted
in rollouts: at most (η + 1)·batch_size accepted-but-not-trained or running, plus (when groups of
different sizes cannot tile a batch exactly) the largest group less one, so the learner, which
takes whole groups until it has a batch, is not left waiting for a group that may not start. A
group that lost rollouts (rejected, retries spent) can still leave a batch short: when nothing
runs and nothing may start (:meth:`blocked`) the learner trains on the closed groups it has.

ROLL's per-sample lifecycle: each rollout is reported back (:meth:`on_episode`: ``accepted`` as
training data, ``rejected`` — infra error, storage rules, a crash — or ``aborted`` when the trainer
cancelled it). ``redundancy`` starts that many rollouts more than a group needs; once n are
accepted the group closes and the trainer cancels the rest (keep the first that finish). A
rejected rollout is retried within its group, at most ``max_retries`` times per group. Every
accepted episode that ends up unused (its group dropped, gone stale) comes back through
:meth:`release`; every learner update reports what it consumed (:meth:`set_version`).

Counters, the version and the unsent queue persist as JSON (:meth:`save` / :meth:`load`); a
resumed controller applies AReaL's rule — nothing running, accepted = what was consumed plus the
episodes the data manager restored — so a restart cannot unbound staleness.
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
from osfarm.trainer.curriculum import Curriculum, round_tasks
from osfarm.trainer.staleness import StalenessGate, StalenessState

log = logging.getLogger("osfarm.trainer.rollouts")

STATE_SCHEMA = "osfarm.rollout_controller/2"
OLD_STATE_SCHEMAS = ("osfarm.rollout_controller/1",)
Submit = Callable[[str, int, int, str], Awaitable[None]]  # (task_id, rollouts, policy version, group_id)
OnPlan = Callable[[str, str, int], None]  # (group_id, task_id, size)
OnClose = Callable[[str], None]  # (group_id)
ACCEPTED, REJECTED, ABORTED = "accepted", "rejected", "aborted"


@dataclass
class ControllerConfig:
    batch_size: int  # accepted episodes one learner update consumes (whole groups: at least this many)
    eta: int = 1  # max staleness in versions (0 = synchronous)
    max_concurrent: int | None = None  # environments the farm runs at once (None: no limit)
    allocator: Literal["dart", "xrpo", "fixed"] = "dart"
    group_size: int = 8  # fixed: rollouts per task and group (BroRL: hundreds)
    min_group_size: int = 2  # a group smaller than this carries no GRPO signal
    rollout_n: int = 8
    rollout_threshold: float = 0.6
    xrpo_budget: int | None = None  # rollouts per XRPO round (None: rollout_n · tasks / 2)
    xrpo_base: int = 2
    xrpo_alpha: float = 0.05
    xrpo_lambda: float = 0.0
    redundancy: int = 0  # ROLL: rollouts started beyond a group's n; the first n accepted are kept
    max_retries: int = 2  # rejected rollouts re-run per group
    shuffle: bool = True  # task order within a round
    seed: int = 0
    retry_s: float = 2.0  # wait after a failed submit before trying again
    curriculum: Curriculum | None = None  # curriculum.py: which tasks join a round (None: all)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.eta < 0:
            raise ValueError(f"eta must be >= 0, got {self.eta}")
        if self.allocator not in ("dart", "xrpo", "fixed"):
            raise ValueError(f"allocator must be 'dart', 'xrpo' or 'fixed', got {self.allocator!r}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        if self.min_group_size < 2:
            raise ValueError(f"min_group_size must be >= 2, got {self.min_group_size}")
        if self.group_size < self.min_group_size:
            raise ValueError(f"group_size must be >= min_group_size ({self.min_group_size}), got {self.group_size}")
        if self.allocator == "xrpo" and self.xrpo_base < self.min_group_size:
            raise ValueError(f"xrpo_base must be >= min_group_size ({self.min_group_size}): every task's share is a "
                             f"GRPO group; got {self.xrpo_base}")
        if self.redundancy < 0 or self.max_retries < 0:
            raise ValueError(f"redundancy and max_retries must be >= 0, got {self.redundancy}, {self.max_retries}")


def plan_round(tasks: Sequence[str], stats: Mapping[str, TaskStats], config: ControllerConfig,
               n_for_task: Callable[[str], int] | None = None, rng: random.Random | None = None) -> list[list[Any]]:
    """One round of [task, n] groups (n ≥ min_group_size) in the order they will run."""
    order = list(tasks)
    if config.shuffle:
        (rng or random.Random(config.seed)).shuffle(order)
    if config.allocator == "xrpo":
        budget = config.xrpo_budget if config.xrpo_budget is not None else max(1, config.rollout_n * len(order) // 2)
        alloc = xrpo_allocate({t: list(stats[t].recent) if t in stats else [] for t in order}, budget,
                              base=config.xrpo_base, alpha=config.xrpo_alpha, lam=config.xrpo_lambda)
        return [[t, alloc[t]] for t in order if alloc[t] >= config.min_group_size]
    blocks = []
    for t in order:
        if n_for_task is not None:
            n = n_for_task(t)
        elif config.allocator == "fixed":
            n = config.group_size
        else:
            st = stats.get(t)
            n = dart_rollout_n(st.success_rate if st else None, rollout_n=config.rollout_n,
                               threshold=config.rollout_threshold)
        n = max(n, config.min_group_size)
        blocks.append([t, n])
    return blocks


@dataclass
class GroupRun:
    """The lifecycle of one planned group's rollouts."""

    group_id: str
    task_id: str
    size: int  # n: the rollouts the group needs
    to_start: int  # rollouts not handed to the farm yet (n + redundancy + retries granted)
    running: int = 0
    accepted: int = 0
    rejected: int = 0
    retries: int = 0
    closed: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RolloutController:
    def __init__(self, tasks: Sequence[str], submit: Submit, config: ControllerConfig, *,
                 task_stats: Mapping[str, TaskStats] | None = None, n_for_task: Callable[[str], int] | None = None,
                 on_plan: OnPlan | None = None, on_close: OnClose | None = None, state_path: Path | None = None):
        if not tasks:
            raise ValueError("the rollout controller needs at least one task")
        self.tasks = list(dict.fromkeys(tasks))
        self.submit_fn = submit
        self.config = config
        # shared with the data manager (its task_stats dict) so the plan follows the latest outcomes
        self.task_stats: Mapping[str, TaskStats] = task_stats if task_stats is not None else {}
        self.n_for_task = n_for_task
        self.on_plan = on_plan
        self.on_close = on_close
        self.state_path = Path(state_path) if state_path else None
        self.gate = StalenessGate(config.eta, config.batch_size, config.max_concurrent,
                                  StalenessState(consumed=0))
        self.queue: deque[GroupRun] = deque()  # groups with rollouts still to start, in order
        self.groups: dict[str, GroupRun] = {}  # groups not closed yet
        self.rounds = 0
        self.group_seq = 0
        self.submitted_by_task: dict[str, int] = {}
        self.released = 0
        self.closed_groups = 0
        self._rng = random.Random(config.seed)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ planning and submitting

    @property
    def version(self) -> int:
        return self.gate.state.version

    def slack(self) -> int:
        """Rollouts allowed beyond (η + 1)·batch_size: 0 when the groups tile a batch exactly (all
        of one size n dividing it), else the largest group less one (a batch is whole groups)."""
        sizes = {g.size for g in self.groups.values()} | {g.size for g in self.queue}
        if not sizes:
            return 0
        if len(sizes) == 1 and self.config.batch_size % next(iter(sizes)) == 0:
            return 0
        return max(sizes) - 1

    def capacity(self) -> int:
        return self.gate.capacity(self.slack())

    def blocked(self) -> bool:
        """Nothing runs and nothing may start: no episode will arrive before the learner trains on
        what it has (a group that lost rollouts can leave a batch short of a full one)."""
        return self.gate.state.running == 0 and self.capacity() <= 0

    def _plan(self) -> None:
        blocks = plan_round(round_tasks(self.tasks, self.task_stats, self.config.curriculum, self._rng),
                            self.task_stats, self.config, self.n_for_task, self._rng)
        if not blocks:
            raise RuntimeError("the allocator planned no group for any task")
        for task, n in blocks:
            self.group_seq += 1
            gid = f"{task}#g{self.group_seq}"
            g = GroupRun(gid, task, n, to_start=n + self.config.redundancy)
            self.groups[gid] = g
            self.queue.append(g)
            if self.on_plan is not None:
                self.on_plan(gid, task, n)
        self.rounds += 1

    async def fill(self) -> int:
        """Submit rollouts while the staleness capacity allows; returns how many were submitted."""
        sent = 0
        async with self._lock:
            while True:
                if self.capacity() <= 0:
                    break
                if not self.queue:
                    self._plan()
                g = self.queue[0]
                cap = self.capacity()  # planning may change the slack
                if cap <= 0:
                    break
                k = min(g.to_start, cap)
                self.gate.submit(k)  # reserve before awaiting, so a concurrent report sees it running
                g.running += k
                g.to_start -= k
                try:
                    await self.submit_fn(g.task_id, k, self.version, g.group_id)
                except BaseException:
                    self.gate.state.running -= k
                    self.gate.state.submitted -= k
                    g.running -= k
                    g.to_start += k
                    raise
                if g.to_start <= 0:
                    self.queue.popleft()
                self.submitted_by_task[g.task_id] = self.submitted_by_task.get(g.task_id, 0) + k
                sent += k
        return sent

    # ------------------------------------------------------------------ reports

    def on_episode(self, group_id: str, outcome: str) -> None:
        """A rollout of ``group_id`` ended: ``accepted`` (the data manager took it), ``rejected``
        (not training data, or it crashed) or ``aborted`` (the trainer cancelled it)."""
        if outcome not in (ACCEPTED, REJECTED, ABORTED):
            raise ValueError(f"outcome must be accepted, rejected or aborted, got {outcome!r}")
        if outcome == ACCEPTED:
            self.gate.accept()
        else:
            self.gate.reject()
        g = self.groups.get(group_id)
        if g is not None:
            g.running = max(0, g.running - 1)
            if outcome == ACCEPTED:
                g.accepted += 1
            else:
                g.rejected += 1
                if g.retries < self.config.max_retries and g.accepted + g.running + g.to_start < g.size:
                    g.retries += 1  # ROLL's retry: the group still needs it
                    g.to_start += 1
                    if g not in self.queue:
                        self.queue.appendleft(g)
            self._maybe_close(g)
        self._wake.set()

    def _maybe_close(self, g: GroupRun) -> None:
        done = g.accepted >= g.size or (g.running == 0 and g.to_start == 0)
        if not done or g.closed:
            return
        g.closed = True
        self.closed_groups += 1
        self.groups.pop(g.group_id, None)
        if g in self.queue:  # a redundant rollout never started: not needed any more
            self.queue.remove(g)
        if self.on_close is not None:
            self.on_close(g.group_id)

    def running_of(self, group_id: str) -> int:
        g = self.groups.get(group_id)
        return g.running if g else 0

    def release(self, n: int = 1) -> None:
        """``n`` accepted episodes will never be trained on (dropped group, gone stale): without
        this the capacity would stay taken and the learner could wait for a batch forever."""
        n = min(n, self.gate.state.accepted)
        self.gate.state.accepted -= n
        self.gate.state.rejected += n
        self.released += n
        self._wake.set()

    def set_version(self, version: int, consumed: int | None = None) -> None:
        """The learner reached ``version``; ``consumed``: the accepted episodes its update trained
        on (default: one batch, AReaL's accounting)."""
        self.gate.set_version(version)
        self.gate.consume(self.config.batch_size if consumed is None else consumed)
        self._wake.set()
        if self.state_path:
            self.save(self.state_path)

    def consume(self, n: int) -> None:
        """Episodes trained on without a new version (an update skipped for a non-finite gradient)."""
        self.gate.consume(n)
        self._wake.set()

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
        return {"schema": STATE_SCHEMA, "gate": asdict(self.gate.state),
                "queue": [[g.task_id, g.to_start] for g in self.queue],
                "rounds": self.rounds, "group_seq": self.group_seq, "submitted_by_task": self.submitted_by_task,
                "released": self.released, "closed_groups": self.closed_groups, "eta": self.config.eta,
                "batch_size": self.config.batch_size}

    def state_json(self) -> str:
        """The state as JSON text: a snapshot, safe to write from another thread."""
        return json.dumps(self.state(), indent=1)

    def save(self, path: Path | None = None, text: str | None = None) -> Path:
        p = Path(path or self.state_path or "rollout_controller.json")
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(text if text is not None else self.state_json())
        tmp.replace(p)
        return p

    def load(self, path: Path | None = None, *, pending: int = 0) -> bool:
        """Restore counters; False when there is no state file. ``pending``: accepted episodes the
        data manager restored (they will still train, so they hold capacity)."""
        p = Path(path or self.state_path or "rollout_controller.json")
        if not p.is_file():
            return False
        try:
            d = json.loads(p.read_text())
            if d.get("schema") not in (STATE_SCHEMA, *OLD_STATE_SCHEMAS):
                raise ValueError(f"schema {d.get('schema')!r}, expected {STATE_SCHEMA}")
            g = d["gate"]
            version = int(g["version"])
            consumed = g.get("consumed")
            consumed = version * self.config.batch_size if consumed is None else int(consumed)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}: not a rollout controller state ({e}); delete it to start afresh") from None
        # AReaL's resume rule: what was consumed (and what still waits to train), nothing in flight;
        # the groups that were running died with the process, so the next round is planned afresh
        self.gate.state = StalenessState(version=version, accepted=consumed + pending, running=0,
                                         rejected=int(g.get("rejected", 0)), submitted=int(g.get("submitted", 0)),
                                         consumed=consumed)
        self.queue.clear()
        self.groups.clear()
        self.rounds = int(d.get("rounds", 0))
        self.group_seq = int(d.get("group_seq", 0))
        self.submitted_by_task = {str(k): int(v) for k, v in d.get("submitted_by_task", {}).items()}
        self.released = int(d.get("released", 0))
        self.closed_groups = int(d.get("closed_groups", 0))
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
