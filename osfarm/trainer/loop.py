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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from rich.console import Console

from osfarm.agents import Agent, make_agent
from osfarm.client import AsyncFarm
from osfarm.farm.local import local_farm_settings, start_local_farm
from osfarm.farm.server import FarmServer
from osfarm.policy.client import PolicyServer
from osfarm.policy.process import PolicyProcess, PolicyStartError
from osfarm.policy.tiny import tiny_model_dir
from osfarm.runner.episode import EpisodeConfig, run_episode
from osfarm.runner.results import episode_record
from osfarm.runner.scheduler import RolloutScheduler
from osfarm.stream.blobs import BlobStore, LocalBlobStore
from osfarm.stream.jsonl import JsonlSink
from osfarm.tasks.filecache import FileCache, suite_cache
from osfarm.tasks.model import Task
from osfarm.tasks.suite import OSWORLD_INDEX, Suite, load_suite
from osfarm.trainer.allocation import dart_max_steps
from osfarm.trainer.checkpoint import latest_checkpoint, model_dir, prune_checkpoints, read_state, train_state_dir
from osfarm.trainer.config import TrainConfig
from osfarm.trainer.data_manager import ACCEPTED, Batch, DataConfig, DataManager, Sample
from osfarm.trainer.distributed import DistContext
from osfarm.trainer.evaluation import EvalTracker
from osfarm.trainer.learner import Learner, LearnerOptions, UpdateStats
from osfarm.trainer.metrics import TrainMetrics
from osfarm.trainer.rollout_controller import ABORTED, REJECTED, ControllerConfig, RolloutController
from osfarm.trainer.routing import RoutedAgent
from osfarm.trainer.seeding import TaskInfo, pick_exemplar
from osfarm.trainer.weight_sync import SyncResult, WeightSync

P = ParamSpec("P")
R = TypeVar("R")
EpisodeRecord = dict[str, Any]  # an osfarm.episode/1 record (osfarm.stream.record checks it)

CHECKPOINTS = "checkpoints"
DM_STATE = "data_manager.json"
RC_STATE = "rollout_controller.json"
TRAIN, EVAL = "train", "eval"


class TrainError(RuntimeError):
    """A run that cannot start or go on (the message says why)."""


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


# ---- per-update bookkeeping ----------------------------------------------------------------------


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

    def add(self, rec: EpisodeRecord | None, outcome: str, started: float, finished: float) -> None:
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


def pin_learner(cpus: set[int]) -> None:
    """Learner thread setup: its CPUs, and as many torch threads as it has CPUs."""
    import torch

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def staleness_of(samples: list[Sample], version: int) -> list[int]:
    return [version - int(s.policy_version) for s in samples if s.policy_version is not None and not s.from_pool]


def learner_options(cfg: TrainConfig, rank: int = 0) -> tuple[LearnerOptions, str | None]:
    """The learner's options for this run (the decay runs over the run's steps unless given) and
    the rank's device from the device map (None: the learner picks)."""
    lo = cfg.learner
    update: dict[str, Any] = {}
    if lo.total_steps is None:
        update["total_steps"] = cfg.updates * lo.minibatches
    if cfg.devices.reference and lo.reference_device is None:
        update["reference_device"] = cfg.devices.reference
    return lo.model_copy(update=update), (cfg.devices.learner[rank] if cfg.devices.learner else None)


def model_dir_of(cfg: TrainConfig) -> Path:
    if cfg.model == "tiny":
        return tiny_model_dir()
    p = Path(cfg.model).expanduser()
    if not (p / "config.json").is_file():
        raise TrainError(f"model {cfg.model}: not a Hugging Face model dir (no config.json); use a dir or 'tiny'")
    return p


def load_learner(cfg: TrainConfig, ckpt_root: Path, ctx: DistContext) -> tuple[Learner, Path | None]:
    """The learner of this rank: resumed from the run's latest checkpoint, or fresh."""
    opts, device = learner_options(cfg, ctx.rank)
    latest = latest_checkpoint(ckpt_root) if cfg.resume else None
    if latest is not None:
        learner, _ = Learner.resume(latest, opts, ctx=ctx, device=device)
        return learner, latest
    return Learner(model_dir_of(cfg), opts, ctx=ctx, device=device), None


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
        self.processes: list[PolicyProcess] = []
        self.in_flight: dict[int, float] = {}  # running episodes: id(rollout) -> monotonic start
        self.in_flight_versions: dict[int, int] = {}  # running episodes: id -> version of the model they request
        self.running: dict[int, tuple[Rollout, asyncio.Task[Any]]] = {}  # cancellable episodes by id(rollout)
        self.episodes: set[asyncio.Task[Any]] = set()  # every episode task until it has cleaned up
        self.farm: AsyncFarm | None = None  # opened by the first rollout, on the event loop
        self.stop = asyncio.Event()
        self.learner_pool: ThreadPoolExecutor | None = None  # None: asyncio's default executor
        self.eval = EvalTracker(self.run_dir, [], None)
        self.start_version = 0
        self.draining = False  # the last update is done: only evaluation episodes still run

    # -- setup ---------------------------------------------------------------------------------------

    def model_dir(self) -> Path:
        return model_dir_of(self.cfg)

    def load_learner(self) -> tuple[Learner, Path | None]:
        learner, latest = load_learner(self.cfg, self.ckpt_root, self.ctx)
        if latest is not None:
            self.console.print(f"resumed from {latest} (version {learner.version})", highlight=False)
        return learner, latest

    def load_tasks(self, suite_dir: Path | None = None, ids: list[str] | None = None) -> tuple[Suite, list[Task]]:
        suite_dir = Path(suite_dir or self.cfg.suite)
        ids = self.cfg.tasks if ids is None else ids
        index = suite_dir / OSWORLD_INDEX if (suite_dir / OSWORLD_INDEX).is_file() else None
        suite = load_suite(suite_dir, index)
        tasks = list(suite)
        if ids:
            by_id = {t.id: t for t in tasks}
            missing = [t for t in ids if t not in by_id]
            if missing:
                raise TrainError(f"tasks not in {suite_dir}: {', '.join(missing)}")
            tasks = [by_id[t] for t in ids]
        if not tasks:
            raise TrainError(f"{suite_dir}: no tasks")
        return suite, tasks

    def make_agent(self, base_url: str, name: str, seed: int | None = None) -> Agent:
        a = self.cfg.agent
        if a.kind == "choice":
            return make_agent("choice", base_url=base_url, model=name, choices=a.choices, temperature=a.temperature,
                              timeout_s=a.timeout_s, screenshot=a.screenshot, seed=seed)
        return make_agent("vlm", base_url=base_url, model=name, prompt_format=a.prompt_format,
                          observation=a.observation,
                          history_turns=a.history_turns, history_images=a.history_images, temperature=a.temperature,
                          max_tokens=a.max_tokens, timeout_s=a.timeout_s, capture_logprobs=True, seed=seed)

    async def start_policy(self, model: Path, version: int) -> list[PolicyServer]:
        p = self.cfg.policy
        if p.servers:
            return list(p.servers)
        threads = max(1, (os.cpu_count() or 2) // 2)
        devices = self.cfg.devices.policy
        for i in range(p.spawn):
            env = None
            if devices and devices[i].startswith("cuda"):
                env = {"CUDA_VISIBLE_DEVICES": devices[i].partition(":")[2] or "0"}
            self.processes.append(PolicyProcess(model, version, p.model_name, self.run_dir / f"policy-{i}.log",
                                                delay_ms=p.delay_ms, threads=threads, delay_sigma=p.delay_sigma,
                                                env=env))
        with self.console.status(f"starting {p.spawn} policy server(s) ..."):
            for proc in self.processes:
                try:
                    await proc.wait_ready(p.start_timeout_s)
                except PolicyStartError as e:
                    raise TrainError(str(e)) from None
        return [PolicyServer(url=proc.url, kind="osfarm") for proc in self.processes]

    def start_farm(self) -> tuple[str, str, FarmServer | None]:
        f = self.cfg.farm
        if f.url:
            token = f.token or os.environ.get("OSFARM_TOKEN")
            if not token:
                raise TrainError("farm.url needs farm.token (or OSFARM_TOKEN)")
            return f.url, token, None
        server = start_local_farm(local_farm_settings(self.cfg.rollout.envs, **f.overrides))
        return server.url, server.token, server

    def data_config(self) -> DataConfig:
        options = dict(self.cfg.data.options)
        options.setdefault("version_window", self.cfg.rollout.eta)
        options.setdefault("min_failure_steps", 1)
        if self.cfg.rollout.interruptible:
            options.setdefault("episode_version", "end")
        if self.ctx.multi_node:  # the other machines' ranks cannot read this one's blob paths
            options.setdefault("image_mode", "data_url")
        try:
            return DataConfig(**options)
        except (TypeError, ValueError) as e:
            raise TrainError(f"data.options: {e}") from None

    def controller_config(self, dcfg: DataConfig) -> ControllerConfig:
        ro = self.cfg.rollout
        copts = {"rollout_n": dcfg.rollout_n, "rollout_threshold": dcfg.rollout_threshold,
                 "min_group_size": dcfg.min_group_size, **ro.options}
        if dcfg.group_size is not None:  # a fixed group size in the data options means the same plan
            copts.setdefault("allocator", "fixed")
            copts.setdefault("group_size", dcfg.group_size)
        try:
            ccfg = ControllerConfig(batch_size=ro.batch_size, eta=ro.eta, max_concurrent=ro.envs, seed=self.cfg.seed,
                                    **copts)
        except (TypeError, ValueError) as e:
            raise TrainError(f"rollout.options: {e}") from None
        return ccfg

    # -- the loop ------------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        restore_cpus = self.split_cpus()
        try:
            return await self._run()
        finally:
            if restore_cpus is not None:
                os.sched_setaffinity(0, restore_cpus)
            if self.learner_pool is not None:
                self.learner_pool.shutdown(wait=False)

    def split_cpus(self) -> set[int] | None:
        """With ``learner_cpus``: this thread (and every thread and process started from it from now
        on) goes to the other CPUs, the learner gets a thread of its own on those. Returns the
        thread's previous CPUs (to restore), None when nothing is pinned."""
        cpus = self.cfg.learner_cpus
        if not cpus:
            return None
        allowed = os.sched_getaffinity(0)
        if not set(cpus) < allowed:
            raise TrainError(f"learner_cpus {cpus}: must be a proper subset of this process's CPUs {sorted(allowed)} "
                             "(the farm, desktops and policy servers need the others)")
        os.sched_setaffinity(0, allowed - set(cpus))
        self.learner_pool = ThreadPoolExecutor(1, thread_name_prefix="learner", initializer=pin_learner,
                                               initargs=(set(cpus),))
        return allowed

    async def in_learner(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run blocking learner work on the learner's thread (its own CPUs when pinned)."""
        if self.learner_pool is None and self.ctx.enabled:  # one thread: the ranks' collectives stay in order
            self.learner_pool = ThreadPoolExecutor(1, thread_name_prefix="learner")
        return await asyncio.get_running_loop().run_in_executor(self.learner_pool,
                                                                functools.partial(fn, *args, **kwargs))

    async def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "train_config.json").write_text(cfg.model_dump_json(indent=2))
        suite, tasks = self.load_tasks()
        by_id = {t.id: t for t in tasks}
        eval_by_id: dict[str, Task] = {}
        eval_cache: FileCache | None = None
        if cfg.eval_every is not None and cfg.eval_suite is not None:
            eval_suite, eval_tasks = self.load_tasks(cfg.eval_suite, cfg.eval_tasks)
            eval_by_id = {t.id: t for t in eval_tasks}
            eval_cache = suite_cache(eval_suite, Path(cfg.eval_suite), None, self.run_dir, True)
            self.eval = EvalTracker(self.run_dir, list(eval_by_id), cfg.eval_every, cfg.eval_episodes)
        # osfarm's one progress display for the slow start steps (transformers' bars are off)
        with self.console.status(f"loading the policy model ({cfg.model}) ..."):
            learner, ckpt = await self.in_learner(self.load_learner)
        self.learner = learner
        start_version = self.start_version = learner.version
        try:
            if learner.version >= cfg.updates:
                self.console.print(f"already at version {learner.version} >= updates={cfg.updates}: nothing to do")
                return self.summary(start_version)
            return await self._train(learner, ckpt, suite, by_id, eval_by_id, eval_cache, start_version)
        finally:
            learner.stop_workers()

    async def _train(self, learner: Learner, ckpt: Path | None, suite: Suite, by_id: dict[str, Task],
                     eval_by_id: dict[str, Task], eval_cache: FileCache | None, start_version: int) -> dict[str, Any]:
        cfg, ro = self.cfg, self.cfg.rollout
        metrics = TrainMetrics(self.run_dir, self.console, cfg.metrics.prometheus_port,
                               tensorboard=cfg.metrics.tensorboard, wandb=cfg.metrics.wandb,
                               config=json.loads(cfg.model_dump_json()))
        self.metrics = metrics
        farm_server = None
        supervisor: asyncio.Task[None] | None = None
        try:
            servers = await self.start_policy(model_dir(ckpt) if ckpt is not None else learner.model_path,
                                              learner.version)
            sync = WeightSync(servers, base_model=cfg.policy.model_name)
            self.sync = sync
            if cfg.policy.servers:
                await self._bring_servers_up(sync, ckpt, learner.version)
            else:  # spawned on the current weights
                for s in servers:
                    sync.versions[s.url] = learner.version
            supervisor = asyncio.create_task(self._supervise_policy(sync)) if self.processes else None
            url, token, farm_server = await asyncio.to_thread(self.start_farm)

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
            self.dm = dm

            scheduler: RolloutScheduler[Rollout, EpisodeRecord] = RolloutScheduler(self._run_one_factory(
                by_id, eval_by_id, suite_cache(suite, Path(cfg.suite), None, self.run_dir, True), eval_cache, url,
                token,
                servers, EpisodeConfig(max_steps=ro.max_steps, time_limit_s=ro.episode_time_limit_s, infra_retries=0,
                                       work_dir=self.run_dir / ".work"),
                LocalBlobStore(self.run_dir), JsonlSink(self.run_dir / "episodes.jsonl"),
                JsonlSink(self.run_dir / "eval" / "episodes.jsonl")), ro.envs)
            self.scheduler = scheduler
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
                    scheduler.submit(Rollout(task_id, self.rollout_seq, version, group_id, TRAIN, steps,
                                             exemplar if i < seeded else None))

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

            consumer = asyncio.create_task(self._consume(scheduler, dm, controller))
            filler = asyncio.create_task(controller.run(self.stop))
            try:
                await self._learn(learner, dm, controller, sync, consumer)
                filler.cancel()
                await self._drain_eval(consumer)
            finally:
                self.stop.set()
                filler.cancel()
                self.cancel(lambda r: True)
                consumer.cancel()
                await scheduler.aclose()
                if self.episodes:  # cancelled episodes release their leases before the farm client closes
                    await asyncio.wait(set(self.episodes), timeout=60)
                if self.farm is not None:
                    farm, self.farm = self.farm, None
                    with contextlib.suppress(Exception):
                        await farm.__aexit__(None, None, None)
                for t in (filler, consumer):
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
        finally:
            if supervisor is not None:
                supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await supervisor
            for proc in self.processes:
                await asyncio.to_thread(proc.stop)
            if farm_server is not None:
                await asyncio.to_thread(farm_server.stop)
            if cfg.metrics.plot:
                with contextlib.suppress(Exception):
                    metrics.plot()
            metrics.close()
        return self.summary(start_version)

    async def _supervise_policy(self, sync: WeightSync, every_s: float = 2.0) -> None:
        """Our own policy servers: one that died (killed, out of memory) is started again on the
        same port with the latest checkpoint's weights, so the run goes on (its rollouts meanwhile
        end as infra errors, which the controller retries)."""
        while not self.stop.is_set():
            await asyncio.sleep(every_s)
            for proc in self.processes:
                if proc.alive or self.stop.is_set():
                    continue
                ckpt = latest_checkpoint(self.ckpt_root)
                model, version = (model_dir(ckpt), int(read_state(ckpt)["version"])) if ckpt else (
                    self.learner.model_path, self.learner.version)
                self.console.print(f"[yellow]policy server {proc.url} exited ({proc.proc.returncode})[/]: starting it "
                                   f"again on version {version}", highlight=False)
                sync.versions[proc.url] = None
                await asyncio.to_thread(proc.restart, model, version)
                try:
                    await proc.wait_ready(self.cfg.policy.start_timeout_s)
                except PolicyStartError as e:
                    self.console.print(f"[red]policy server restart failed[/]: {e}", highlight=False)
                    continue
                sync.versions[proc.url] = version
                self.totals["policy_restarts"] = self.totals.get("policy_restarts", 0) + 1

    async def _bring_servers_up(self, sync: WeightSync, ckpt: Path | None, version: int) -> None:
        """Running servers (not ours): take over the adapters they already have, then, after a
        resume, bring them to the checkpoint's weights. A server whose sync fails keeps no version
        (its answers or its adapter names say which weights they are); none synced is an error."""
        for err in await sync.adopt(set(range(version + 1))):
            self.console.print(f"[yellow]could not list a server's adapters[/]: {err}", highlight=False)
        if ckpt is None:
            return
        results = await self._sync(sync, ckpt, version)
        if not any(r.ok for r in results):
            raise TrainError(f"no policy server could be brought to the resumed version {version}: "
                             + "; ".join(r.error or "?" for r in results))

    def _exemplar(self, task_id: str, dm: DataManager, infos: dict[str, TaskInfo]) -> str | None:
        """XRPO: a solved related task's episode for a task with no success yet."""
        st = dm.task_stats.get(task_id)
        if (st is not None and st.successes) or dm.pool.get(task_id):
            return None
        solved = {t: eps[-1].record for t, eps in dm.pool.items() if eps and t != task_id}
        return pick_exemplar(infos[task_id], infos, solved)

    def cancel(self, which: Callable[[Rollout], bool]) -> int:
        """Cancel the running episodes ``which`` selects; they end as ``aborted``."""
        n = 0
        for item, task in list(self.running.values()):
            # once only: a second cancel would cut the episode's own cleanup (its lease release) short
            if which(item) and not task.done() and not task.cancelling():
                task.cancel()
                n += 1
        return n

    def _start_eval(self, version: int, scheduler: RolloutScheduler[Rollout, EpisodeRecord]) -> None:
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
                         ecfg: EpisodeConfig, blobs: BlobStore, sink: JsonlSink,
                         eval_sink: JsonlSink) -> Callable[[Rollout], Awaitable[EpisodeRecord]]:
        async def run_one(item: Rollout) -> EpisodeRecord:
            key = id(item)
            if self.draining and item.kind == TRAIN:  # queued before the end: nothing will train on it
                raise Aborted(f"rollout {item.seq}: the run is over")
            self.in_flight[key] = time.monotonic()
            item.started_version = self.controller.version if hasattr(self, "controller") else item.version
            if self.farm is None:
                self.farm = AsyncFarm(url, token)
                await self.farm.__aenter__()
            farm = self.farm
            server = self._pick_server(servers, item.seq)
            agent = RoutedAgent(self.make_agent(server.url, self.cfg.policy.model_name,
                                                seed=request_seed(self.cfg.seed, self.start_version, item.seq)),
                                functools.partial(self.sync.route, server),
                                interruptible=self.cfg.rollout.interruptible)
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
            await asyncio.to_thread((eval_sink if evaluating else sink).publish, rec)
            return rec

        return run_one

    def _pick_server(self, servers: list[PolicyServer], seq: int) -> PolicyServer:
        """Round robin over the servers, leaving out one that fell more than η versions behind
        (its syncs failed: what it rolls out could only be dropped as stale)."""
        floor = self.controller.version - self.cfg.rollout.eta if hasattr(self, "controller") else 0
        fresh = [s for s in servers if (v := self.sync.versions.get(s.url)) is None or v >= floor]
        pool = fresh or servers
        return pool[seq % len(pool)]

    async def _consume(self, scheduler: RolloutScheduler[Rollout, EpisodeRecord], dm: DataManager,
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
                    self.metrics.log_eval(row)
                continue
            if rec is None:
                aborted = isinstance(done.error, Aborted)
                outcome = "aborted" if aborted else f"error: {type(done.error).__name__}: {done.error}"
                if aborted:
                    self.totals["aborted"] += 1
                else:
                    self.console.print(f"[yellow]rollout failed[/]: {outcome}", highlight=False)
                controller.on_episode(item.group_id or "", ABORTED if aborted else REJECTED)
            else:
                outcome = dm.add(rec, self.run_dir)
                controller.on_episode(item.group_id or "", outcome if outcome == ACCEPTED else REJECTED)
            self.window.add(rec, outcome if rec is not None else outcome.partition(":")[0], done.started, done.finished)
            self.totals["episodes"] += 1
            self.totals["env_busy_s"] += done.finished - done.started
            if self.cfg.max_episodes is not None and self.totals["episodes"] >= self.cfg.max_episodes:
                self.console.print(f"episode budget reached ({self.cfg.max_episodes}): stopping", highlight=False)
                self.stop.set()

    async def _sync(self, sync: WeightSync, path: Path, version: int) -> list[SyncResult]:
        results = await sync.sync(path, version)
        for r in results:
            if not r.ok:
                self.totals["sync_failures"] += 1
                self.console.print(f"[red]weight sync failed[/]: {r.error}", highlight=False)
        return results

    async def _learn(self, learner: Learner, dm: DataManager, controller: RolloutController, sync: WeightSync,
                     consumer: asyncio.Task[None]) -> None:
        cfg, eta = self.cfg, self.cfg.rollout.eta
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
            stats = await self.in_learner(learner.update, samples)
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

            ckpt = await self.in_learner(learner.save, self.ckpt_root / f"v{version}",
                                         {"run_dir": str(self.run_dir), "totals": dict(self.totals)}, write_states)
            results = await self._sync(sync, ckpt, version)
            for err in await sync.prune(set(self.in_flight_versions.values())):
                self.console.print(f"[yellow]adapter unload failed[/]: {err}", highlight=False)
            sync_s = time.monotonic() - t_sync
            controller.set_version(version, batch.episodes)  # only now may rollouts count on the new weights
            rc_state = controller.state_json()
            await asyncio.to_thread(controller.save, train_state_dir(ckpt) / RC_STATE, rc_state)
            await asyncio.to_thread(prune_checkpoints, self.ckpt_root, cfg.keep_checkpoints)
            if not cfg.rollout.interruptible:  # what started before the window can only come back stale
                self.cancel(lambda r, version=version: r.kind == TRAIN and (
                    r.started_version if r.started_version is not None else r.version) < version - eta)
            if self.eval.due(version):
                self._start_eval(version, self.scheduler)
            self.totals["samples"] += len(samples)
            self.totals["updates_this_run"] += 1
            self._log_row(stats, samples, stale, update_s, sync_s, results, batch, controller)

    def _log_row(self, stats: UpdateStats, samples: list[Sample], stale: list[int], update_s: float, sync_s: float,
                 results: list[SyncResult], batch: Batch, controller: RolloutController) -> None:
        now = time.monotonic()
        w, self.window = self.window, Window(started=now)
        wall = max(1e-9, now - w.started)
        # episodes still running were busy in this window too (the next window counts the rest)
        w.env_busy_s += sum(overlap(t0, now, w.started, now) for t0 in self.in_flight.values())
        row: dict[str, Any] = {
            "version": stats.version,
            "reward": sum(w.scores) / len(w.scores) if w.scores else None,
            "success_rate": w.successes / len(w.scores) if w.scores else None,
            "episodes": w.episodes,
            "infra_errors": w.infra_errors,
            "episodes_per_s": w.episodes / wall,
            "env_utilisation": w.env_busy_s / (self.cfg.rollout.envs * wall),
            "samples": len(samples),
            "samples_per_s": len(samples) / wall,
            "batch_reward": sum(s.reward for s in samples) / len(samples),
            "batch_episodes": batch.size,
            "batch_rollouts": batch.episodes,
            "pool_samples": sum(1 for s in samples if s.from_pool),
            "staleness_max": max(stale) if stale else 0,
            "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
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
            "capacity": controller.capacity(),
            "outcomes": w.outcomes,
            "eta": self.cfg.rollout.eta,
            "ranks": self.ctx.world,
            "counters": dict(self.learner.counters),
        }
        if self.eval.results:
            last = self.eval.results[-1]
            row["eval_version"], row["eval_success_rate"] = last["version"], last["success_rate"]
        self.metrics.log(row)

    def summary(self, start_version: int) -> dict[str, Any]:
        rows = self.metrics.rows() if hasattr(self, "metrics") else []
        return {"run_dir": str(self.run_dir), "start_version": start_version,
                "version": self.learner.version if hasattr(self, "learner") else start_version,
                "counters": dict(self.learner.counters) if hasattr(self, "learner") else {},
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
