"""``osfarm tasks``: validate, list and measure coverage of OSWorld-format task suites.

Errors print one per line as ``FILE: JSON_PATH: message`` (or ``FILE:LINE:COL: message`` for
bad JSON) and exit 1, so editors and CI can jump to them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from osfarm.http.download import DownloadPolicy
from osfarm.tasks.coverage import KINDS, Coverage, coverage
from osfarm.tasks.fetch import Asset, FetchReport, fetch_assets, suite_assets
from osfarm.tasks.model import TaskError
from osfarm.tasks.suite import Suite, load_suite

tasks_app = typer.Typer(
    help="OSWorld-compatible task suites: validate, list, coverage, fetch their files, audit them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DirArg = Annotated[Path, typer.Argument(help="suite folder (<domain>/<id>.json) or OSWorld evaluation_examples/")]
IndexOpt = Annotated[
    Path | None,
    typer.Option("--index", "-i", help=r"index JSON {domain: \[ids]} (OSWorld test_all.json form)", show_default=False),
]

_STATUS_STYLE = {"implemented": "green", "unsupported": "yellow", "missing": "red"}


def console() -> Console:
    # Wide and markup-free output: ids and reasons must not be folded into unreadable cells.
    return Console(width=200, highlight=False)


def fail_with(e: TaskError) -> None:
    for issue in e.issues:
        typer.echo(str(issue))
    typer.echo(f"{len(e.issues)} error(s)", err=True)
    raise typer.Exit(1)


def _load(directory: Path, index: Path | None) -> Suite:
    try:
        return load_suite(directory, index)
    except TaskError as e:
        fail_with(e)
        raise  # unreachable: fail_with always exits


@tasks_app.command("validate")
def validate(directory: DirArg, index: IndexOpt = None) -> None:
    """Check every task (and the index); print each problem as FILE: PATH: message, exit 1 if any.

    Warnings (tasks that load as OSWorld's runner would run them, e.g. a func
    list shorter than its result list) print as 'warning: FILE: PATH: message'
    and do not fail."""
    try:
        suite = load_suite(directory, index, strict=False)
    except TaskError as e:
        fail_with(e)
        return
    for w in suite.warnings:
        typer.echo(f"warning: {w}")
    if suite.refused:
        fail_with(TaskError([i for r in suite.refused for i in r.issues]))
    warned = f", {len(suite.warnings)} warning(s)" if suite.warnings else ""
    typer.echo(f"ok: {len(suite)} tasks in {len(suite.domains())} domains{warned}")


@tasks_app.command("ls")
def ls(
    directory: DirArg,
    index: IndexOpt = None,
    domain: Annotated[str | None, typer.Option("--domain", "-d", help="only this domain")] = None,
) -> None:
    """List tasks: domain, id, apps, config types, metric function(s), instruction prefix."""
    suite = _load(directory, index)
    tasks = suite.in_domain(domain) if domain else list(suite)
    table = Table(title=f"{len(tasks)} tasks", show_lines=False)
    for col in ("domain", "id", "apps", "config", "func", "instruction"):
        table.add_column(col, overflow="fold")
    for t in tasks:
        table.add_row(
            t.domain,
            t.id,
            ",".join(t.apps),
            ",".join(t.config_types()),
            "+".join(t.evaluator.funcs),
            _prefix(t.instruction, 60),
        )
    console().print(table)


def _prefix(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


@tasks_app.command("coverage")
def coverage_cmd(
    target: Annotated[Path, typer.Argument(help="suite folder, or a TSV index like test_all_index.tsv")],
    index: IndexOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of tables")] = False,
) -> None:
    """Which setup types, getters and metrics the tasks need, with uses and our status."""
    try:
        cov = coverage(target, index)
    except TaskError as e:
        fail_with(e)
        return
    if as_json:
        typer.echo(json.dumps(cov.to_json(), indent=2))
    else:
        _print_tables(cov)
        for line in cov.refused:
            typer.echo(f"refused: {line}")
    if cov.refused:
        raise typer.Exit(1)


def _print_tables(cov: Coverage) -> None:
    con = console()
    con.print(f"{cov.n_tasks} tasks from {cov.source}; {cov.live_web_tasks} open live (non-HuggingFace) URLs")
    for note in cov.notes:
        con.print(f"note: {note}")
    for kind in KINDS:
        s = cov.summary(kind)
        table = Table(
            title=f"{kind}: {s['implemented']} implemented, {s['unsupported']} unsupported, {s['missing']} missing"
        )
        table.add_column("name")
        table.add_column("uses", justify="right")
        table.add_column("tasks", justify="right")
        table.add_column("status", overflow="fold")
        for n in cov.of(kind):
            table.add_row(n.name, str(n.uses), str(n.tasks), f"[{_STATUS_STYLE[n.status]}]{n.label}[/]")
        con.print(table)


AllowHostOpt = Annotated[
    list[str] | None,
    typer.Option("--allow-host", help="download only from this host (repeatable; .example.org = the domain and its "
                 "sub-domains); a host named here may also be a private address. Default: "
                 "$OSFARM_DOWNLOAD_ALLOW_HOSTS, else any host with a public address", show_default=False),
]


def download_policy(allow_host: list[str] | None, max_mb: float, timeout: float, attempts: int = 3) -> DownloadPolicy:
    """The policy of the download options shared by ``tasks fetch``, ``tasks audit`` and ``eval --online``."""
    over: dict[str, object] = {"max_bytes": int(max_mb * (1 << 20)), "timeout_s": timeout, "attempts": attempts}
    if allow_host:
        over["allowed_hosts"] = tuple(allow_host)
    return DownloadPolicy.from_env(**over)


@tasks_app.command("fetch")
def fetch_cmd(
    directory: DirArg,
    cache: Annotated[Path, typer.Option("--cache", help="cache folder to fill (OSWorld's <task_id>/<file> layout)")],
    index: IndexOpt = None,
    domain: Annotated[str | None, typer.Option("--domain", "-d", help="only this domain")] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", "-j", min=1, max=32, help="downloads at once")] = 4,
    allow_host: AllowHostOpt = None,
    max_mb: Annotated[float, typer.Option("--max-mb", min=0.001, help="largest file accepted, MiB")] = 2048.0,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="seconds per file, retries included")] = 600.0,
    attempts: Annotated[
        int, typer.Option("--attempts", min=1, max=10, help="tries per file (a partial file is resumed)")
    ] = 3,
    verify: Annotated[
        bool, typer.Option("--verify", help="re-hash cached files against the manifest; fetch again what changed")
    ] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="show progress bars")] = True,
) -> None:
    """Download every file SUITE's tasks need into --cache, so offline machines can run it.

    Resumable (partial files are continued, cached files skipped), checksummed
    (SHA-256 in <cache>/fetch-manifest.json), bounded (--concurrency, --max-mb,
    --timeout). Task files are hostile: only http(s), no redirect to another
    scheme, no private addresses unless named with --allow-host. Exits 1 when
    any file could not be fetched (each one listed with its task and JSON path)."""
    try:
        suite = load_suite(directory, index, strict=False)
    except TaskError as e:
        fail_with(e)
        return
    tasks = suite.in_domain(domain) if domain else list(suite)
    assets = suite_assets(tasks)
    policy = download_policy(allow_host, max_mb, timeout, attempts)
    con = console()
    report = _run_fetch(assets, cache, policy, concurrency, verify, progress, con)
    for r in report.failed:
        typer.echo(f"{r.status}: {r.asset.task_id}: {r.asset.where}: {r.asset.url}: {r.error}")
    mib = report.bytes_fetched / (1 << 20)
    con.print(f"{len(assets)} files for {len(tasks)} tasks: {report.count('fetched')} fetched ({mib:.1f} MiB), "
              f"{report.count('cached')} already cached, {report.count('linked')} linked, "
              f"{report.count('failed')} failed, {report.count('refused')} refused; "
              f"manifest {cache / 'fetch-manifest.json'}")
    for refused in suite.refused:
        typer.echo(f"refused task file (its files are unknown): {refused.file}")
    if report.failed or suite.refused:
        raise typer.Exit(1)


def _run_fetch(assets: list[Asset], cache: Path, policy: DownloadPolicy, concurrency: int, verify: bool,
               show: bool, con: Console) -> FetchReport:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeElapsedColumn())
    with Progress(*columns, console=con, disable=not show, transient=False) as bars:
        overall = bars.add_task("files", total=len(assets))
        live: dict[int, TaskID] = {}

        def on_progress(asset: Asset, got: int | None, total: int | None) -> None:
            key = id(asset)
            if got is None:  # this asset is done (fetched, cached, linked or failed)
                if key in live:
                    bars.remove_task(live.pop(key))
                bars.advance(overall)
                return
            if key not in live:
                live[key] = bars.add_task(f"  {asset.name[:40]}", total=total)
            bars.update(live[key], completed=got, total=total)

        return asyncio.run(fetch_assets(assets, cache, policy, concurrency=concurrency, verify=verify,
                                        progress=on_progress))

