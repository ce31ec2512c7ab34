"""``osfarm train``: the asynchronous RL loop (DART's decoupled pipeline with AReaL's staleness bound).

Four parts run at once on one event loop:

* the **rollout controller** plans groups (task × n: DART's dynamic n, a fixed or BroRL-broad n,
  XRPO's allocation) and keeps up to ``envs`` episodes running on the farm through the in-process
  **scheduler** (rollout-wise: the next episode starts the moment one ends), as long as AReaL's
  staleness capacity allows; each rollout's life is tracked (ROLL): retried when it fails,
  cancelled when its group already has enough (redundant rollouts) or when it could only come
  back stale;
* each finished episode becomes an ``osfarm.episode/1`` record (``episodes.jsonl`` + blobs in the
  run dir) and goes to the **data manager**, which collects it into its planned group and turns
  closed groups into GRPO samples (experience pool, entropy selection, version window);
* the **learner** takes whole groups worth a batch, updates the policy in a worker thread
  (episodes go on meanwhile; with ``--nproc N`` on N ranks), writes a checkpoint (served weights +
  training state) and
* **weight sync** pushes it to every policy server, one at a time; only then does the controller
  learn the new version (so rollouts it starts next use the new weights).

η = 0 makes it synchronous (generate a batch, train, generate): the capacity is then one batch,
so nothing runs while the learner trains. Held-out evaluation runs every ``eval_every`` versions
through the same scheduler.

Resume: the latest checkpoint under ``<run>/checkpoints`` restores the learner (weights,
optimizer, schedule, version, counters), the data manager (task statistics, pending episodes, seen
ids) and the controller (AReaL's rule: accepted = what was consumed plus what waits to train), and
the policy servers are brought to it before any rollout starts (a server that kept running keeps
the adapters it already has).

What the run starts and stops again (the learner's thread and ranks, the metrics sinks, the
policy servers, weight sync, the farm) is ``RunResources`` (``run_wiring.py``); this module is the
loop that runs on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from kombu.utils.url import maybe_sanitize_url
from rich.console import Console

from osfarm.policy.client import PolicyServer
from osfarm.runner.episode import EpisodeConfig, run_episode
from osfarm.runner.results import episode_record
from osfarm.runner.scheduler import RolloutScheduler
from osfarm.stream.blobs import BlobStore, LocalBlobStore
from osfarm.stream.jsonl import JsonlSink
from osfarm.tasks.filecache import FileCache, suite_cache
from osfarm.tasks.model import Task
from osfarm.tasks.suite import OSWORLD_INDEX, Suite
from osfarm.trainer.allocation import dart_max_steps
from osfarm.trainer.checkpoint import latest_checkpoint, model_dir, prune_checkpoints, read_state, train_state_dir
from osfarm.trainer.config import TrainConfig
from osfarm.trainer.data_manager import ACCEPTED, Batch, DataConfig, DataManager, Sample
from osfarm.trainer.distributed import DistContext
from osfarm.trainer.evaluation import EvalTracker
from osfarm.trainer.learner import Learner, UpdateStats
from osfarm.trainer.metrics import TrainMetrics
from osfarm.trainer.queued_rollouts import JobRevoked, QueuedRollouts, open_queue
from osfarm.trainer.rollout_controller import ABORTED, REJECTED, ControllerConfig, RolloutController
from osfarm.trainer.routing import RoutedAgent
from osfarm.trainer.run_wiring import (
    RunResources,
    TrainError,
    controller_config,
    data_config,
    load_learner,
    load_tasks,
    rollout_agent,
    rollout_agent_options,
)
from osfarm.trainer.run_wiring import learner_options as learner_options  # imported from here by its tests
from osfarm.trainer.seeding import TaskInfo, pick_exemplar
from osfarm.trainer.update_row import Window, staleness_of, update_row
from osfarm.trainer.weight_sync import SyncResult, WeightSync

RecordDict = dict[str, Any]  # an osfarm.episode/1 record as JSON (osfarm.schema.episode.EpisodeRecord is its model)

CHECKPOINTS = "checkpoints"
DM_STATE = "data_manager.json"
RC_STATE = "rollout_controller.json"
TRAIN, EVAL = "train", "eval"


class Aborted(Exception):
    """A rollout the trainer cancelled (its group had enough, or it could only come back stale)."""


@dataclass(eq=False)
class Rollout:
    """One episode handed to the scheduler."""

    task_id: str
    seq: int  # rollout number in this process (distinct episode ids)
    version: int  # the controller's version when it was submitted
    group_id: str | None = None  # the planned group (training rollouts)
    kind: str = TRAIN  # or EVAL: a held-out evaluation episode of policy version `version`
    max_steps: int | None = None  # DART's dynamic trajectory length (None: the config's)
    exemplar: str | None = None  # XRPO's in-context seed, appended to the instruction
    started_version: int | None = None  # the trainer's version when the episode started (not queued)


# ---- the trainer ---------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: TrainConfig, console: Console | None = None, ctx: DistContext | None = None):
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        self.ctx = ctx or DistContext()
        run_dir = cfg.run_dir or Path("runs") / ("train-" + datetime.now().strftime("%Y%m%d-%H%M%S"))
        self.run_dir = Path(run_dir).resolve()
        self.ckpt_root = self.run_dir / CHECKPOINTS
        self.run_id = datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]  # per process start
        self.rollout_seq = 0
        self.window = Window()
        self.totals: dict[str, Any] = {"episodes": 0, "env_busy_s": 0.0, "samples": 0, "updates_this_run": 0,
                                       "stale_dropped": 0, "sync_failures": 0, "aborted": 0, "skipped_updates": 0}
        self.in_flight: dict[int, float] = {}  # running episodes: id(rollout) -> monotonic start
        self.in_flight_versions: dict[int, int] = {}  # running episodes: id -> version of the model they request
        self.running: dict[int, tuple[Rollout, asyncio.Task[Any]]] = {}  # cancellable episodes by id(rollout)
        self.episodes: set[asyncio.Task[Any]] = set()  # every episode task until it has cleaned up
        self.stop = asyncio.Event()
        self.resources = RunResources(cfg, self.console, self.ctx, self.run_dir, self.ckpt_root, self.stop,
                                      self.totals)
        self.eval = EvalTracker(self.run_dir, [], None)
        self.start_version = 0
        self.learner: Learner | None = None  # loaded first thing in run()
        self.metrics: TrainMetrics | None = None  # None: the run had nothing to do
        self.controller: RolloutController | None = None  # None until the rollouts can start
        self.draining = False  # the last update is done: only evaluation episodes still run
        self.queue: QueuedRollouts[Rollout] | None = None  # rollout.executor celery: the jobs sent to workers

    # -- setup ---------------------------------------------------------------------------------------

    def data_config(self) -> DataConfig:
        return data_config(self.cfg, self.ctx)

    def controller_config(self, dcfg: DataConfig) -> ControllerConfig:
        return controller_config(self.cfg, dcfg)

    def split_cpus(self) -> set[int] | None:
        """See :meth:`RunResources.split_cpus` (``run`` calls it)."""
        return self.resources.split_cpus()

    # -- the loop ------------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """The whole run; whatever it started is stopped again, in reverse order, however it ends."""
        cfg = self.cfg
        async with self.resources as res:
            res.split_cpus()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "train_config.json").write_text(cfg.model_dump_json(indent=2))
            suite, tasks = load_tasks(cfg)
            by_id = {t.id: t for t in tasks}
            eval_by_id: dict[str, Task] = {}
            eval_cache: FileCache | None = None
            if cfg.eval_every is not None and cfg.eval_suite is not None:
                eval_suite, eval_tasks = load_tasks(cfg, cfg.eval_suite, cfg.eval_tasks)
                eval_by_id = {t.id: t for t in eval_tasks}
                eval_cache = suite_cache(eval_suite, Path(cfg.eval_suite), None, self.run_dir, True)
                self.eval = EvalTracker(self.run_dir, list(eval_by_id), cfg.eval_every, cfg.eval_episodes)
            learner, ckpt = await res.load_learner()
            self.learner = learner
            self.start_version = learner.version
            if learner.version >= cfg.updates:
                self.console.print(f"already at version {learner.version} >= updates={cfg.updates}: nothing to do")
            else:
                await self._train(learner, ckpt, suite, by_id, eval_by_id, eval_cache)
        return self.summary()

    async def _train(self, learner: Learner, ckpt: Path | None, suite: Suite, by_id: dict[str, Task],
                     eval_by_id: dict[str, Task], eval_cache: FileCache | None) -> None:
        cfg, ro, res = self.cfg, self.cfg.rollout, self.resources
        self.metrics = res.open_metrics()
        queue = self.queue = self._open_queue()
        if queue is not None and (n := await queue.abort_earlier()):  # a crashed process's: not counted here
            self.console.print(f"aborted {n} job(s) an earlier trainer process left queued or running", highlight=False)
        servers = await res.start_policy(model_dir(ckpt) if ckpt is not None else learner.model_path, learner.version)
        sync = await res.start_weight_sync(servers, ckpt, learner)
        if queue is not None:  # routes for the workers, swaps fenced in Redis, adapters kept for the jobs using them
            queue.attach(sync)
        url, token = await res.start_farm() if queue is None else ("", "")  # workers bring their own farms

        dcfg = self.data_config()
        ccfg = self.controller_config(dcfg)
        controller: RolloutController | None = None

        def discard(_task: str, n: int, _reason: str) -> None:
            if controller is not None:
                controller.release(n)

        dm = DataManager(dcfg, blob_root=self.run_dir, pool_dir=self.run_dir / "pool", version=learner.version,
                         on_discard=discard)
        if ckpt is not None:
            dm.load_state(train_state_dir(ckpt))
            dm.set_version(learner.version)
        for src in cfg.pool_from:
            try:
                n = dm.preload_pool(src)
            except (FileNotFoundError, ValueError, KeyError) as e:
                raise TrainError(f"pool_from: {e}") from None
            self.console.print(f"experience pool: {n} successful episode(s) from {src}", highlight=False)

        scheduler: RolloutScheduler[Rollout, RecordDict] = RolloutScheduler(self._run_one_factory(
            by_id, eval_by_id, suite_cache(suite, Path(cfg.suite), None, self.run_dir, True), eval_cache, url, token,
            servers, sync, EpisodeConfig(max_steps=ro.max_steps, time_limit_s=ro.episode_time_limit_s,
                                         infra_retries=0, work_dir=self.run_dir / ".work",
                                         action_timing=ro.action_timing),
            LocalBlobStore(self.run_dir), JsonlSink(self.run_dir / "episodes.jsonl"),
            JsonlSink(self.run_dir / "eval" / "episodes.jsonl")), ro.envs)
        infos = {t.id: TaskInfo(t.id, t.domain or "", t.instruction) for t in by_id.values()}

        async def submit(task_id: str, n: int, version: int, group_id: str) -> None:
            seeded = 0
            exemplar = self._exemplar(task_id, dm, infos) if ro.seed_exemplars else None
            if exemplar is not None:
                seeded = math.ceil(n * ro.seed_fraction)
            for i in range(n):
                self.rollout_seq += 1
                steps = (dart_max_steps(dm.task_stats.get(task_id), ro.max_steps, margin=ro.length_margin)
                         if ro.dynamic_length else ro.max_steps)
                item = Rollout(task_id, self.rollout_seq, version, group_id, TRAIN, steps,
                               exemplar if i < seeded else None)
                if queue is not None:
                    await self._send(queue, item, servers, sync)
                else:
                    scheduler.submit(item)

        def on_close(group_id: str) -> None:
            dm.close_group(group_id)
            self.cancel(lambda r: r.group_id == group_id)  # the redundant rest (ROLL)

        controller = RolloutController(list(by_id), submit, ccfg, task_stats=dm.task_stats,
                                       on_plan=dm.expect_group, on_close=on_close)
        if ckpt is not None:
            controller.load(train_state_dir(ckpt) / RC_STATE, pending=dm.pending_episodes())
        controller.gate.set_version(max(controller.version, learner.version))
        self.controller = controller
        if self.eval.due(learner.version):
            self._start_eval(learner.version, scheduler)

        if queue is not None:
            consumer = asyncio.create_task(queue.consume(dm, self.run_dir, self._report))
        else:
            consumer = asyncio.create_task(self._consume(scheduler, dm, controller))
        filler = asyncio.create_task(controller.run(self.stop))
        res.stack.push_async_callback(self._stop_rollouts, scheduler, filler, consumer)
        await self._learn(learner, dm, controller, sync, scheduler, consumer)
        filler.cancel()
        await self._drain_eval(consumer)

    async def _stop_rollouts(self, scheduler: RolloutScheduler[Rollout, RecordDict], filler: asyncio.Task[None],
                             consumer: asyncio.Task[None]) -> None:
        """The rollouts' teardown, before anything they use stops: no new ones, the running ones
        cancelled and waited for."""
        self.stop.set()
        filler.cancel()
        self.cancel(lambda r: True)
        if self.queue is not None:
            await self.queue.aclose()  # queued jobs revoked: nothing will train on them
            self.totals["queue"] = {**vars(self.queue.counts), "outstanding": self.queue.outstanding(),
                                    "overhead_ms": self.queue.counts.overhead_ms()}
        consumer.cancel()
        await scheduler.aclose()
        if self.episodes:  # cancelled episodes release their leases before the farm client closes
            await asyncio.wait(set(self.episodes), timeout=60)
        for t in (filler, consumer):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def _exemplar(self, task_id: str, dm: DataManager, infos: dict[str, TaskInfo]) -> str | None:
        """XRPO: a solved related task's episode for a task with no success yet."""
        st = dm.task_stats.get(task_id)
        if (st is not None and st.successes) or dm.pool.get(task_id):
            return None
        solved = {t: eps[-1].record for t, eps in dm.pool.items() if eps and t != task_id}
        return pick_exemplar(infos[task_id], infos, solved)

    def _open_queue(self) -> QueuedRollouts[Rollout] | None:
        """rollout.executor celery: the queue the rollouts go to (None: in process)."""
        ro = self.cfg.rollout
        if ro.executor != "celery":
            return None
        if self.cfg.eval_every is not None:
            raise TrainError("eval_every with rollout.executor celery is not supported yet: evaluate the "
                             "checkpoints with `osfarm eval --executor celery`")
        queue: QueuedRollouts[Rollout] = open_queue(ro.broker or os.environ.get("OSFARM_BROKER"), ro.stream,
                                                    self.run_id, ro.episode_time_limit_s, TrainError, ro.worker_out)
        # the URL carries Redis's password: never into the log
        self.console.print(f"rollouts go to the Celery queue at {maybe_sanitize_url(queue.broker)}; records come "
                           f"back on stream {queue.stream}", highlight=False)
        return queue

    async def _send(self, queue: QueuedRollouts[Rollout], item: Rollout, servers: list[PolicyServer],
                    sync: WeightSync) -> None:
        """One rollout as a worker's job: the policy server and model name (the adapter of the
        version it stands for) it asks, its step limit, group and exemplar."""
        cfg, ro = self.cfg, self.cfg.rollout
        server = self._pick_server(servers, sync, item.seq)
        model, version = sync.route(server)
        suite = Path(cfg.suite).resolve()
        job = {"suite": str(suite), "index": str(suite / OSWORLD_INDEX) if (suite / OSWORLD_INDEX).is_file() else None,
               "agent": cfg.agent.kind,
               "agent_options": rollout_agent_options(cfg.agent, server.url, model,
                                                      request_seed(cfg.seed, self.start_version, item.seq)),
               "episode": {"max_steps": item.max_steps or ro.max_steps, "time_limit_s": ro.episode_time_limit_s,
                           "infra_retries": 0, "action_timing": ro.action_timing},
               "out": str(self.run_dir), "cache": None, "offline": True, "policy_version": version,
               "interruptible": ro.interruptible,
               "record_fields": {"group_id": item.group_id, "seeded": bool(item.exemplar)},
               "instruction_suffix": item.exemplar}
        await queue.submit(item, item.task_id, item.seq, job)

    def cancel(self, which: Callable[[Rollout], bool]) -> int:
        """Cancel the running episodes ``which`` selects (queued jobs: revoke those not started);
        they end as ``aborted``."""
        n = 0
        if self.queue is not None:
            revoking = asyncio.ensure_future(self.queue.revoke(which))
            self.episodes.add(revoking)
            revoking.add_done_callback(self.episodes.discard)
        for item, task in list(self.running.values()):
            # once only: a second cancel would cut the episode's own cleanup (its lease release) short
            if which(item) and not task.done() and not task.cancelling():
                task.cancel()
                n += 1
        return n

    def _start_eval(self, version: int, scheduler: RolloutScheduler[Rollout, RecordDict]) -> None:
        for task_id in self.eval.start(version):
            self.rollout_seq += 1
            scheduler.submit(Rollout(task_id, self.rollout_seq, version, kind=EVAL))

    async def _drain_eval(self, consumer: asyncio.Task[None]) -> None:
        """Wait for the evaluations already started (the last version's included) to come back."""
        if self.eval.outstanding:
            self.draining = True
            self.cancel(lambda r: r.kind == TRAIN)
            with self.console.status(f"waiting for {self.eval.outstanding} evaluation episode(s) ..."):
                while self.eval.outstanding and not consumer.done() and not self.stop.is_set():
                    await asyncio.sleep(0.2)

    def _run_one_factory(self, by_id: dict[str, Task], eval_by_id: dict[str, Task], cache: FileCache,
                         eval_cache: FileCache | None, url: str, token: str, servers: list[PolicyServer],
                         sync: WeightSync, ecfg: EpisodeConfig, blobs: BlobStore, sink: JsonlSink,
                         eval_sink: JsonlSink) -> Callable[[Rollout], Awaitable[RecordDict]]:
        async def run_one(item: Rollout) -> RecordDict:
            key = id(item)
            if self.draining and item.kind == TRAIN:  # queued before the end: nothing will train on it
                raise Aborted(f"rollout {item.seq}: the run is over")
            self.in_flight[key] = time.monotonic()
            item.started_version = self.controller.version if self.controller is not None else item.version
            farm = await self.resources.farm_client(url, token)
            server = self._pick_server(servers, sync, item.seq)
            agent = RoutedAgent(rollout_agent(self.cfg.agent, server.url, self.cfg.policy.model_name,
                                              seed=request_seed(self.cfg.seed, self.start_version, item.seq)),
                                functools.partial(sync.route, server),
                                interruptible=self.cfg.rollout.interruptible,
                                serving=functools.partial(sync.serving, server.url))
            if agent.version is not None:
                self.in_flight_versions[key] = agent.version
            evaluating = item.kind == EVAL
            task = (eval_by_id if evaluating else by_id)[item.task_id]
            if item.exemplar:
                task = task.model_copy(update={"instruction": task.instruction + item.exemplar})
            cfg = ecfg if item.max_steps is None or evaluating else replace(ecfg, max_steps=item.max_steps)
            episode = asyncio.ensure_future(run_episode(farm, task, agent,
                                                        (eval_cache or cache) if evaluating else cache,
                                                        cfg, self.run_id))
            self.running[key] = (item, episode)
            self.episodes.add(episode)
            episode.add_done_callback(self.episodes.discard)
            try:
                # shielded: a scheduler being stopped does not tear the episode down halfway (the
                # shutdown cancels it through self.cancel and waits for its cleanup)
                res = await asyncio.shield(episode)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    if not episode.cancelling():
                        episode.cancel()
                    raise  # the scheduler itself is being stopped
                raise Aborted(f"rollout {item.seq} of {item.group_id or item.task_id} cancelled") from None
            finally:
                self.running.pop(key, None)
                self.in_flight_versions.pop(key, None)
            # every rollout of a task is its own episode (the runner's ids are per task and attempt)
            res.episode_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"osfarm:{self.run_id}:{item.task_id}:{item.seq}"))
            rec = await asyncio.to_thread(episode_record, res, self.run_id, blobs)
            if item.group_id is not None:
                rec["group_id"] = item.group_id
            if item.exemplar:  # XRPO: its success is not the task's own (DataManager.add)
                rec["seeded"] = True
            await asyncio.to_thread((eval_sink if evaluating else sink).publish, rec)
            return rec

        return run_one

    def _pick_server(self, servers: list[PolicyServer], sync: WeightSync, seq: int) -> PolicyServer:
        """Round robin over the servers, leaving out one that fell more than η versions behind
        (its syncs failed: what it rolls out could only be dropped as stale)."""
        floor = self.controller.version - self.cfg.rollout.eta if self.controller is not None else 0
        fresh = [s for s in servers if (v := sync.versions.get(s.url)) is None or v >= floor]
        pool = fresh or servers
        return pool[seq % len(pool)]

    def _open_metrics(self) -> TrainMetrics:
        if self.metrics is None:
            raise RuntimeError("metrics logged before _train opened the metrics sinks")
        return self.metrics

    async def _consume(self, scheduler: RolloutScheduler[Rollout, RecordDict], dm: DataManager,
                       controller: RolloutController) -> None:
        async for done in scheduler.results():
            item, rec = done.item, done.result
            self.in_flight.pop(id(item), None)
            if item.kind == EVAL:
                row = self.eval.add(item.version, rec["status"] if rec else None, rec["score"] if rec else None,
                                    (rec.get("policy") or {}).get("version_start") if rec else None)
                if rec is None:
                    self.console.print(f"[yellow]evaluation episode failed[/]: {type(done.error).__name__}: "
                                       f"{done.error}", highlight=False)
                if row is not None:
                    self._open_metrics().log_eval(row)
                continue
            self._report(item, rec, dm.add(rec, self.run_dir) if rec is not None else done.error or Aborted(),
                         done.started, done.finished)

    def _report(self, item: Rollout | None, rec: RecordDict | None, outcome: str | BaseException, started: float,
                finished: float) -> None:
        """A training rollout ended: ``rec`` with the data manager's ``outcome``, or no record and
        the error (``Aborted``, a revoked job: the trainer cancelled it). None: a queued job of an
        earlier process (the data manager took its record; the controller never counted it)."""
        controller = self.controller
        if item is None or controller is None:
            return
        if isinstance(outcome, BaseException):
            aborted = isinstance(outcome, Aborted | JobRevoked)
            text = "aborted" if aborted else f"error: {type(outcome).__name__}: {outcome}"
            if aborted:
                self.totals["aborted"] += 1
            else:
                self.console.print(f"[yellow]rollout failed[/]: {text}", highlight=False)
            controller.on_episode(item.group_id or "", ABORTED if aborted else REJECTED)
            outcome = text.partition(":")[0]
        else:
            controller.on_episode(item.group_id or "", outcome if outcome == ACCEPTED else REJECTED)
        self.window.add(rec, outcome, started, finished)
        self.totals["episodes"] += 1
        self.totals["env_busy_s"] += finished - started
        if self.cfg.max_episodes is not None and self.totals["episodes"] >= self.cfg.max_episodes:
            self.console.print(f"episode budget reached ({self.cfg.max_episodes}): stopping", highlight=False)
            self.stop.set()

    async def _learn(self, learner: Learner, dm: DataManager, controller: RolloutController, sync: WeightSync,
                     scheduler: RolloutScheduler[Rollout, RecordDict], consumer: asyncio.Task[None]) -> None:
        cfg, eta, res = self.cfg, self.cfg.rollout.eta, self.resources
        while learner.version < cfg.updates and not self.stop.is_set():
            get = asyncio.create_task(dm.get_batch(cfg.rollout.batch_size, flush=controller.blocked))
            stopping = asyncio.create_task(self.stop.wait())
            done, _ = await asyncio.wait({get, consumer, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if get not in done:
                get.cancel()
                if self.stop.is_set():
                    return
                if consumer.done() and consumer.exception():
                    raise TrainError(f"the episode consumer stopped: {consumer.exception()}")
                raise TrainError("the episode stream ended before the run finished")
            batch = get.result()
            # the data manager's version window already holds; experience-pool replays are exempt
            samples = [s for s in batch.samples
                       if s.from_pool or s.policy_version is None or learner.version - s.policy_version <= eta]
            self.totals["stale_dropped"] += len(batch.samples) - len(samples)
            if not samples:
                controller.consume(batch.episodes)
                continue
            stale = staleness_of(samples, learner.version)
            t_update = time.monotonic()
            stats = await res.in_learner(learner.update, samples)
            update_s = time.monotonic() - t_update
            if stats.skipped:  # nothing changed: no checkpoint, no sync, the version stays
                self.totals["skipped_updates"] += 1
                self.console.print(f"[yellow]update skipped[/]: every optimizer step had a non-finite gradient "
                                   f"(version stays {learner.version})", highlight=False)
                controller.consume(batch.episodes)
                continue
            version = stats.version
            t_sync = time.monotonic()
            dm.set_version(version)  # pending episodes now outside the window are dropped before saving
            dm_state = dm.state_json()  # snapshots taken here, on the event loop that changes them

            def write_states(d: Path, text: str = dm_state) -> None:
                dm.save_state(d, text)

            ckpt = await res.in_learner(learner.save, self.ckpt_root / f"v{version}",
                                         {"run_dir": str(self.run_dir), "totals": dict(self.totals)}, write_states,
                                         full=version % cfg.checkpoint_every == 0 or version >= cfg.updates,
                                         background=True)  # weights now; the training state off the critical path
            results = await res.sync_to(sync, ckpt, version)
            for err in await sync.prune(set(self.in_flight_versions.values())):
                self.console.print(f"[yellow]adapter unload failed[/]: {err}", highlight=False)
            sync_s = time.monotonic() - t_sync
            controller.set_version(version, batch.episodes)  # only now may rollouts count on the new weights
            rc_state = controller.state_json()
            await asyncio.to_thread(controller.save, train_state_dir(ckpt) / RC_STATE, rc_state)
            await asyncio.to_thread(prune_checkpoints, self.ckpt_root, cfg.keep_checkpoints)
            if not cfg.rollout.interruptible:  # what started before the window can only come back stale
                def started_stale(r: Rollout, version: int = version) -> bool:
                    return r.kind == TRAIN and (
                        r.started_version if r.started_version is not None else r.version) < version - eta

                self.cancel(started_stale)
            if self.eval.due(version):
                self._start_eval(version, scheduler)
            self.totals["samples"] += len(samples)
            self.totals["updates_this_run"] += 1
            self._log_row(stats, samples, stale, update_s, sync_s, results, batch, controller, learner)

    def _log_row(self, stats: UpdateStats, samples: list[Sample], stale: list[int], update_s: float, sync_s: float,
                 results: list[SyncResult], batch: Batch, controller: RolloutController, learner: Learner) -> None:
        now = time.monotonic()
        w, self.window = self.window, Window(started=now)
        self._open_metrics().log(update_row(w, now, self.in_flight.values(), stats, samples, stale, batch, results,
                                    update_s=update_s, sync_s=sync_s, capacity=controller.capacity(),
                                    envs=self.cfg.rollout.envs, eta=self.cfg.rollout.eta, ranks=self.ctx.world,
                                    counters=dict(learner.counters),
                                    last_eval=self.eval.results[-1] if self.eval.results else None)
                                    | (self.queue.row() if self.queue is not None else {}))

    def summary(self) -> dict[str, Any]:
        rows = self.metrics.rows() if self.metrics is not None else []
        learner = self.learner
        return {"run_dir": str(self.run_dir), "start_version": self.start_version,
                "version": learner.version if learner is not None else self.start_version,
                "counters": dict(learner.counters) if learner is not None else {},
                "totals": self.totals, "rows": len(rows), "eval": self.eval.read(),
                "plot": str(self.run_dir / "curves.png") if (self.run_dir / "curves.png").is_file() else None}


def request_seed(seed: int, start_version: int, seq: int) -> int:
    """A distinct, reproducible sampling seed per rollout of a run (its steps add their index):
    the same config samples the same tokens from the same weights, so a synchronous run is
    reproducible; a resumed process (its rollout numbers start again) draws new ones."""
    return (seed * 1_000_003 + start_version * 10_007 + seq * 7919) % (2**31)


def checkpoint_state(run_dir: Path) -> dict[str, Any] | None:
    """The trainer state of a run dir's latest checkpoint (None before the first update)."""
    ckpt = latest_checkpoint(Path(run_dir) / CHECKPOINTS)
    return read_state(ckpt) if ckpt else None


def run_learner_rank(cfg: TrainConfig, ctx: DistContext) -> None:
    """Ranks > 0: a learner that follows rank 0's commands (rank 0 runs the trainer)."""
    run_dir = Path(cfg.run_dir or ".").resolve()
    learner, _ = load_learner(cfg, run_dir / CHECKPOINTS, ctx)
    learner.serve_commands()


def train(cfg: TrainConfig, console: Console | None = None) -> dict[str, Any]:
    """Run a training run to ``cfg.updates`` policy versions (SIGTERM/SIGINT stop it cleanly).

    Under torchrun (``WORLD_SIZE`` > 1) rank 0 runs the trainer and the other ranks its learner."""
    ctx = DistContext.from_env()
    if ctx.enabled and cfg.run_dir is None:
        raise TrainError("several learner ranks need an explicit run_dir (they load the same checkpoints)")
    if cfg.devices.learner and len(cfg.devices.learner) != ctx.world:
        raise TrainError(f"devices.learner lists {len(cfg.devices.learner)} devices for {ctx.world} learner rank(s)")
    if ctx.enabled and not ctx.is_main:
        run_learner_rank(cfg, ctx)
        return {"rank": ctx.rank}
    trainer = Trainer(cfg, console, ctx)

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, trainer.stop.set)
        return await trainer.run()

    summary = asyncio.run(main())
    (trainer.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
