"""``osfarm train``: the asynchronous RL loop (DART's decoupled pipeline with AReaL's staleness bound).

Four parts run at once on one event loop:

* the **rollout controller** (H6) keeps up to ``envs`` episodes running on the farm through the
  in-process **scheduler** (rollout-wise: the next episode starts the moment one ends), as long
  as AReaL's staleness capacity allows;
* each finished episode becomes an ``osfarm.episode/1`` record (``episodes.jsonl`` + blobs in the
  run dir) and goes to the **data manager** (H6), which forms GRPO groups and samples;
* the **learner** takes a batch, updates the policy in a worker thread (episodes go on
  meanwhile), writes a checkpoint (weights + version + the data manager's and controller's
  state) and
* **weight sync** pushes it to every policy server, one at a time; only then does the controller
  learn the new version (so rollouts it starts next use the new weights).

η = 0 makes it synchronous (generate a batch, train, generate): the capacity is then exactly
one batch per version, so nothing runs while the learner trains.

Resume: the latest checkpoint under ``<run>/checkpoints`` restores the learner (weights,
optimizer, version, counters), the data manager (task statistics, pending episodes, seen ids)
and the controller (AReaL's rule: accepted = version·batch_size), and the policy servers are
reloaded with it before any rollout starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
from osfarm.runner.episode import EpisodeConfig, StepRecord, run_episode
from osfarm.runner.results import episode_record
from osfarm.runner.scheduler import RolloutScheduler
from osfarm.stream.blobs import BlobStore, LocalBlobStore
from osfarm.stream.jsonl import JsonlSink
from osfarm.tasks.filecache import FileCache, suite_cache
from osfarm.tasks.model import Task
from osfarm.tasks.suite import OSWORLD_INDEX, Suite, load_suite
from osfarm.trainer.config import TrainConfig
from osfarm.trainer.data_manager import Batch, DataConfig, DataManager, Sample
from osfarm.trainer.learner import Learner, UpdateStats, latest_checkpoint, read_state
from osfarm.trainer.metrics import TrainMetrics
from osfarm.trainer.rollout_controller import ControllerConfig, RolloutController
from osfarm.trainer.weight_sync import SyncResult, WeightSync

P = ParamSpec("P")
R = TypeVar("R")
EpisodeRecord = dict[str, Any]  # an osfarm.episode/1 record (osfarm.stream.record checks it)

CHECKPOINTS = "checkpoints"
DM_STATE = "data_manager.json"
RC_STATE = "rollout_controller.json"


class TrainError(RuntimeError):
    """A run that cannot start or go on (the message says why)."""


@dataclass(eq=False)
class Rollout:
    """One episode handed to the scheduler."""

    task_id: str
    seq: int  # rollout number in this process (distinct episode ids)
    version: int  # the controller's version when it was submitted


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


def tag_versions(steps: list[StepRecord], version: int) -> int:
    """Give ``version`` to the steps whose model call reported none (a server that does not say
    which weights answered, e.g. vLLM); returns how many were tagged.

    The version is the one the episode's model name stood for when it started: exact for a
    versioned LoRA adapter, a lower bound where weights are replaced in place (versions only rise,
    so the staleness computed from it is never too small)."""
    n = 0
    for s in steps:
        if s.model is not None and s.model.get("policy_version") is None:
            s.model["policy_version"] = version
            n += 1
    return n


def staleness_of(samples: list[Sample], version: int) -> list[int]:
    return [version - int(s.policy_version) for s in samples if s.policy_version is not None]


# ---- the trainer ---------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: TrainConfig, console: Console | None = None):
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        run_dir = cfg.run_dir or Path("runs") / ("train-" + datetime.now().strftime("%Y%m%d-%H%M%S"))
        self.run_dir = Path(run_dir).resolve()
        self.ckpt_root = self.run_dir / CHECKPOINTS
        self.run_id = datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]  # per process start
        self.rollout_seq = 0
        self.window = Window()
        self.totals: dict[str, Any] = {"episodes": 0, "env_busy_s": 0.0, "samples": 0, "updates_this_run": 0,
                                       "stale_dropped": 0, "sync_failures": 0}
        self.processes: list[PolicyProcess] = []
        self.in_flight: dict[int, float] = {}  # running episodes: id -> monotonic start
        self.in_flight_versions: dict[int, int] = {}  # running episodes: id -> version of the model they request
        self.farm: AsyncFarm | None = None  # opened by the first rollout, on the event loop
        self.stop = asyncio.Event()
        self.learner_pool: ThreadPoolExecutor | None = None  # None: asyncio's default executor

    # -- setup ---------------------------------------------------------------------------------------

    def model_dir(self) -> Path:
        if self.cfg.model == "tiny":
            return tiny_model_dir()
        p = Path(self.cfg.model).expanduser()
        if not (p / "config.json").is_file():
            raise TrainError(f"model {self.cfg.model}: not a Hugging Face model dir (no config.json); use a dir or 'tiny'")
        return p

    def load_learner(self) -> tuple[Learner, Path | None, dict[str, Any]]:
        latest = latest_checkpoint(self.ckpt_root) if self.cfg.resume else None
        if latest is not None:
            learner, state = Learner.resume(latest, self.cfg.learner)
            self.console.print(f"resumed from {latest} (version {learner.version})", highlight=False)
            return learner, latest, state
        return Learner(self.model_dir(), self.cfg.learner), None, {}

    def load_tasks(self) -> tuple[Suite, list[Task]]:
        suite_dir = Path(self.cfg.suite)
        index = suite_dir / OSWORLD_INDEX if (suite_dir / OSWORLD_INDEX).is_file() else None
        suite = load_suite(suite_dir, index)
        tasks = list(suite)
        if self.cfg.tasks:
            by_id = {t.id: t for t in tasks}
            missing = [t for t in self.cfg.tasks if t not in by_id]
            if missing:
                raise TrainError(f"tasks not in {suite_dir}: {', '.join(missing)}")
            tasks = [by_id[t] for t in self.cfg.tasks]
        if not tasks:
            raise TrainError(f"{suite_dir}: no tasks")
        return suite, tasks

    def make_agent(self, base_url: str, name: str) -> Agent:
        a = self.cfg.agent
        if a.kind == "choice":
            return make_agent("choice", base_url=base_url, model=name, choices=a.choices, temperature=a.temperature,
                              timeout_s=a.timeout_s, screenshot=a.screenshot)
        return make_agent("vlm", base_url=base_url, model=name, prompt_format=a.prompt_format, observation=a.observation,
                          history_turns=a.history_turns, history_images=a.history_images, temperature=a.temperature,
                          max_tokens=a.max_tokens, timeout_s=a.timeout_s, capture_logprobs=True)

    async def start_policy(self, model: Path, version: int) -> list[PolicyServer]:
        p = self.cfg.policy
        if p.servers:
            return list(p.servers)
        threads = max(1, (os.cpu_count() or 2) // 2)
        for i in range(p.spawn):
            self.processes.append(PolicyProcess(model, version, p.model_name, self.run_dir / f"policy-{i}.log",
                                                delay_ms=p.delay_ms, threads=threads, delay_sigma=p.delay_sigma))
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
        return await asyncio.get_running_loop().run_in_executor(self.learner_pool, functools.partial(fn, *args, **kwargs))

    async def _run(self) -> dict[str, Any]:
        cfg, ro = self.cfg, self.cfg.rollout
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "train_config.json").write_text(cfg.model_dump_json(indent=2))
        suite, tasks = self.load_tasks()
        by_id = {t.id: t for t in tasks}
        # osfarm's one progress display for the slow start steps (transformers' bars are off)
        with self.console.status(f"loading the policy model ({cfg.model}) ..."):
            learner, ckpt, _state = await self.in_learner(self.load_learner)
        self.learner = learner
        start_version = learner.version
        if learner.version >= cfg.updates:
            self.console.print(f"already at version {learner.version} >= updates={cfg.updates}: nothing to do")
            return self.summary(start_version)

        metrics = TrainMetrics(self.run_dir, self.console, cfg.metrics.prometheus_port)
        self.metrics = metrics
        farm_server = None
        try:
            servers = await self.start_policy(ckpt or learner.model_path, learner.version)
            sync = WeightSync(servers, base_model=cfg.policy.model_name)
            self.sync = sync
            if ckpt is not None and cfg.policy.servers:  # running servers: bring them to the resumed weights
                await self._sync(sync, ckpt, learner.version)
            for s in servers:
                sync.versions[s.url] = learner.version
            url, token, farm_server = await asyncio.to_thread(self.start_farm)

            options = dict(cfg.data.options)
            options.setdefault("version_window", ro.eta)
            options.setdefault("group_size", min(ro.batch_size, 8))
            options.setdefault("min_failure_steps", 1)
            try:
                dcfg = DataConfig(**options)
            except TypeError as e:
                raise TrainError(f"data.options: {e}") from None
            n_groups = max(1, ro.batch_size // (dcfg.group_size or ro.batch_size))
            controller: RolloutController | None = None

            def discard(_task: str, n: int, _reason: str) -> None:
                if controller is not None:
                    controller.release(n)

            dm = DataManager(dcfg, blob_root=self.run_dir, pool_dir=self.run_dir / "pool", version=learner.version,
                             on_discard=discard)
            if ckpt is not None:
                dm.load_state(ckpt)
                dm.set_version(learner.version)
            copts = {"rollout_n": dcfg.rollout_n, **ro.options}
            try:
                ccfg = ControllerConfig(batch_size=ro.batch_size, eta=ro.eta, max_concurrent=ro.envs, seed=cfg.seed, **copts)
            except TypeError as e:
                raise TrainError(f"rollout.options: {e}") from None

            scheduler: RolloutScheduler[Rollout, EpisodeRecord] = RolloutScheduler(self._run_one_factory(
                by_id, suite_cache(suite, Path(cfg.suite), None, self.run_dir, True), url, token, servers,
                EpisodeConfig(max_steps=ro.max_steps, time_limit_s=ro.episode_time_limit_s, infra_retries=0,
                              work_dir=self.run_dir / ".work"),
                LocalBlobStore(self.run_dir), JsonlSink(self.run_dir / "episodes.jsonl")), ro.envs)

            async def submit(task_id: str, n: int, version: int) -> None:
                for _ in range(n):
                    self.rollout_seq += 1
                    scheduler.submit(Rollout(task_id, self.rollout_seq, version))

            controller = RolloutController(list(by_id), submit, ccfg, task_stats=dm.task_stats)
            if ckpt is not None:
                controller.load(ckpt / RC_STATE)
            controller.set_version(learner.version)

            consumer = asyncio.create_task(self._consume(scheduler, dm, controller))
            filler = asyncio.create_task(controller.run(self.stop))
            try:
                await self._learn(learner, dm, controller, sync, n_groups, consumer)
            finally:
                self.stop.set()
                filler.cancel()
                consumer.cancel()
                await scheduler.aclose()
                if self.farm is not None:
                    farm, self.farm = self.farm, None
                    with contextlib.suppress(Exception):
                        await farm.__aexit__(None, None, None)
                for t in (filler, consumer):
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
        finally:
            for proc in self.processes:
                await asyncio.to_thread(proc.stop)
            if farm_server is not None:
                await asyncio.to_thread(farm_server.stop)
            if cfg.metrics.plot:
                with contextlib.suppress(Exception):
                    metrics.plot()
            metrics.close()
        return self.summary(start_version)

    def _run_one_factory(self, by_id: dict[str, Task], cache: FileCache, url: str, token: str,
                         servers: list[PolicyServer], ecfg: EpisodeConfig, blobs: BlobStore,
                         sink: JsonlSink) -> Callable[[Rollout], Awaitable[EpisodeRecord]]:
        async def run_one(item: Rollout) -> EpisodeRecord:
            self.in_flight[id(item)] = time.monotonic()
            if self.farm is None:
                self.farm = AsyncFarm(url, token)
                await self.farm.__aenter__()
            farm = self.farm
            task_id, seq = item.task_id, item.seq
            server = servers[seq % len(servers)]
            model, version = self.sync.route(server)
            if version is not None:
                self.in_flight_versions[id(item)] = version
            agent = self.make_agent(server.url, model)
            try:
                res = await run_episode(farm, by_id[task_id], agent, cache, ecfg, self.run_id)
            finally:
                self.in_flight_versions.pop(id(item), None)
            if version is not None:
                tag_versions(res.steps, version)
            # every rollout of a task is its own episode (the runner's ids are per task and attempt)
            res.episode_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"osfarm:{self.run_id}:{task_id}:{seq}"))
            rec = await asyncio.to_thread(episode_record, res, self.run_id, blobs)
            await asyncio.to_thread(sink.publish, rec)
            return rec

        return run_one

    async def _consume(self, scheduler: RolloutScheduler[Rollout, EpisodeRecord], dm: DataManager,
                       controller: RolloutController) -> None:
        async for done in scheduler.results():
            rec = done.result
            if rec is None:
                outcome = f"error: {type(done.error).__name__}: {done.error}"
                self.console.print(f"[yellow]rollout failed[/]: {outcome}", highlight=False)
                controller.on_episode(done.item.task_id, False)
            else:
                outcome = dm.add(rec, self.run_dir)
                controller.on_episode(rec["task_id"], outcome == "accepted")
            self.in_flight.pop(id(done.item), None)
            self.window.add(rec, outcome if rec is not None else "error", done.started, done.finished)
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
                     n_groups: int, consumer: asyncio.Task[None]) -> None:
        cfg, eta = self.cfg, self.cfg.rollout.eta
        while learner.version < cfg.updates and not self.stop.is_set():
            get = asyncio.create_task(dm.get_batch(n_groups))
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
            samples = [s for s in batch.samples if s.policy_version is None or learner.version - s.policy_version <= eta]
            self.totals["stale_dropped"] += len(batch.samples) - len(samples)
            if not samples:
                continue
            stale = staleness_of(samples, learner.version)
            t_update = time.monotonic()
            stats = await self.in_learner(learner.update, samples)
            update_s = time.monotonic() - t_update
            version = stats.version
            t_sync = time.monotonic()
            dm.set_version(version)  # pending episodes now outside the window are dropped before saving

            def write_states(d: Path) -> None:
                dm.save_state(d)
                controller.save(d / RC_STATE)

            ckpt = await self.in_learner(learner.save, self.ckpt_root / f"v{version}",
                                           {"run_dir": str(self.run_dir), "totals": self.totals}, write_states)
            results = await self._sync(sync, ckpt, version)
            for err in await sync.prune(set(self.in_flight_versions.values())):
                self.console.print(f"[yellow]adapter unload failed[/]: {err}", highlight=False)
            sync_s = time.monotonic() - t_sync
            controller.set_version(version)  # only now may rollouts count on the new weights
            await asyncio.to_thread(controller.save, ckpt / RC_STATE)  # the checkpoint's copy at the new version
            self._prune_checkpoints()
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
            "staleness_max": max(stale) if stale else 0,
            "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
            "sample_versions": sorted({s.policy_version for s in samples if s.policy_version is not None}),
            "loss": stats.loss,
            "kl": stats.extra.get("loss/approx_kl"),
            "kl_behav": stats.extra.get("loss/behav_kl"),
            "entropy": stats.entropy,
            "grad_norm": stats.grad_norm,
            "clip_frac": stats.extra.get("loss/clip_frac"),
            "update_s": update_s,
            "sync_s": sync_s,
            "sync_ok": all(r.ok for r in results),
            "server_versions": [r.version for r in results if r.ok],
            "groups": len(batch.groups),
            "capacity": controller.capacity(),
            "outcomes": w.outcomes,
            "eta": self.cfg.rollout.eta,
            "counters": dict(self.learner.counters),
        }
        self.metrics.log(row)

    def _prune_checkpoints(self) -> None:
        keep = self.cfg.keep_checkpoints
        dirs = sorted((d for d in self.ckpt_root.iterdir() if d.is_dir() and d.name[1:].isdigit()),
                      key=lambda d: int(d.name[1:]))
        for d in dirs[:-keep]:
            shutil.rmtree(d, ignore_errors=True)

    def summary(self, start_version: int) -> dict[str, Any]:
        rows = self.metrics.rows() if hasattr(self, "metrics") else []
        return {"run_dir": str(self.run_dir), "start_version": start_version,
                "version": self.learner.version if hasattr(self, "learner") else start_version,
                "counters": dict(self.learner.counters) if hasattr(self, "learner") else {},
                "totals": self.totals, "rows": len(rows),
                "plot": str(self.run_dir / "curves.png") if (self.run_dir / "curves.png").is_file() else None}


def checkpoint_state(run_dir: Path) -> dict[str, Any] | None:
    """The trainer state of a run dir's latest checkpoint (None before the first update)."""
    ckpt = latest_checkpoint(Path(run_dir) / CHECKPOINTS)
    return read_state(ckpt) if ckpt else None


def train(cfg: TrainConfig, console: Console | None = None) -> dict[str, Any]:
    """Run a training run to ``cfg.updates`` policy versions (SIGTERM/SIGINT stop it cleanly)."""
    trainer = Trainer(cfg, console)

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, trainer.stop.set)
        return await trainer.run()

    summary = asyncio.run(main())
    (trainer.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
