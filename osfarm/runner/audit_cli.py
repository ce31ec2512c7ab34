"""``osfarm tasks audit``: the command (registered under ``osfarm tasks`` by osfarm/cli.py; it runs
episodes, so it lives in the runner's layer, above the task model's ``osfarm tasks`` commands)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from osfarm.client import AsyncFarm
from osfarm.farm.local import local_farm, local_farm_settings
from osfarm.runner.audit import CATEGORIES, AuditReport, TaskAudit, audit_suite, needs_desktop, write_reports
from osfarm.runner.options import FarmTokenOpt, FarmUrlOpt
from osfarm.tasks.cli import DirArg, IndexOpt, console, fail_with
from osfarm.tasks.filecache import suite_cache
from osfarm.tasks.model import TaskError
from osfarm.tasks.suite import Suite, load_suite


def audit_command(
    directory: DirArg,
    index: IndexOpt = None,
    domain: Annotated[str | None, typer.Option("--domain", "-d", help="only this domain")] = None,
    out: Annotated[Path, typer.Option("--out", help="folder for audit.json and audit.html")] = Path("audit"),
    cache: Annotated[
        Path | None,
        typer.Option("--cache", help="the suite's file cache (default <suite>/cache, as eval)", show_default=False),
    ] = None,
    envs: Annotated[int, typer.Option("--envs", min=1, help="tasks audited at once (desktops)")] = 1,
    time_limit: Annotated[
        float, typer.Option("--time-limit", min=10.0, help="seconds per episode (setup + evaluation)")
    ] = 300.0,
    url: FarmUrlOpt = None,
    token: FarmTokenOpt = None,
    provider: Annotated[
        str | None,
        typer.Option("--provider", help="box of the in-process farm: sandbox, docker or libvirt", show_default=False),
    ] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="show a progress bar")] = True,
) -> None:
    """Run the noop and fail agents on every task a desktop here can host; classify each task.

    Categories: free-points (noop scores > 0 on a feasible task: the desktop
    starts in the state the task asks for), broken (setup or evaluation fails on
    a fresh desktop, or FAIL does not score 1 on an infeasible task),
    needs-network (files not in the cache, live web pages, package installs:
    classified without a desktop), unsupported (with the reason), ok. Writes
    OUT/audit.json and OUT/audit.html; exits 1 when any task is free-points or
    broken."""
    try:
        suite = load_suite(directory, index, strict=False)
    except TaskError as e:
        fail_with(e)
        return
    if domain:
        suite = Suite(root=suite.root, tasks=suite.in_domain(domain), index_file=suite.index_file,
                      refused=[r for r in suite.refused if r.domain == domain])
    out.mkdir(parents=True, exist_ok=True)
    fcache = suite_cache(suite, Path(directory), cache, out, offline=True)
    con = console()
    n_run = needs_desktop(suite, fcache)
    con.print(f"{len(suite) + len(suite.refused)} tasks; {n_run} can run on a desktop here (noop, then fail)")
    counts = {c: 0 for c in CATEGORIES}

    async def go(farm_url: str | None, farm_token: str | None) -> AuditReport:
        with Progress(TextColumn("[bold]audit[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                      TimeElapsedColumn(), console=con, disable=not progress) as bars:
            bar = bars.add_task("", total=len(suite) + len(suite.refused))

            def tick(t: TaskAudit) -> None:
                counts[t.category] += 1
                bars.update(bar, advance=1, description=" ".join(f"{k}={v}" for k, v in counts.items() if v))

            if farm_url is None:
                return await audit_suite(suite, None, fcache, out / ".work", envs=envs, time_limit_s=time_limit,
                                         progress=tick, source=str(directory))
            async with AsyncFarm(farm_url, farm_token) as farm:
                return await audit_suite(suite, farm, fcache, out / ".work", envs=envs, time_limit_s=time_limit,
                                         progress=tick, source=str(directory))

    if n_run == 0:
        report = asyncio.run(go(None, None))
    elif url is not None:
        report = asyncio.run(go(url, token))
    else:
        settings = local_farm_settings(envs, provider=provider) if provider else local_farm_settings(envs)
        with local_farm(settings) as server:
            report = asyncio.run(go(server.url, server.token))
    _print_audit(report, con)
    j, h = write_reports(report, out)
    con.print(f"report: {j}  {h}")
    if counts["free-points"] or counts["broken"]:
        raise typer.Exit(1)


def _print_audit(report: AuditReport, con: Console) -> None:
    table = Table(title=f"tasks audit: {report.suite}")
    table.add_column("domain")
    for c in CATEGORIES:
        table.add_column(c, justify="right")
    for dom, counts in report.by_domain().items():
        table.add_row(dom, *(str(counts[c]) for c in CATEGORIES))
    total = report.counts()
    table.add_section()
    table.add_row("total", *(str(total[c]) for c in CATEGORIES))
    con.print(table)
    for t in report.tasks:
        if t.category in ("free-points", "broken", "unsupported"):
            con.print(f"{t.category}: {t.domain}/{t.task_id}: {t.reason}")
