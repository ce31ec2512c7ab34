"""``osfarm tasks``: validate, list and measure coverage of OSWorld-format task suites.

Errors print one per line as ``FILE: JSON_PATH: message`` (or ``FILE:LINE:COL: message`` for
bad JSON) and exit 1, so editors and CI can jump to them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from osfarm.tasks.coverage import KINDS, Coverage, coverage
from osfarm.tasks.model import TaskError
from osfarm.tasks.suite import Suite, load_suite

tasks_app = typer.Typer(
    help="OSWorld-compatible task suites: validate, list, coverage.",
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


def _console() -> Console:
    # Wide and markup-free output: ids and reasons must not be folded into unreadable cells.
    return Console(width=200, highlight=False)


def _fail(e: TaskError) -> None:
    for issue in e.issues:
        typer.echo(str(issue))
    typer.echo(f"{len(e.issues)} error(s)", err=True)
    raise typer.Exit(1)


def _load(directory: Path, index: Path | None) -> Suite:
    try:
        return load_suite(directory, index)
    except TaskError as e:
        _fail(e)
        raise  # unreachable: _fail always exits


@tasks_app.command("validate")
def validate(directory: DirArg, index: IndexOpt = None) -> None:
    """Check every task (and the index); print each problem as FILE: PATH: message, exit 1 if any.

    Warnings (tasks that load as OSWorld's runner would run them, e.g. a func list shorter than
    its result list) print as 'warning: FILE: PATH: message' and do not fail."""
    try:
        suite = load_suite(directory, index, strict=False)
    except TaskError as e:
        _fail(e)
        return
    for w in suite.warnings:
        typer.echo(f"warning: {w}")
    if suite.refused:
        _fail(TaskError([i for r in suite.refused for i in r.issues]))
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
    _console().print(table)


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
        _fail(e)
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
    con = _console()
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
