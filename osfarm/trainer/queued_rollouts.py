"""Training rollouts as Celery jobs (``rollout.executor: celery``): desktops on many hosts.

The trainer sends each planned rollout as an ``osfarm.run_episode`` job (the queue of
``osfarm eval --executor celery``, osfarm/runner/executors/); an ``osfarm worker`` on any host
runs it on its own farm against the policy server the job names and publishes its
``osfarm.episode/1`` record to the run's Redis Stream. The trainer needs no farm: it reads that
stream through :meth:`DataManager.consume_redis` (journal, then ack; a record delivered twice is
one episode id and trains once) and reports every job exactly once to the rollout controller:

* a record on the stream: the data manager's outcome (accepted, or why not);
* a job that failed on its worker (FAILURE) or was revoked before it ran (REVOKED): rejected or
  aborted, seen by polling the result backend;
* a job that finished but whose record never came (the stream was full and it was spilled): its
  result's record, taken from the result backend after ``record_grace_s``;
* a job gone for longer than any delivery of it could run (``lost_after_s``): rejected, so its
  group is retried or closes and never waits forever.

A worker killed mid-episode leaves its job unacknowledged: Redis hands it to another worker after
the visibility timeout, which runs it again under the same episode id (worker_task.py). AReaL's
capacity counts every job sent and not reported, queued or running alike (the controller's
``running``). ROLL's abort revokes the selected jobs still queued and marks every selected episode
aborted in Redis (rollout_control.py): a running one stops at its next step and releases its
desktop, a queued one that reaches a worker anyway does not start; both come back as aborted.
A trainer that crashed leaves its jobs out: every job sent is listed in the hash
``<stream>:jobs`` (one trainer per stream), and a restarted trainer aborts those of earlier
processes that have not ended (:meth:`QueuedRollouts.abort_earlier`) before it sends its own, so
capacity is never exceeded by jobs it does not count.
Interruptible rollouts: the trainer publishes the adapter each policy server's rollouts may use
(:meth:`QueuedRollouts.publish_routes`), and a running rollout moves to it at its next step.
Weight syncs (:meth:`QueuedRollouts.attach`): no call reaches a server mid-swap (swap_fence.py), and
the adapter version each queued or running non-interruptible job keeps is pinned: no sync or prune
unloads it, and it is unloaded once the last job keeping it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Generic, TypeVar

import redis

from osfarm.errors import InfraError, OsfarmError
from osfarm.runner.episode import episode_id
from osfarm.runner.executors.celery_app import hard_limit_s, visibility_timeout_s
from osfarm.runner.executors.celery_exec import CeleryExecutor, worker_failure
from osfarm.runner.executors.rollout_control import RolloutAborted, publish_abort, publish_routes
from osfarm.runner.executors.worker_task import rollout_name as worker_rollout_name
from osfarm.stream.redis_stream import RedisStreamSource, connect, groups
from osfarm.trainer.data_manager import DataManager
from osfarm.trainer.stream_intake import STREAM_JOURNAL, consume_redis
from osfarm.trainer.swap_fence import QueueFence
from osfarm.trainer.weight_sync import WeightSync

log = logging.getLogger("osfarm.trainer.queued")

T = TypeVar("T")
# (item or None for a record of no job of this process, record or None, outcome or error, sent, finished)
Report = Callable[[T | None, dict[str, Any] | None, str | BaseException, float, float], None]
FAILED_STATES = ("FAILURE", "REVOKED")


class JobLost(InfraError, RuntimeError):
    """A job that neither finished nor failed within any delivery's time: its worker host is gone."""


class JobRevoked(OsfarmError):
    """The trainer revoked the job before a worker ran it, or stopped it at a step (ROLL's abort):
    the rollout is aborted, not failed."""


def rollout_name(task_id: str, seq: int) -> str:
    """The name the worker gives rollout ``seq`` of ``task_id`` (a task runs many times per run)."""
    return worker_rollout_name({"task_id": task_id, "rollout": seq})


def rollout_episode_id(run_id: str, task_id: str, seq: int) -> str:
    """The episode id the worker gives rollout ``seq`` of ``task_id`` (the same on every delivery)."""
    return episode_id(run_id, rollout_name(task_id, seq))


def job_task_id(run_id: str, task_id: str, seq: int) -> str:
    """The Celery task id of a rollout's job (revoke and state polls use it)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"osfarm-job:{run_id}:{rollout_name(task_id, seq)}"))


@dataclass
class Outstanding(Generic[T]):
    item: T
    task_id: str  # Celery's
    episode_id: str
    sent: float  # time.monotonic()
    state: str = "PENDING"
    succeeded_at: float | None = None  # when the backend said SUCCESS (the record should follow)
    version: int | None = None  # the policy version of the adapter the job was sent with
    pinned: bool = False  # it keeps that adapter to its end (not interruptible)


@dataclass
class QueueCounts:
    sent: int = 0
    records: int = 0
    failed: int = 0
    revoked: int = 0
    stopped: int = 0  # aborted while running: stopped by their worker at a step
    lost: int = 0
    from_backend: int = 0  # records taken from the result backend (never came on the stream)
    foreign: int = 0  # records of jobs this process did not send (an earlier trainer process)
    earlier_aborted: int = 0  # jobs of an earlier trainer process still out at the start: aborted
    evicted: int = 0  # jobs aborted because the adapter they keep had to make room (policy.max_adapters)
    by_worker: dict[str, int] = field(default_factory=dict)
    # the queue's cost: a job's time from sent to its record here, less the episode's own time on
    # the worker (with no more jobs than desktops, none waits in the queue for a free worker)
    overhead_s_total: float = 0.0
    timed: int = 0

    def overhead_ms(self) -> float | None:
        return 1000.0 * self.overhead_s_total / self.timed if self.timed else None


class QueuedRollouts(Generic[T]):
    """The trainer's side of the queue: send jobs, revoke queued ones, report each job once."""

    def __init__(self, broker: str, stream: str, run_id: str, *, time_limit_s: float, poll_s: float = 1.0,
                 record_grace_s: float = 15.0, lost_after_s: float | None = None, worker_out: Path | None = None):
        CeleryExecutor.check_limits(time_limit_s, 0)
        self.executor = CeleryExecutor(broker)
        self.broker, self.stream, self.run_id = broker, stream, run_id
        self.poll_s, self.record_grace_s = poll_s, record_grace_s
        self.worker_out = worker_out
        # the longest a job can take: queued behind a dead worker for a visibility timeout, then run in full
        self.lost_after_s = lost_after_s if lost_after_s is not None else (
            visibility_timeout_s() + hard_limit_s(time_limit_s, 0) + 60.0)
        self.jobs: dict[str, Outstanding[T]] = {}  # by episode id
        self.counts = QueueCounts()
        self._stopped = False
        self._redis = connect(broker)  # the run's abort set and routes (rollout_control.py); dials on first use
        self.jobs_key = f"{stream}:jobs"  # every job sent by a trainer on this stream: episode id -> [run, task id]
        self._routes: dict[str, tuple[str, int | None]] = {}  # as last published
        # interruptible rollouts: the routes to publish, read at every poll (None: not interruptible)
        self.routes: Callable[[], dict[str, tuple[str, int | None]]] | None = None
        self.group = "trainer"  # the stream's consumer group the trainer reads through
        self.stream_lag: int | None = None  # entries not yet delivered to the trainer's group, at the last poll
        self.stream_pending: int | None = None  # delivered and not yet acknowledged (journaled), at the last poll
        self.held: Callable[[], dict[str, list[str]]] | None = None  # every model name each server serves
        self.sync: WeightSync | None = None  # attached: jobs pin adapters, swaps are fenced
        self._pruning: asyncio.Task[None] | None = None
        self._prune_again = False

    def outstanding(self) -> int:
        return len(self.jobs)

    def row(self) -> dict[str, Any]:
        """The queue's part of an update's metrics row (numbers: Prometheus gauges too): jobs out
        (queued, i.e. not seen started at the last poll, and running), failed, revoked, lost, the
        overhead per rollout and the episodes each worker ran."""
        c = self.counts
        queued = sum(1 for j in self.jobs.values() if j.state == "PENDING")
        return {"queue_outstanding": len(self.jobs), "queue_queued": queued, "queue_running": len(self.jobs) - queued,
                "queue_stream_lag": self.stream_lag, "queue_stream_pending": self.stream_pending,
                "queue_failed": c.failed, "queue_revoked": c.revoked, "queue_stopped": c.stopped, "queue_lost": c.lost,
                "queue_overhead_ms": c.overhead_ms(),
                **{f"rollouts_worker_{w}": n for w, n in sorted(c.by_worker.items())}}

    def attach(self, sync: WeightSync) -> None:
        """Weight syncs over the queue: the routes (and the names each server serves) are published
        for the workers, every swap is fenced in Redis, the adapters jobs keep are pinned, and
        evicted ones abort their jobs."""
        self.sync = sync
        self.routes = lambda: {s.url: sync.route(s) for s in sync.servers}
        self.held = lambda: {s.url: sync.held(s) for s in sync.servers}
        sync.fence = QueueFence(self._redis, self.run_id, self.executor.broker_call)
        sync.pinned = self.pinned_versions
        sync.on_evict = self.evict

    def pinned_versions(self) -> set[int]:
        """The adapter versions queued or running non-interruptible jobs keep."""
        return {j.version for j in self.jobs.values() if j.pinned and j.version is not None}

    async def submit(self, item: T, task_id: str, seq: int, job: dict[str, Any]) -> None:
        """Send one rollout's job (``job``: the worker's job fields, see worker_task.py)."""
        full = {**job, "run_id": self.run_id, "task_id": task_id, "rollout": seq, "stream": self.stream}
        j = self.track(item, task_id, seq, version=job.get("policy_version"),
                       pinned=not job.get("interruptible", False))
        try:
            await self.executor.broker_call(functools.partial(
                self._redis.hset, self.jobs_key, j.episode_id, json.dumps([self.run_id, j.task_id])))
            await self.executor.send(full, j.task_id)
        except BaseException:
            self.jobs.pop(j.episode_id, None)
            raise
        self.counts.sent += 1

    def track(self, item: T, task_id: str, seq: int, *, version: int | None = None,
              pinned: bool = False) -> Outstanding[T]:
        """Expect rollout ``seq`` of ``task_id``'s one outcome (before its job is sent: a fast
        worker's record must find it); ``pinned``: it keeps adapter ``version`` to its end."""
        j = Outstanding(item, job_task_id(self.run_id, task_id, seq), rollout_episode_id(self.run_id, task_id, seq),
                        time.monotonic(), version=version, pinned=pinned)
        self.jobs[j.episode_id] = j
        return j

    def _ended(self, j: Outstanding[T]) -> None:
        """A job was reported: the last one keeping its adapter gives it back (unloaded soon)."""
        if self.sync is None or not j.pinned or j.version is None or j.version in self.pinned_versions():
            return
        if self._pruning is not None and not self._pruning.done():
            self._prune_again = True
            return
        self._pruning = asyncio.ensure_future(self._prune(self.sync))

    async def _prune(self, sync: WeightSync) -> None:
        self._prune_again = True
        while self._prune_again:
            self._prune_again = False
            for err in await sync.prune(set()):
                log.warning("adapter unload failed: %s", err)

    async def evict(self, versions: set[int]) -> int:
        """Abort the jobs that keep one of ``versions`` (their adapter must make room); returns how
        many. They come back as aborted and the controller retries them."""
        chosen = [j for j in self.jobs.values() if j.pinned and j.version in versions]
        await self._abort(chosen)
        self.counts.evicted += len(chosen)
        return len(chosen)

    async def revoke(self, which: Callable[[T], bool]) -> int:
        """Abort the selected jobs: those not known to run yet are revoked, and every one is marked
        aborted in Redis, so a running one stops at its next step. They come back as aborted (a
        running one that finishes before its next step brings its record, judged like any other)."""
        chosen = [j for j in self.jobs.values() if which(j.item)]
        await self._abort(chosen)
        return len(chosen)

    async def _abort(self, chosen: list[Outstanding[T]]) -> None:
        if not chosen:
            return
        await self.executor.broker_call(functools.partial(publish_abort, self._redis, self.run_id,
                                                          [j.episode_id for j in chosen]))
        ids = [j.task_id for j in chosen if j.state == "PENDING"]
        if ids:
            await asyncio.to_thread(self.executor.app.control.revoke, ids)

    async def abort_earlier(self) -> int:
        """Abort the jobs an earlier trainer process on this stream sent and that have not ended
        (it crashed: nothing counts them); returns how many. Their records, if one still comes, are
        judged by the data manager as records of no job of this process."""
        sent = await self.executor.broker_call(functools.partial(self._redis.hgetall, self.jobs_key))
        earlier = {eid: json.loads(v) for eid, v in sent.items() if eid not in self.jobs}
        if not earlier:
            return 0
        states = await self.executor.broker_call(functools.partial(self.states, [t for _r, t in earlier.values()]))
        out = [(eid, run, tid) for (eid, (run, tid)), (state, _res) in zip(earlier.items(), states, strict=True)
               if state not in (*FAILED_STATES, "SUCCESS")]
        for run in {run for _e, run, _t in out}:
            await self.executor.broker_call(functools.partial(publish_abort, self._redis, run,
                                                              [e for e, r, _t in out if r == run]))
        if out:
            await asyncio.to_thread(self.executor.app.control.revoke, [t for _e, _r, t in out])
        await self.executor.broker_call(functools.partial(self._redis.hdel, self.jobs_key, *earlier))
        self.counts.earlier_aborted += len(out)
        return len(out)

    async def publish_routes(self, routes: dict[str, tuple[str, int | None]]) -> None:
        """Interruptible rollouts: the adapter (model name, version) each policy server's running
        rollouts move to at their next step; written only when it changed."""
        if routes != self._routes:
            held = self.held() if self.held is not None else None
            await self.executor.broker_call(functools.partial(publish_routes, self._redis, self.run_id, routes, held))
            self._routes = dict(routes)

    # ---------------------------------------------------------------- reports

    def take(self, rec: dict[str, Any], outcome: str, report: Report[T]) -> None:
        """A record the data manager judged (``outcome``): its job's one report; a second delivery
        of it, or a record of no job of ours, reports nothing."""
        job = self.jobs.pop(rec.get("episode_id", ""), None)
        worker = (rec.get("worker") or {}).get("name") or "?"
        self.counts.by_worker[worker] = self.counts.by_worker.get(worker, 0) + 1
        if job is None:  # a redelivered duplicate, or a job of an earlier trainer process
            if outcome != "duplicate":
                self.counts.foreign += 1
            return
        self._ended(job)
        self.counts.records += 1
        now = time.monotonic()
        episode_s = _episode_seconds(rec)
        if episode_s is not None:
            self.counts.overhead_s_total += max(0.0, now - job.sent - episode_s)
            self.counts.timed += 1
        report(job.item, rec, outcome, job.sent, now)

    def blob_root(self, rec: dict[str, Any], run_dir: Path) -> Path:
        """Where a record's blobs are: the run dir the job named (a filesystem the workers share
        at the same path), or ``worker_out``/<this run's id> (the workers' OSFARM_WORKER_OUT as the
        trainer sees it; the workers write this run's jobs there). The trainer's own run id, not the
        record's: a path is never built from what arrives on the stream."""
        return self.worker_out / self.run_id if self.worker_out is not None else run_dir

    async def consume(self, dm: DataManager, run_dir: Path, report: Report[T]) -> None:
        """Feed the data manager from the stream and report every job once, until :meth:`stop`."""
        source = await asyncio.to_thread(RedisStreamSource, self.broker, self.stream, self.group)
        intake = asyncio.create_task(consume_redis(
            dm, source, run_dir, journal=run_dir / STREAM_JOURNAL, stop=lambda: self._stopped,
            on_added=lambda rec, outcome: self.take(rec, outcome, report),
            blob_root_of=lambda rec: self.blob_root(rec, run_dir)))
        watch = asyncio.create_task(self._watch(dm, run_dir, report))
        try:
            done, _ = await asyncio.wait({intake, watch}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # an intake or watcher that failed ends the consumer with its error
        finally:
            self._stopped = True
            for t in (intake, watch):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    async def _watch(self, dm: DataManager, run_dir: Path, report: Report[T]) -> None:
        while not self._stopped:
            await asyncio.sleep(self.poll_s)
            if self.routes is not None:
                await self.publish_routes(self.routes())
            await self._read_lag()
            jobs = list(self.jobs.values())
            if not jobs:
                continue
            states = await self.executor.broker_call(functools.partial(self.states, [j.task_id for j in jobs]))
            lost = self.judge(list(zip(jobs, states, strict=True)), time.monotonic(), dm, run_dir, report)
            if lost:
                with contextlib.suppress(Exception):  # a lost job that comes back later finds itself revoked
                    await asyncio.to_thread(self.executor.app.control.revoke, lost)

    async def _read_lag(self) -> None:
        """The stream's lag and pending entries for the trainer's group (XINFO GROUPS): records
        the workers published that the trainer has not taken yet."""
        try:
            infos = await asyncio.to_thread(groups, self._redis, self.stream, 100_000)
        except redis.RedisError:
            self.stream_lag = self.stream_pending = None  # unknown this poll; the next one tries again
            return
        mine = next((g for g in infos if g.name == self.group), None)
        self.stream_lag, self.stream_pending = (mine.lag, mine.pending) if mine is not None else (None, None)

    def judge(self, polled: list[tuple[Outstanding[T], tuple[str, Any]]], now: float, dm: DataManager, run_dir: Path,
              report: Report[T]) -> list[str]:
        """Act on the jobs' polled (state, result): report the failed and revoked ones, take the
        record of one that finished but whose record never came, give up on lost ones (returned:
        their Celery task ids, to revoke)."""
        lost = []
        for j, (state, result) in polled:
            if self.jobs.get(j.episode_id) is not j:
                continue  # its record came meanwhile
            j.state = state
            if state in FAILED_STATES:
                self._ended(self.jobs.pop(j.episode_id))
                if state == "REVOKED":
                    self.counts.revoked += 1
                    report(j.item, None, JobRevoked(f"job {j.task_id} was revoked before it ran"), j.sent, now)
                elif type(result).__name__ == RolloutAborted.__name__:  # Celery rebuilds it by name
                    self.counts.stopped += 1
                    report(j.item, None, JobRevoked(f"job {j.task_id} was stopped at a step: {result}"), j.sent,
                           now)
                else:
                    self.counts.failed += 1
                    report(j.item, None, worker_failure(state, result), j.sent, now)
            elif state == "SUCCESS":
                j.succeeded_at = j.succeeded_at or now
                if now - j.succeeded_at > self.record_grace_s and isinstance(result, dict) and "record" in result:
                    self.counts.from_backend += 1  # spilled, never on the stream: take it from the result
                    rec = result["record"]
                    self.take(rec, dm.add(rec, self.blob_root(rec, run_dir)), report)
            elif now - j.sent > self.lost_after_s:
                self._ended(self.jobs.pop(j.episode_id))
                self.counts.lost += 1
                lost.append(j.task_id)
                report(j.item, None, JobLost(f"job {j.task_id} gave no result in {self.lost_after_s:.0f} s"), j.sent,
                       now)
        return lost

    def states(self, task_ids: list[str]) -> list[tuple[str, Any]]:
        """Each job's Celery state and, once it ended, its result (blocking: run in a thread)."""
        out = []
        for tid in task_ids:
            ar = self.executor.app.AsyncResult(tid)
            state = ar.state
            out.append((state, ar.result if state in (*FAILED_STATES, "SUCCESS") else None))
        return out

    def stop(self) -> None:
        self._stopped = True

    async def aclose(self) -> None:
        """Stop reading; revoke what is still queued (the run is over: nothing will train on it)."""
        self._stopped = True
        if self._pruning is not None:
            self._pruning.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pruning
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.revoke(lambda _item: True), 10)
            await asyncio.wait_for(asyncio.to_thread(self._redis.delete, self.jobs_key), 10)
        self.executor.close()
        self._redis.close()


def _episode_seconds(rec: dict[str, Any]) -> float | None:
    """The episode's own time on its worker, from the record's ISO times (None if unknown)."""
    try:
        return (datetime.fromisoformat(rec["finished_at"]) - datetime.fromisoformat(rec["started_at"])).total_seconds()
    except (KeyError, TypeError, ValueError):
        return None


def open_queue(broker: str | None, stream: str, run_id: str, time_limit_s: float,
               error: Callable[[str], Exception], worker_out: Path | None = None) -> QueuedRollouts[Any]:
    """The queue of a run, or ``error(message)`` naming the field that is wrong."""
    if not broker:
        raise error("rollout.executor celery needs rollout.broker (or OSFARM_BROKER): the Redis URL")
    if not broker.startswith(("redis://", "rediss://", "unix://")):
        raise error(f"rollout.broker must be a Redis URL (redis://host:port/db), got {broker!r}")
    try:
        return QueuedRollouts(broker, stream, run_id, time_limit_s=time_limit_s, worker_out=worker_out)
    except ValueError as e:
        raise error(f"rollout.episode_time_limit_s: {e}") from None

