"""The data manager: finished episodes in, GRPO-grouped training samples out (DART's curation).

Episodes (``osfarm.episode/1`` records, from a run dir's JSONL, a Redis Stream or plain dicts)
pass DART's storage rules, update their task's statistics and wait until their group can be
formed. **Planned groups** (the trainer's case): the rollout controller plans each group — a task
and its number of rollouts n, from DART's dynamic n, XRPO's allocation, a fixed n or a BroRL-broad
n — registers it here (:meth:`expect_group`), tags every rollout with the group's id (the record's
``group_id``) and closes the group once its rollouts are done (:meth:`close_group`): the group is
exactly the rollouts that were planned together, so allocation and grouping always agree.
Records of no planned group (a stream fed by independent workers) are grouped per task instead.
Either way only episodes inside the version window count (policy_version ≥ current − window),
and every episode is used at most once. How a group is chosen and when it carries no signal:
grouping.py; what its episodes become for the learner: samples.py.

Storage rules (DART): infra errors and failed model calls are not training data; failures (and
timeouts) are kept only if they ran at least ``min_failure_steps`` steps; a record seen twice
(a redelivered stream entry) counts once. Everything skipped is counted in :attr:`counters`.

State (task statistics, pending episodes, seen ids, counters, version) is checkpointed with
:meth:`save_state` and restored with :meth:`load_state` (data_state.py); the experience pool
(experience_pool.py) lives as one JSON file per task in ``pool_dir`` and can be pre-loaded from an
eval run dir's ``episodes.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncIterable, Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from osfarm.schema.episode import SchemaError, check_record
from osfarm.stream.consumer import CLAIM_IDLE_MS, GroupSource
from osfarm.trainer.allocation import TaskStats
from osfarm.trainer.data_config import DataConfig
from osfarm.trainer.data_state import STATE_FILE, STATE_SCHEMA, atomic_write, read_state
from osfarm.trainer.episodes import (
    Episode,
    episode_version,
    episode_version_end,
    steps_with_model_data,
    steps_with_request,
)
from osfarm.trainer.experience_pool import eval_successes, keep_success, load_pool, write_task_file
from osfarm.trainer.grouping import Group, PlannedGroup, canonical_order, choose, group_size_for, grpo_group
from osfarm.trainer.reward_shaping import shaped_reward
from osfarm.trainer.samples import Batch, EntropyFn, Sample, SampleBuilder
from osfarm.trainer.staleness import in_version_window
from osfarm.trainer.stream_intake import AddedFn, consume_records, consume_redis

# the trainer loop imports these from here (Batch, DataConfig and Sample live in modules of their own)
__all__ = ["ACCEPTED", "Batch", "DataConfig", "DataManager", "Sample"]

log = logging.getLogger("osfarm.trainer.data")

# add() outcomes
ACCEPTED = "accepted"
SKIP_REASONS = ("invalid", "duplicate", "infra_error", "model_error", "short_failure", "timeout",
                "no_model_data", "no_version", "stale", "late")

DiscardFn = Callable[[str, int, str], None]  # (task_id, episodes, reason)
# groups dropped in a row (no signal, all failed, too small) while a batch waits, none kept, before
# the run is said to be starving: it would otherwise roll out forever without training
STARVING_GROUPS = 8


class DataManager:
    def __init__(self, config: DataConfig | None = None, *, blob_root: Path | None = None,
                 pool_dir: Path | None = None, entropy_fn: EntropyFn | None = None, version: int = 0,
                 on_discard: DiscardFn | None = None):
        self.config = config or DataConfig()
        self.blob_root = str(Path(blob_root).resolve()) if blob_root else None
        self.pool_dir = Path(pool_dir) if pool_dir else None
        self.entropy_fn = entropy_fn
        # accepted episodes that will never train (dropped group, gone stale): the rollout
        # controller's release(n) gives their staleness capacity back
        self.on_discard = on_discard
        self.version = version
        self.task_stats: dict[str, TaskStats] = {}
        self.pending: dict[str, list[Episode]] = {}
        self.pool: dict[str, list[Episode]] = load_pool(self.pool_dir) if self.pool_dir else {}
        self.seen: set[str] = set()
        self.counters: dict[str, int] = {k: 0 for k in ("records", ACCEPTED, *SKIP_REASONS, "groups", "groups_too_easy",
                                                        "groups_zero_variance", "groups_all_fail_dropped",
                                                        "pool_replacements", "samples", "entropy_filtered",
                                                        "steps_skipped", "pool_added", "stale_steps",
                                                        "groups_too_small", "pool_samples", "starving",
                                                        "seeded_successes")}
        self.planned: dict[str, PlannedGroup] = {}  # planned groups by id (open, then closed)
        self.closed: deque[str] = deque()  # closed planned groups, in closing order, not yet trained
        self._seq = 0
        self._group_seq = 0
        self._plan_seq = 0
        self._arrived = asyncio.Event()  # set when an episode is accepted (get_batch waits on it)
        self.dropped_in_a_row = 0  # groups formed and dropped since the last one kept

    # ------------------------------------------------------------------ intake

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def _discard(self, task: str, eps: list[Episode], reason: str) -> None:
        n = sum(1 for e in eps if not e.from_pool)
        if n and self.on_discard is not None:
            self.on_discard(task, n, reason)

    def add(self, record: dict[str, Any], blob_root: Path | str | None = None) -> str:
        """Take one finished episode; returns ``"accepted"`` or the reason it is not training data."""
        root = str(Path(blob_root).resolve()) if blob_root else self.blob_root
        if root is None:
            raise ValueError("the data manager needs the dir the record's blobs are relative to: pass blob_root")
        self._count("records")
        try:
            check_record(record)
        except SchemaError as e:
            log.warning("episode record skipped: %s", e)
            self._count("invalid")
            return "invalid"
        eid = record["episode_id"]
        if eid in self.seen:
            self._count("duplicate")
            return "duplicate"
        self.seen.add(eid)
        status = record["status"]
        if status == "infra_error":
            self._count("infra_error")
            return "infra_error"
        if any(s.get("model") and s["model"].get("error") for s in record["steps"]):
            self._count("model_error")
            return "model_error"
        if status == "timeout" and not self.config.timeout_as_failure:
            self._count("timeout")
            return "timeout"
        task = record["task_id"]
        reward = float(record["score"] or 0.0)
        success = status == "success"
        # XRPO: a seeded rollout had a solved task's episode in its prompt: it trains with its group,
        # but it is not the task's own success (the task stays unsolved and keeps being seeded)
        seeded = bool(record.get("seeded"))
        if seeded:
            self._count("seeded_successes", int(success))
        else:
            self.task_stats.setdefault(task, TaskStats(window=self.config.stats_window)).add(
                reward, success, len(record["steps"]))
        shaped = shaped_reward(reward, record["steps"], parse_error_penalty=self.config.parse_error_penalty,
                               step_penalty=self.config.step_penalty)  # the task stats above keep the score
        ep = Episode(record, root, shaped, success, episode_version(record), self._next_seq(),
                     version_end=episode_version_end(record))
        if success and not seeded and self.config.use_pool and steps_with_request(record):
            self._pool_add(ep)
        if not success and len(record["steps"]) < self.config.min_failure_steps:
            self._count("short_failure")
            return "short_failure"
        if not steps_with_model_data(record):
            self._count("no_model_data")
            return "no_model_data"
        if self.config.version_window is not None:
            if self._staleness_version(ep) is None:
                self._count("no_version")
                return "no_version"
            if not self._in_window(ep):
                self._count("stale")
                return "stale"
        planned = self.planned.get(record.get("group_id") or "")
        if planned is not None and planned.closed:  # a redundant rollout that finished after its group closed
            self._count("late")
            return "late"
        if planned is not None:
            planned.episodes.append(ep)
        else:
            self.pending.setdefault(task, []).append(ep)
        self._count(ACCEPTED)
        self._arrived.set()
        return ACCEPTED

    def _staleness_version(self, ep: Episode) -> int | None:
        return ep.version_end if self.config.episode_version == "end" else ep.version

    def _in_window(self, ep: Episode) -> bool:
        if self.config.version_window is None or ep.from_pool:
            return True
        return in_version_window(self._staleness_version(ep), self.version, self.config.version_window)

    # ------------------------------------------------------------------ planned groups

    def expect_group(self, group_id: str, task_id: str, size: int) -> None:
        """The rollout controller planned ``size`` rollouts of ``task_id`` as one group; their
        records carry ``group_id``."""
        if size < 1:
            raise ValueError(f"group {group_id}: size must be >= 1, got {size}")
        if group_id in self.planned:
            raise ValueError(f"group {group_id} is already planned")
        self._plan_seq += 1
        self.planned[group_id] = PlannedGroup(task_id, size, order=self._plan_seq)

    def close_group(self, group_id: str) -> None:
        """The group's rollouts are done (finished, failed for good, or cancelled as redundant): it
        trains with the episodes it has, at the next batch."""
        p = self.planned.get(group_id)
        if p is None or p.closed:
            return
        p.closed = True
        self.closed.append(group_id)
        self._arrived.set()

    def pending_episodes(self) -> int:
        """Accepted episodes not yet trained on or discarded (they count against the staleness capacity)."""
        return (sum(len(eps) for eps in self.pending.values())
                + sum(len(p.episodes) for p in self.planned.values()))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def consume(self, records: AsyncIterable[dict[str, Any]] | Iterable[dict[str, Any]],
                      blob_root: Path | None = None, on_added: AddedFn | None = None) -> int:
        """Add every record of a (sync or async) iterable; a blocking iterable is read in a thread.

        ``on_added(record, outcome)`` is called after each (e.g. to tell the rollout controller
        whether the episode was accepted). Returns how many records were read.
        """
        return await consume_records(self, records, blob_root, on_added)

    async def consume_redis(self, source: GroupSource, blob_root: Path | None = None, *,
                            journal: Path | None = None, stop: Callable[[], bool] | None = None,
                            on_added: AddedFn | None = None, block_ms: int = 1000,
                            claim_idle_ms: int = CLAIM_IDLE_MS) -> int:
        """Read a :class:`osfarm.stream.redis_stream.RedisStreamSource` until ``stop()``.

        Each entry is written to ``journal`` (fsynced; default ``<blob root>/stream-journal.jsonl``)
        and acknowledged before it is added (:class:`osfarm.stream.consumer.StreamConsumer`): a
        trainer killed at any moment loses nothing and takes nothing twice. At the start, journaled
        records this state has not seen (added after the last checkpoint) are added again; entries
        of dead consumers are reclaimed on a timer; invalid entries go to the dead-letter stream."""
        return await consume_redis(self, source, blob_root, journal=journal, stop=stop, on_added=on_added,
                                   block_ms=block_ms, claim_idle_ms=claim_idle_ms)

    def set_version(self, version: int) -> int:
        """The learner's new version; pending episodes now outside the window are dropped (returned)."""
        if version < self.version:
            raise ValueError(f"policy version went backwards: {self.version} -> {version}")
        self.version = version
        dropped = 0
        if self.config.version_window is None:
            return 0
        for task, eps in self.pending.items():
            keep = [e for e in eps if self._in_window(e)]
            dropped += len(eps) - len(keep)
            self.pending[task] = keep
            if len(keep) < len(eps):
                self._discard(task, [e for e in eps if e not in keep], "stale")
        for p in self.planned.values():
            keep = [e for e in p.episodes if self._in_window(e)]
            if len(keep) < len(p.episodes):
                dropped += len(p.episodes) - len(keep)
                self._discard(p.task_id, [e for e in p.episodes if e not in keep], "stale")
                p.episodes = keep
        self._count("stale", dropped)
        return dropped

    # ------------------------------------------------------------------ experience pool

    def _pool_add(self, ep: Episode) -> None:
        task = ep.record["task_id"]
        entries = keep_success(self.pool, ep, self.config.pool_per_task)
        self._count("pool_added")
        if self.pool_dir:
            write_task_file(self.pool_dir, task, entries)

    def preload_pool(self, run_dir: Path) -> int:
        """Put the successful episodes of an eval run dir (``episodes.jsonl``) in the pool; returns how many."""
        n = 0
        for ep in eval_successes(run_dir, self._next_seq):
            self._pool_add(ep)
            n += 1
        return n

    # ------------------------------------------------------------------ groups

    def group_size(self, task: str) -> int:
        return group_size_for(self.config, self.task_stats.get(task))

    def ready_tasks(self) -> list[str]:
        """Tasks with enough unused in-window episodes for a group (oldest waiting first)."""
        ready = [(eps[0].seq, t) for t, eps in self.pending.items() if eps and len(eps) >= self.group_size(t)]
        return [t for _, t in sorted(ready)]

    def form_groups(self, max_groups: int | None = None) -> list[Group]:
        """Form up to ``max_groups`` groups from the ready tasks (records of no planned group);
        their episodes count as used."""
        groups: list[Group] = []
        for task in self.ready_tasks():
            if max_groups is not None and len(groups) >= max_groups:
                break
            eps = self.pending.pop(task)
            chosen = choose(eps, self.group_size(task))
            picked = {id(e) for e in chosen}
            unused = [e for e in eps if id(e) not in picked]
            if unused:
                self.pending[task] = unused
            self._group_seq += 1
            g = self._make_group(task, chosen, f"{task}@v{self.version}#{self._group_seq}")
            if g is not None:
                groups.append(g)
        return groups

    def take_planned(self, episodes: int | None = None) -> list[Group]:
        """Groups of the closed planned groups, in closing order, until they hold ``episodes``
        episodes (None: all of them)."""
        groups: list[Group] = []
        order: dict[str, int] = {}
        got = 0
        while self.closed and (episodes is None or got < episodes):
            gid = self.closed.popleft()
            p = self.planned.pop(gid)
            order[gid] = p.order
            eps = [e for e in p.episodes if self._in_window(e)]
            if len(eps) < len(p.episodes):
                self._count("stale", len(p.episodes) - len(eps))
                self._discard(p.task_id, [e for e in p.episodes if e not in eps], "stale")
            if len(eps) < self.config.min_group_size:
                self._count("groups_too_small")
                self._discard(p.task_id, eps, "too_small")
                continue
            chosen = choose(eps, p.size)
            extra = [e for e in eps if e not in chosen]
            if extra:  # a redundant rollout accepted before the others were cancelled
                self._discard(p.task_id, extra, "redundant")
            # by content, not arrival: the same episodes give the same samples in the same order
            chosen.sort(key=canonical_order)
            g = self._make_group(p.task_id, chosen, gid)
            if g is not None:
                groups.append(g)
                got += len(g.episodes)
        # the order they were planned in, not the order they happened to finish in: the same
        # episodes make the same batch (entropy-selection ties, summation order), run after run
        return sorted(groups, key=lambda g: order[g.group_id])

    def _make_group(self, task: str, chosen: list[Episode], group_id: str) -> Group | None:
        g = grpo_group(task, chosen, group_id, self.config, self.pool, self._count, self._discard)
        self.dropped_in_a_row = 0 if g is not None else self.dropped_in_a_row + 1
        if g is None and self.dropped_in_a_row == STARVING_GROUPS:
            self._count("starving")
            log.warning("the run is starving: the last %d groups were all dropped (no reward signal, all failed or "
                        "too small) and none trains; counters: %s", STARVING_GROUPS,
                        {k: v for k, v in self.counters.items() if k.startswith("groups_") and v})
        return g

    # ------------------------------------------------------------------ batches

    def build_samples(self, groups: list[Group]) -> Batch:
        """Samples of the groups (reads blobs: call from a worker thread in async code), with
        high-entropy selection applied over the whole batch."""
        return SampleBuilder(self.config, self.entropy_fn).build(groups, self.version)

    def take_batch(self, max_groups: int | None = None) -> Batch:
        """Form groups (closed planned ones, then per task) and build their samples now (synchronous)."""
        groups = self.take_planned() if max_groups is None else []
        if max_groups is not None:
            while len(groups) < max_groups and self.closed:
                groups += self.take_planned(1)
        groups += self.form_groups(None if max_groups is None else max(0, max_groups - len(groups)))
        batch = self.build_samples(groups)
        self._merge(batch.counts)
        return batch

    def _take(self, episodes: int) -> list[Group]:
        """Groups holding up to about ``episodes`` episodes: closed planned groups first (whole
        groups: the last may overshoot), then per-task groups."""
        groups = self.take_planned(episodes)
        got = sum(len(g.episodes) for g in groups)
        while got < episodes:
            more = self.form_groups(1)
            if not more:
                break
            groups += more
            got += len(more[0].episodes)
        return groups

    async def get_batch(self, episodes: int, *, timeout_s: float | None = None,
                        flush: Callable[[], bool] | None = None, poll_s: float = 0.5) -> Batch:
        """Wait until whole groups holding at least ``episodes`` episodes are formed (or
        ``timeout_s`` passes, or ``flush()`` says nothing more can come: then the groups formed so
        far, possibly none), then build their samples in a worker thread."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        groups: list[Group] = []
        got = 0
        while True:
            self._arrived.clear()
            new = self._take(episodes - got)
            groups += new
            got += sum(len(g.episodes) for g in new)
            if got >= episodes or (groups and flush is not None and flush()):
                break
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                break
            wait = poll_s if flush is not None and (left is None or left > poll_s) else left
            try:
                await asyncio.wait_for(self._arrived.wait(), wait)
            except TimeoutError:
                if wait is not None and wait == left:
                    break
        batch = await asyncio.to_thread(self.build_samples, groups)
        self._merge(batch.counts)
        return batch

    def _merge(self, counts: dict[str, int]) -> None:
        for k, v in counts.items():
            self._count(k, v)

    # ------------------------------------------------------------------ checkpoint

    def state(self) -> dict[str, Any]:
        return {"schema": STATE_SCHEMA, "version": self.version, "counters": dict(self.counters),
                "task_stats": {t: s.to_json() for t, s in self.task_stats.items()},
                "pending": {t: [e.to_json() for e in eps] for t, eps in self.pending.items() if eps},
                # planned groups, open or closed: their rollouts died with the process, so a resumed
                # run trains each with the episodes it has
                "planned": {gid: {"task_id": p.task_id, "size": p.size, "episodes": [e.to_json() for e in p.episodes]}
                            for gid, p in self.planned.items() if p.episodes},
                "seen": sorted(self.seen), "seq": self._seq, "group_seq": self._group_seq,
                "config": asdict(self.config)}

    def save_state(self, state_dir: Path, text: str | None = None) -> Path:
        """Write ``data_manager.json`` in ``state_dir`` (atomically); the pool is already on disk.
        ``text``: a :meth:`state_json` taken earlier (where the state may change meanwhile, e.g.
        written from another thread than the event loop that feeds this manager)."""
        p = Path(state_dir) / STATE_FILE
        atomic_write(p, text if text is not None else self.state_json())
        return p

    def state_json(self) -> str:
        """The state as JSON text: a snapshot, safe to write from another thread."""
        return json.dumps(self.state())

    def load_state(self, state_dir: Path) -> bool:
        """Restore what :meth:`save_state` wrote (False when there is nothing to restore)."""
        d = read_state(state_dir)
        if d is None:
            return False
        self.version = int(d["version"])
        self.counters.update({k: int(v) for k, v in d["counters"].items()})
        self.task_stats = {t: TaskStats.from_json(s) for t, s in d["task_stats"].items()}
        self.pending = {t: [Episode.from_json(e) for e in eps] for t, eps in d["pending"].items()}
        self.planned, self.closed = {}, deque()
        for gid, g in d.get("planned", {}).items():
            self.planned[gid] = PlannedGroup(g["task_id"], int(g["size"]),
                                             [Episode.from_json(e) for e in g["episodes"]], closed=True)
            self.closed.append(gid)
        self.seen = set(d["seen"])
        self._seq = int(d["seq"])
        self._group_seq = int(d["group_seq"])
        return True

