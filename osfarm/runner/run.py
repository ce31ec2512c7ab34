"""A whole run: every task of a suite, up to ``max_concurrent`` episodes at once, then the results.

Scheduling is rollout-wise (``RolloutScheduler``): the next episode starts the moment any
finishes; ``sync_batches`` keeps the batch barrier instead, for comparison. Executors: in
process (episodes are asyncio tasks on one farm; without a farm URL an in-process farm is
started with ``envs`` warm desktops and stopped at the end) or Celery (jobs queued on Redis and
run by ``osfarm worker`` processes on their own farms; same rows and records). Each finished
task is written at once (a killed run keeps what it finished, and ``resume`` skips tasks that
have a ``result.txt``). With ``repeats`` K > 1 every task is run K times, each repeat an
independent episode on a freshly reset desktop (repeats of a task may run at once), and each
repeat written to its own ``repeat-<r>/`` layout (:mod:`osfarm.runner.results`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from osfarm.agents import make_agent
from osfarm.client import AsyncFarm
from osfarm.errors import EpisodeTimeout
from osfarm.farm.local import local_farm, local_farm_settings
from osfarm.http.download import DownloadPolicy
from osfarm.runner.episode import (
    INFRA_ERROR,
    TIMEOUT,
    EpisodeConfig,
    episode_id,
    run_episode,
)
from osfarm.runner.results import (
    BlobStore,
    finished_row,
    repeats_summary,
    summarize,
    write_refused,
    write_report,
    write_results,
    write_task,
)
from osfarm.runner.scheduler import Done, RolloutScheduler
from osfarm.schema.guest import DEFAULT_ACTION_TIMING, ActionTiming
from osfarm.stream.jsonl import JsonlSink
from osfarm.tasks.filecache import FileCache, suite_cache
from osfarm.tasks.suite import OSWORLD_INDEX, Suite, load_suite


@dataclass
class RunOptions:
    suite: Path
    agent: str
    out: Path
    index: Path | None = None
    envs: int = 1
    max_steps: int = 15
    resume: bool = False
    url: str | None = None
    token: str | None = None
    cache: Path | None = None
    offline: bool = True
    time_limit_s: float = 600.0
    infra_retries: int = 2
    action_space: str = "pyautogui"
    progress: bool = True
    record: bool = False
    farm_overrides: dict[str, Any] = field(default_factory=dict)  # FarmSettings for the in-process farm
    solutions: Path | None = None  # replay: <solutions>/<task id>.json instead of each task's trajectory
    # vlm: the policy endpoint, its model name, the prompt format, and any other VLMAgent option
    model_url: str | None = None
    model: str | None = None
    prompt_format: str | None = None
    agent_opts: dict[str, Any] = field(default_factory=dict)
    executor: str = "inprocess"  # inprocess | celery
    broker: str | None = None  # celery: Redis URL
    max_concurrent: int | None = None  # episodes in flight (default: envs)
    sync_batches: bool = False  # batches of max_concurrent with a barrier (the comparison baseline)
    stream_url: str | None = None  # also publish records to this Redis (in-process executor)
    stream: str = "osfarm:episodes"
    action_timing: ActionTiming = DEFAULT_ACTION_TIMING  # how agent actions are paced (TaskEnv's action_timing)
    allow_hosts: tuple[str, ...] | None = None  # --online: the download allow-list (None: $OSFARM_DOWNLOAD_ALLOW_HOSTS)
    repeats: int = 1  # episodes per task (independent, each on a reset desktop); > 1 adds the variance numbers

    def repeat_indices(self) -> list[int | None]:
        """The repeats each task runs: [None] for a run without repeats (the layout it always had)."""
        if self.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {self.repeats}")
        return [None] if self.repeats == 1 else list(range(1, self.repeats + 1))

    def concurrency(self, n_tasks: int = 1) -> int:
        """Episodes in flight: --max-concurrent, else --envs in process; with Celery every task is
        queued at once (the workers' --concurrency is the limit)."""
        if self.max_concurrent is not None:
            return max(1, self.max_concurrent)
        return max(1, n_tasks if self.executor == "celery" else self.envs)

    def agent_options(self) -> dict[str, Any]:
        if self.solutions is not None and self.agent != "replay":
            raise ValueError(f"--solutions is for the replay agent, not {self.agent!r}")
        kw: dict[str, Any] = {"action_space": self.action_space}
        if self.solutions is not None:
            kw["solutions"] = self.solutions
        vlm = {k: v for k, v in (("base_url", self.model_url), ("model", self.model),
                                 ("prompt_format", self.prompt_format)) if v is not None}
        if self.agent == "vlm":
            if self.prompt_format in ("pyautogui", "computer_13") and self.action_space == "pyautogui":
                del kw["action_space"]  # the format fixes the action space; "pyautogui" is only the default
            kw.update(vlm)
            kw.update(self.agent_opts)
        elif self.agent == "choice" and self.prompt_format is None:  # its policy server, model and options
            kw.update(vlm)
            kw.update(self.agent_opts)
        elif vlm or self.agent_opts:
            raise ValueError(f"--model-url, --model, --prompt-format and --agent-opt are for the vlm agent, "
                             f"not {self.agent!r}")
        return kw


def _failed_row(task: Any, repeat: int | None, done: Done[Any, Any], run_id: str) -> dict[str, Any]:
    """The row of an episode whose executor failed (a Celery worker error, a hard time limit)."""
    err = done.error
    status = TIMEOUT if isinstance(err, EpisodeTimeout) else INFRA_ERROR  # Celery's time limit stopped it
    row = {"task_id": task.id, "domain": task.domain, "status": status, "score": 0.0,
           "error": f"{type(err).__name__}: {err}", "steps": 0, "attempts": 1,
           "seconds": round(done.finished - done.started, 2), "episode_id": episode_id(run_id, task.id, repeat)}
    if repeat is not None:
        row["repeat"] = repeat
    return row


async def _episode_runner(opts: RunOptions, stack: contextlib.AsyncExitStack, suite: Suite, index: Path | None,
                          url: str | None, token: str | None, cache: FileCache, cfg: EpisodeConfig, run_id: str,
                          out: Path, blobs: BlobStore
                          ) -> Callable[[Any], Awaitable[tuple[dict[str, Any], dict[str, Any] | None]]]:
    """``(task, repeat) -> (row, record)`` for the chosen executor."""
    if opts.executor == "inprocess":
        farm = await stack.enter_async_context(AsyncFarm(url, token))

        async def in_process(item: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
            task, repeat = item
            agent = make_agent(opts.agent, **opts.agent_options())  # a fresh agent: repeats share no state
            res = await run_episode(farm, task, agent, cache, cfg, run_id, repeat)
            recs: list[dict[str, Any]] = []
            row = write_task(out, res, run_id, blobs, emit=recs.append)
            return row, recs[0]

        return in_process
    if opts.executor != "celery":
        raise ValueError(f"unknown executor {opts.executor!r}; use inprocess or celery")
    from osfarm.runner.executors.celery_exec import CeleryExecutor

    if not opts.broker:
        raise ValueError("--executor celery needs --broker redis://HOST:PORT/DB (or OSFARM_BROKER)")
    CeleryExecutor.check_limits(opts.time_limit_s, opts.infra_retries)
    ex = CeleryExecutor(opts.broker)
    stack.callback(ex.close)
    agent_options = {k: str(v) if isinstance(v, Path) else v for k, v in opts.agent_options().items()}
    base = {"run_id": run_id, "suite": str(Path(opts.suite).resolve()),
            "index": str(Path(index).resolve()) if index else None,
            "agent": opts.agent, "agent_options": agent_options, "out": str(out.resolve()),
            "cache": str(Path(opts.cache).resolve()) if opts.cache else None, "offline": opts.offline,
            "episode": {"max_steps": opts.max_steps, "time_limit_s": opts.time_limit_s,
                        "infra_retries": opts.infra_retries, "record": opts.record,
                        "action_timing": opts.action_timing}}

    async def on_celery(item: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
        task, repeat = item
        got = await ex.run({**base, "task_id": task.id, **({"repeat": repeat} if repeat is not None else {})})
        return got["row"], got["record"]

    return on_celery


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]eval[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), console=console, disable=not enabled, transient=False)


async def run_async(
    opts: RunOptions, url: str | None, token: str | None, console: Console | None = None
) -> dict[str, Any]:
    console = console or Console(stderr=True)
    index = opts.index
    if index is None and (Path(opts.suite) / OSWORLD_INDEX).is_file():
        index = Path(opts.suite) / OSWORLD_INDEX  # a suite's own test_all.json fixes its tasks
    suite = load_suite(opts.suite, index, strict=False)  # a bad task file costs that task, not the run
    repeats = opts.repeat_indices()  # bad --repeats fails before any file is written
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    make_agent(opts.agent, **opts.agent_options())  # an unknown agent fails before any lease
    policy = DownloadPolicy.from_env(**({"allowed_hosts": opts.allow_hosts} if opts.allow_hosts else {}))
    cache = suite_cache(suite, Path(opts.suite), opts.cache, out, opts.offline, policy)
    run_id = datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    cfg = EpisodeConfig(max_steps=opts.max_steps, time_limit_s=opts.time_limit_s, infra_retries=opts.infra_retries,
                        offline=opts.offline, work_dir=out / ".work", record=opts.record,
                        action_timing=opts.action_timing)
    blobs = BlobStore(out)
    rows: dict[tuple[str, int | None], dict[str, Any]] = {}
    todo = []
    for t in suite:
        for rep in repeats:
            row = finished_row(out, t.domain, t.id, rep) if opts.resume else None
            if row is not None:
                rows[t.id, rep] = row
            else:
                todo.append((t, rep))
    started = time.time()
    counts = {"success": 0, "failure": 0, "infra_error": 0, "timeout": 0}
    jsonl = JsonlSink(out / "episodes.jsonl")
    refused_rows = []
    for r in suite.refused:
        row = write_refused(out, r, run_id, opts.agent, opts.action_timing)
        refused_rows.append(row)
        counts[INFRA_ERROR] += 1
    stream_sink = None
    if opts.stream_url:
        from osfarm.stream.redis_stream import RedisStreamSink

        stream_sink = RedisStreamSink(opts.stream_url, opts.stream)

    with _progress(console, opts.progress) as progress:
        bar = progress.add_task("", total=len(todo))

        def describe() -> str:
            return " ".join(f"{k}={v}" for k, v in counts.items() if v)

        async with contextlib.AsyncExitStack() as stack:
            run_one = await _episode_runner(opts, stack, suite, index, url, token, cache, cfg, run_id, out, blobs)
            sched: RolloutScheduler[Any, tuple[dict[str, Any], dict[str, Any] | None]] = RolloutScheduler(
                run_one, opts.concurrency(len(todo)), sync_batches=opts.sync_batches)
            for item in todo:
                sched.submit(item)
            sched.close()
            async for done in sched.results():
                task, repeat = done.item
                if done.error is not None:  # the executor itself failed: counted, never a crash
                    row, rec = _failed_row(task, repeat, done, run_id), None
                else:
                    if done.result is None:  # run_one returns its (row, record) whenever it does not raise
                        raise RuntimeError(f"task {task.id}: the episode runner returned nothing and raised nothing")
                    row, rec = done.result
                rows[task.id, repeat] = row
                if rec is not None:
                    jsonl.publish(rec)
                    if stream_sink is not None and opts.executor == "inprocess":  # workers publish their own
                        await asyncio.to_thread(stream_sink.publish, rec)
                counts[row["status"]] += 1
                progress.update(bar, advance=1, description=describe())

    ran_rows = [rows[t.id, rep] for t in suite for rep in repeats]
    ordered = ran_rows + refused_rows
    summary = summarize(ordered, run_id, opts.agent, {
        "suite": str(opts.suite), "index": str(index) if index else None, "envs": opts.envs,
        "executor": opts.executor, "max_concurrent": opts.concurrency(len(todo)), "sync_batches": opts.sync_batches,
        "action_timing": opts.action_timing,
        "max_steps": opts.max_steps, "resumed": len(suite) * len(repeats) - len(todo), "ran": len(todo),
        "repeats": opts.repeats, **(repeats_summary(ran_rows) if opts.repeats > 1 else {}),
        "refused": len(refused_rows),
        "started_at": started, "finished_at": time.time(), "seconds": round(time.time() - started, 2)})
    write_results(out, summary)
    write_report(out, summary)
    return summary


def run_eval(opts: RunOptions, console: Console | None = None) -> dict[str, Any]:
    """Run the evaluation (starting an in-process farm when ``opts.url`` is None)."""
    if opts.executor == "celery":  # the workers bring their farms
        return asyncio.run(run_async(opts, None, None, console))
    if opts.url is not None:
        if not opts.token:
            raise ValueError("--url needs --token (or OSFARM_TOKEN)")
        return asyncio.run(run_async(opts, opts.url, opts.token, console))
    with local_farm(local_farm_settings(opts.envs, **opts.farm_overrides)) as server:
        return asyncio.run(run_async(opts, server.url, server.token, console))


def load_results(out: Path) -> dict[str, Any]:
    return json.loads((out / "results.json").read_text())
