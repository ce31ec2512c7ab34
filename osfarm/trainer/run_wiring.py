"""What one ``osfarm train`` run starts before its first rollout and must stop again, whatever
ends it: the learner's thread and CPUs, the learner (its other ranks), the metrics sinks, the
policy servers (spawned ones, their supervisor, weight sync), the farm and the farm client.

:class:`RunResources` owns them through one :class:`contextlib.AsyncExitStack`: each part
registers its own teardown the moment it exists, so a run that finishes, fails halfway through
its start or is stopped by a signal tears down exactly what it started, in the reverse order.
The training loop (``osfarm/trainer/loop.py``) asks it for each part in turn and adds its own
rollouts' teardown on top.

The parts the config alone describes, which need no teardown, are built here too: the learner
(:func:`load_learner`, also for ranks > 0), the tasks (:func:`load_tasks`), a rollout's agent
(:func:`rollout_agent`) and the data manager's and rollout controller's options
(:func:`data_config`, :func:`controller_config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from rich.console import Console

from osfarm.agents import Agent, make_agent
from osfarm.client import AsyncFarm
from osfarm.config import FarmSettings
from osfarm.errors import OsfarmError
from osfarm.farm.local import local_farm_settings, start_local_farm
from osfarm.farm.server import FarmServer
from osfarm.policy.client import PolicyServer
from osfarm.policy.process import PolicyProcess, PolicyStartError
from osfarm.policy.run_budget import ServerBudget
from osfarm.policy.tiny import tiny_model_dir
from osfarm.tasks.model import Task
from osfarm.tasks.suite import OSWORLD_INDEX, Suite, load_suite
from osfarm.trainer.checkpoint import latest_checkpoint, model_dir, read_state
from osfarm.trainer.config import AgentSection, TrainConfig
from osfarm.trainer.data_manager import DataConfig
from osfarm.trainer.distributed import DistContext
from osfarm.trainer.learner import Learner, LearnerOptions
from osfarm.trainer.metrics import TrainMetrics
from osfarm.trainer.rollout_controller import ControllerConfig
from osfarm.trainer.weight_sync import SyncResult, WeightSync

P = ParamSpec("P")
R = TypeVar("R")


class TrainError(OsfarmError, RuntimeError):
    """A run that cannot start or go on (the message says why)."""


def pin_learner(cpus: set[int]) -> None:
    """Learner thread setup: its CPUs, and as many torch threads as it has CPUs."""
    import torch

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def learner_options(cfg: TrainConfig, rank: int = 0) -> tuple[LearnerOptions, str | None]:
    """The learner's options for this run (the decay runs over the run's steps unless given) and
    the rank's device from the device map (None: the learner picks)."""
    lo = cfg.learner
    update: dict[str, Any] = {}
    if lo.total_steps is None:
        update["total_steps"] = cfg.updates * lo.minibatches
    update["budget"] = cfg.budget  # the learner's processor and sample limits are the run's budget
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


def load_tasks(cfg: TrainConfig, suite_dir: Path | None = None,
               ids: list[str] | None = None) -> tuple[Suite, list[Task]]:
    """The suite at ``suite_dir`` (the training suite by default) and the tasks ``ids`` names (all
    when empty; the config's training tasks by default)."""
    suite_dir = Path(suite_dir or cfg.suite)
    ids = cfg.tasks if ids is None else ids
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


def rollout_agent_options(a: AgentSection, base_url: str, name: str, seed: int | None = None) -> dict[str, Any]:
    """The options (JSON: a queued rollout's job carries them) of one rollout's ``a.kind`` agent,
    asking the policy server at ``base_url`` for model ``name``."""
    if a.kind == "choice":
        return {"base_url": base_url, "model": name, "choices": a.choices, "temperature": a.temperature,
                "timeout_s": a.timeout_s, "screenshot": a.screenshot, "seed": seed,
                "history_turns": a.history_turns, "history_images": a.history_images}
    return {"base_url": base_url, "model": name, "prompt_format": a.prompt_format, "observation": a.observation,
            "history_turns": a.history_turns, "history_images": a.history_images, "temperature": a.temperature,
            "max_tokens": a.reply_tokens(), "timeout_s": a.timeout_s, "capture_logprobs": True, "seed": seed,
            "top_logprobs": a.top_logprobs,
            **{k: v for k, v in (("min_pixels", a.min_pixels), ("max_pixels", a.max_pixels)) if v is not None}}


def rollout_agent(a: AgentSection, base_url: str, name: str, seed: int | None = None) -> Agent:
    """The agent of one rollout, asking the policy server at ``base_url`` for model ``name``."""
    return make_agent(a.kind, **rollout_agent_options(a, base_url, name, seed))


def data_config(cfg: TrainConfig, ctx: DistContext) -> DataConfig:
    """The data manager's options: ``data.options`` over what the run's rollout settings imply."""
    options = dict(cfg.data.options)
    options.setdefault("version_window", cfg.rollout.eta)
    options.setdefault("min_failure_steps", 1)
    if cfg.rollout.interruptible:
        options.setdefault("episode_version", "end")
    if ctx.multi_node:  # the other machines' ranks cannot read this one's blob paths
        options.setdefault("image_mode", "data_url")
    try:
        return DataConfig(**options)
    except (TypeError, ValueError) as e:
        raise TrainError(f"data.options: {e}") from None


def controller_config(cfg: TrainConfig, dcfg: DataConfig) -> ControllerConfig:
    """The rollout controller's options: ``rollout.options`` over the rollout settings and the
    data manager's group plan."""
    ro = cfg.rollout
    copts = {"rollout_n": dcfg.rollout_n, "rollout_threshold": dcfg.rollout_threshold,
             "min_group_size": dcfg.min_group_size, **ro.options}
    if dcfg.group_size is not None:  # a fixed group size in the data options means the same plan
        copts.setdefault("allocator", "fixed")
        copts.setdefault("group_size", dcfg.group_size)
    try:
        ccfg = ControllerConfig(batch_size=ro.batch_size, eta=ro.eta, max_concurrent=ro.envs, seed=cfg.seed,
                                curriculum=ro.curriculum, **copts)
    except (TypeError, ValueError) as e:
        raise TrainError(f"rollout.options: {e}") from None
    return ccfg


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel a background task and wait for it to end (how it ends no longer matters)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def in_process_farm_settings(cfg: TrainConfig) -> FarmSettings:
    """The run's own farm: ``rollout.envs`` desktops busy at once plus ``farm.spares`` ready."""
    return local_farm_settings(cfg.rollout.envs, cfg.farm.spares, **cfg.farm.overrides)


class RunResources:
    """The started parts of one training run, torn down in reverse order on any exit.

    ``async with RunResources(...) as res:`` then ``res.split_cpus()``, ``await res.load_learner()``,
    ``res.open_metrics()``, ``await res.start_policy(...)``, ``await res.start_weight_sync(...)``,
    ``await res.start_farm()``; what was never started is None (or an empty list), and has
    nothing to tear down.
    """

    def __init__(self, cfg: TrainConfig, console: Console, ctx: DistContext, run_dir: Path, ckpt_root: Path,
                 stop: asyncio.Event, totals: dict[str, Any]):
        self.cfg = cfg
        self.console = console
        self.ctx = ctx
        self.run_dir = run_dir
        self.ckpt_root = ckpt_root
        self.stop = stop  # set: the run is ending (the supervisor starts nothing again)
        self.totals = totals  # the trainer's run totals (sync failures, policy restarts are counted here)
        self.stack = contextlib.AsyncExitStack()
        self.learner_pool: ThreadPoolExecutor | None = None  # None: asyncio's default executor
        self.processes: list[PolicyProcess] = []  # the policy servers this run spawned
        self.farm: AsyncFarm | None = None  # opened by the first rollout, on the event loop

    async def __aenter__(self) -> RunResources:
        await self.stack.__aenter__()
        self.stack.callback(self._shutdown_learner_pool)
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self.stack.__aexit__(*exc)

    # -- the learner ---------------------------------------------------------------------------------

    def split_cpus(self) -> set[int] | None:
        """With ``learner_cpus``: this thread (and every thread and process started from it from now
        on) goes to the other CPUs, the learner gets a thread of its own on those. Returns the
        thread's previous CPUs (given back on exit), None when nothing is pinned."""
        cpus = self.cfg.learner_cpus
        if not cpus:
            return None
        allowed = os.sched_getaffinity(0)
        if not set(cpus) < allowed:
            raise TrainError(f"learner_cpus {cpus}: must be a proper subset of this process's CPUs {sorted(allowed)} "
                             "(the farm, desktops and policy servers need the others)")
        os.sched_setaffinity(0, allowed - set(cpus))
        self.stack.callback(os.sched_setaffinity, 0, allowed)
        self.learner_pool = ThreadPoolExecutor(1, thread_name_prefix="learner", initializer=pin_learner,
                                               initargs=(set(cpus),))
        return allowed

    def _shutdown_learner_pool(self) -> None:
        if self.learner_pool is not None:
            self.learner_pool.shutdown(wait=False)

    async def in_learner(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run blocking learner work on the learner's thread (its own CPUs when pinned)."""
        if self.learner_pool is None and self.ctx.enabled:  # one thread: the ranks' collectives stay in order
            self.learner_pool = ThreadPoolExecutor(1, thread_name_prefix="learner")
        return await asyncio.get_running_loop().run_in_executor(self.learner_pool,
                                                                functools.partial(fn, *args, **kwargs))

    async def load_learner(self) -> tuple[Learner, Path | None]:
        """The learner (resumed from the run's latest checkpoint, which is returned, or fresh);
        its other ranks are released on exit."""
        # osfarm's one progress display for the slow start steps (transformers' bars are off)
        with self.console.status(f"loading the policy model ({self.cfg.model}) ..."):
            learner, latest = await self.in_learner(self._load_learner)
        self.stack.callback(learner.stop_workers)
        return learner, latest

    def _load_learner(self) -> tuple[Learner, Path | None]:
        learner, latest = load_learner(self.cfg, self.ckpt_root, self.ctx)
        if latest is not None:
            self.console.print(f"resumed from {latest} (version {learner.version})", highlight=False)
        return learner, latest

    # -- metrics -------------------------------------------------------------------------------------

    def open_metrics(self) -> TrainMetrics:
        """The run's metrics sinks; on exit the curves are drawn (``metrics.plot``) and they close."""
        cfg = self.cfg
        metrics = TrainMetrics(self.run_dir, self.console, cfg.metrics.prometheus_port,
                               tensorboard=cfg.metrics.tensorboard, wandb=cfg.metrics.wandb,
                               config=json.loads(cfg.model_dump_json()))
        self.stack.callback(self._close_metrics, metrics)
        return metrics

    def _close_metrics(self, metrics: TrainMetrics) -> None:
        if self.cfg.metrics.plot:
            with contextlib.suppress(Exception):  # a plot that fails must not hide how the run ended
                metrics.plot()
        metrics.close()

    # -- the policy servers --------------------------------------------------------------------------

    async def start_policy(self, model: Path, version: int) -> list[PolicyServer]:
        """The configured servers, or ``policy.spawn`` servers of our own on ``model`` as
        ``version`` (stopped on exit, those that started and those that did not)."""
        p = self.cfg.policy
        if p.servers:
            return list(p.servers)
        self.stack.push_async_callback(self._stop_policy)
        threads = max(1, (os.cpu_count() or 2) // 2)
        devices = self.cfg.devices.policy
        for i in range(p.spawn):
            env = None
            if devices and devices[i].startswith("cuda"):
                env = {"CUDA_VISIBLE_DEVICES": devices[i].partition(":")[2] or "0"}
            self.processes.append(PolicyProcess(model, version, p.model_name, self.run_dir / f"policy-{i}.log",
                                                delay_ms=p.delay_ms, threads=threads, delay_sigma=p.delay_sigma,
                                                env=env, extra_args=ServerBudget.of(self.cfg.budget).serve_args()))
        with self.console.status(f"starting {p.spawn} policy server(s) ..."):
            for proc in self.processes:
                try:
                    await proc.wait_ready(p.start_timeout_s)
                except PolicyStartError as e:
                    raise TrainError(str(e)) from None
        return [PolicyServer(url=proc.url, kind="osfarm") for proc in self.processes]

    async def _stop_policy(self) -> None:
        for proc in self.processes:
            await asyncio.to_thread(proc.stop)

    async def start_weight_sync(self, servers: list[PolicyServer], ckpt: Path | None, learner: Learner) -> WeightSync:
        """Weight sync to ``servers``, each at the learner's version: running servers (not ours) are
        brought there, our own started on it; our own are watched until exit (see ``_supervise``)."""
        sync = WeightSync(servers, base_model=self.cfg.policy.model_name, wave=self.cfg.policy.sync_wave,
                          max_adapters=self.cfg.policy.max_adapters)
        if self.cfg.policy.servers:
            await self._bring_servers_up(sync, ckpt, learner.version)
        else:  # spawned on the current weights
            for s in servers:
                sync.versions[s.url] = learner.version
        if self.processes:
            supervisor = asyncio.create_task(self._supervise(sync, learner))
            self.stack.push_async_callback(cancel_and_wait, supervisor)
        return sync

    async def sync_to(self, sync: WeightSync, path: Path, version: int) -> list[SyncResult]:
        """Push checkpoint ``path`` (policy version ``version``) to every server; failures are
        counted and shown, not raised (the run goes on with the servers that have it)."""
        results = await sync.sync(path, version)
        for r in results:
            if not r.ok:
                self.totals["sync_failures"] += 1
                self.console.print(f"[red]weight sync failed[/]: {r.error}", highlight=False)
        return results

    async def _supervise(self, sync: WeightSync, learner: Learner, every_s: float = 2.0) -> None:
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
                    learner.model_path, learner.version)
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
        results = await self.sync_to(sync, ckpt, version)
        if not any(r.ok for r in results):
            raise TrainError(f"no policy server could be brought to the resumed version {version}: "
                             + "; ".join(r.error or "?" for r in results))

    # -- the farm ------------------------------------------------------------------------------------

    async def start_farm(self) -> tuple[str, str]:
        """The farm's URL and token: the configured farm, or a local one of our own (stopped on
        exit); the farm client the rollouts open (``farm_client``) closes before it."""
        url, token, server = await asyncio.to_thread(self._start_farm)
        if server is not None:
            self.stack.push_async_callback(asyncio.to_thread, server.stop)
        self.stack.push_async_callback(self._close_farm_client)
        return url, token

    def _start_farm(self) -> tuple[str, str, FarmServer | None]:
        f = self.cfg.farm
        if f.url:
            token = f.token or os.environ.get("OSFARM_TOKEN")
            if not token:
                raise TrainError("farm.url needs farm.token (or OSFARM_TOKEN)")
            return f.url, token, None
        server = start_local_farm(in_process_farm_settings(self.cfg))
        return server.url, server.token, server

    async def farm_client(self, url: str, token: str) -> AsyncFarm:
        """The one farm client of the run's rollouts, opened by the first (on the event loop)."""
        if self.farm is None:
            self.farm = AsyncFarm(url, token)
            await self.farm.__aenter__()
        return self.farm

    async def _close_farm_client(self) -> None:
        if self.farm is not None:
            farm, self.farm = self.farm, None
            with contextlib.suppress(Exception):
                await farm.__aexit__(None, None, None)
