"""A whole run: every task of a suite, up to ``envs`` episodes at once, then the results.

Without a farm URL an in-process farm is started (sandbox provider, ``envs`` warm desktops) and
stopped at the end. Episodes run as asyncio tasks gated by a semaphore, so the next task starts
as soon as one finishes; each finished task is written at once (a killed run keeps what it
finished, and ``resume`` skips tasks that have a ``result.txt``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
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
from osfarm.runner.episode import EpisodeConfig, run_episode
from osfarm.runner.results import (
    BlobStore,
    finished_row,
    summarize,
    write_report,
    write_results,
    write_task,
)
from osfarm.tasks.filecache import FileCache, load_url_map
from osfarm.tasks.suite import OSWORLD_INDEX, Suite, load_suite

URL_MAP_NAMES = ("url_map.json", "url_map.yaml", "url_map.yml")


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

    def agent_options(self) -> dict[str, Any]:
        if self.solutions is not None and self.agent != "replay":
            raise ValueError(f"--solutions is for the replay agent, not {self.agent!r}")
        kw: dict[str, Any] = {"action_space": self.action_space}
        if self.solutions is not None:
            kw["solutions"] = self.solutions
        return kw


def make_cache(suite: Suite, suite_dir: Path, cache: Path | None, out: Path, offline: bool) -> FileCache:
    """The suite's offline cache: ``--cache`` or ``<suite>/cache`` (OSWorld's ``cache/<task>/<file>``
    layout, plus an optional ``url_map.json``); relative task paths resolve against the suite."""
    root = cache if cache is not None else (suite_dir / "cache" if (suite_dir / "cache").is_dir() else out / "cache")
    url_map: dict[str, str] = {}
    for name in URL_MAP_NAMES:
        if (root / name).is_file():
            url_map = load_url_map(root / name)
            break
    return FileCache(root, url_map, suite_dir=suite.root, offline=offline)


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]eval[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), console=console, disable=not enabled, transient=False)


async def run_async(opts: RunOptions, url: str, token: str, console: Console | None = None) -> dict[str, Any]:
    console = console or Console(stderr=True)
    index = opts.index
    if index is None and (Path(opts.suite) / OSWORLD_INDEX).is_file():
        index = Path(opts.suite) / OSWORLD_INDEX  # a suite's own test_all.json fixes its tasks
    suite = load_suite(opts.suite, index)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    make_agent(opts.agent, **opts.agent_options())  # an unknown agent fails before any lease
    cache = make_cache(suite, Path(opts.suite), opts.cache, out, opts.offline)
    run_id = datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    cfg = EpisodeConfig(max_steps=opts.max_steps, time_limit_s=opts.time_limit_s, infra_retries=opts.infra_retries,
                        offline=opts.offline, work_dir=out / ".work", record=opts.record)
    blobs = BlobStore(out)
    rows: dict[str, dict[str, Any]] = {}
    todo = []
    for t in suite:
        row = finished_row(out, t.domain, t.id) if opts.resume else None
        if row is not None:
            rows[t.id] = row
        else:
            todo.append(t)
    started = time.time()
    sem = asyncio.Semaphore(max(1, opts.envs))
    counts = {"success": 0, "failure": 0, "infra_error": 0, "timeout": 0}

    with _progress(console, opts.progress) as progress:
        bar = progress.add_task("", total=len(todo))

        def describe() -> str:
            return " ".join(f"{k}={v}" for k, v in counts.items() if v)

        async with AsyncFarm(url, token) as farm:
            async def one(task: Any) -> None:
                async with sem:
                    agent = make_agent(opts.agent, **opts.agent_options())
                    res = await run_episode(farm, token, task, agent, cache, cfg, run_id)
                rows[task.id] = write_task(out, res, run_id, blobs)
                counts[res.status] += 1
                progress.update(bar, advance=1, description=describe())

            await asyncio.gather(*(one(t) for t in todo))

    ordered = [rows[t.id] for t in suite]
    summary = summarize(ordered, run_id, opts.agent, {
        "suite": str(opts.suite), "index": str(index) if index else None, "envs": opts.envs,
        "max_steps": opts.max_steps, "resumed": len(suite) - len(todo), "ran": len(todo),
        "started_at": started, "finished_at": time.time(), "seconds": round(time.time() - started, 2)})
    write_results(out, summary)
    write_report(out, summary)
    return summary


def run_eval(opts: RunOptions, console: Console | None = None) -> dict[str, Any]:
    """Run the evaluation (starting an in-process farm when ``opts.url`` is None)."""
    if opts.url is not None:
        if not opts.token:
            raise ValueError("--url needs --token (or OSFARM_TOKEN)")
        return asyncio.run(run_async(opts, opts.url, opts.token, console))
    from osfarm.config import load_settings
    from osfarm.farm.api import FarmServer
    from osfarm.providers import make_provider

    n = max(1, opts.envs)
    # one warm spare: the next episode leases it while the desktop just released is being reset
    settings = load_settings(None, **{"port": 0, **opts.farm_overrides, "pool_min": n + 1, "pool_max": n + 1})
    server = FarmServer(settings, make_provider(settings))
    url = server.start(timeout=settings.start_timeout_s + 30)
    try:
        return asyncio.run(run_async(opts, url, server.token, console))
    finally:
        server.stop()


def load_results(out: Path) -> dict[str, Any]:
    return json.loads((out / "results.json").read_text())
