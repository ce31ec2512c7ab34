"""``osfarm ui`` (the run pages on their own server) and ``osfarm report export`` (the same pages
as a static site); registered by osfarm/cli.py. The farm serves the dashboard itself
(``osfarm serve --runs DIR``)."""

from __future__ import annotations

import secrets
import signal
import socket
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.panel import Panel

from osfarm.http.hosts import is_loopback_host

out = Console()
err = Console(stderr=True)

report_app = typer.Typer(help="Reports of eval and training runs.", no_args_is_help=True)


def _fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _runs_dir(path: Path) -> Path:
    if not path.is_dir():
        raise _fail(f"{path}: no such directory (the folder holding your run dirs)", 2)
    return path.resolve()


def ui_command(
    runs: Annotated[Path, typer.Option("--runs", help="folder of eval/training run dirs (searched 4 levels deep)")],
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind (0 = any free)")] = 8770,
    token: Annotated[str | None, typer.Option("--token", envvar="OSFARM_UI_TOKEN",
                                                 help="login token (default: generated)", show_default=False)] = None,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="allow binding a non-loopback address")] = False,
) -> None:
    """Browse eval runs (leaderboard, runs, episodes, compare) and training curves in a browser."""
    root = _runs_dir(runs)
    if not is_loopback_host(host) and not allow_remote:
        raise _fail(f"refusing to listen on {host}: run dirs hold model output and screenshots; bind a loopback "
                    "address, or pass --allow-remote if the network is trusted", 2)
    import uvicorn

    from osfarm.dashboard.app import create_ui_app

    token = token or secrets.token_urlsafe(24)
    app = create_ui_app(root, token=token)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise _fail(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port") from None
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/ui/"
    out.print(Panel.fit(f"[bold]dashboard[/] {url}\n[bold]token[/]     {token}\n[bold]runs[/]      {root}",
                        title="osfarm ui"), highlight=False)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None, lifespan="off"))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


@report_app.command("export")
def export_command(
    runs: Annotated[Path, typer.Argument(help="folder of eval/training run dirs")],
    out_dir: Annotated[Path, typer.Option("--out", help="where to write the site")] = Path("site"),
) -> None:
    """Write the leaderboard, run, episode, compare and training pages as a static site."""
    from osfarm.dashboard.export import export_site

    root = _runs_dir(runs)
    if out_dir.resolve() == root or root in out_dir.resolve().parents:
        raise _fail(f"--out {out_dir} is inside the runs dir {root}: pick a folder outside it", 2)
    report = export_site(root, out_dir)
    out.print(f"wrote {report.pages} pages and {report.files} files ({report.bytes / 1e6:.1f} MB) to "
              f"{report.out}/index.html", highlight=False)
    for s in report.skipped[:20]:
        err.print(f"[yellow]skipped[/] {s}", highlight=False, soft_wrap=True)
    if len(report.skipped) > 20:
        err.print(f"[yellow]... and {len(report.skipped) - 20} more skipped files[/]")


@report_app.command("compare")
def compare_command(
    run_a: Annotated[Path, typer.Argument(help="the first eval run dir (its results.json), e.g. the baseline")],
    run_b: Annotated[Path, typer.Argument(help="the second eval run dir, compared against the first")],
    alpha: Annotated[float, typer.Option("--alpha", min=0.0, max=1.0, help="significance level of the verdict")] = 0.05,
) -> None:
    """Is RUN_B's score different from RUN_A's? The paired test over the tasks both ran, with each
    run's mean ± s.e. across repeats, pass@k, pass^k and flip rate (docs/evaluation.md)."""
    from osfarm.dashboard.compare import compare
    from osfarm.dashboard.confined import Refused
    from osfarm.dashboard.runs import EvalRun, RunsRoot

    def load(path: Path, name: str) -> EvalRun:
        if not (path / "results.json").is_file():
            raise _fail(f"{name} {path}: no results.json there (an `osfarm eval --out` dir)", 2)
        try:
            run = RunsRoot(path.resolve()).eval_run(".")
        except Refused as e:
            raise _fail(f"{name} {path}: {e}", 2) from None
        if run.error:
            raise _fail(f"{name} {path}: {run.error}", 2)
        return run

    a, b = load(run_a, "RUN_A"), load(run_b, "RUN_B")
    for name, path, run in (("A", run_a, a), ("B", run_b, b)):
        line = run.repeats.text() if run.repeats else f"{run.summary.overall.text()} (one episode per task)"
        out.print(f"[bold]{name}[/] {path} ({run.agent}): {line}", highlight=False, soft_wrap=True)
    cmp = compare(a, b)
    out.print(f"common tasks: {cmp.common}; success A {cmp.rate_a.short()}, B {cmp.rate_b.short()}; "
              f"B gained {len(cmp.gained)}, lost {len(cmp.lost)}"
              + (f"; only in A {len(cmp.only_a)}, only in B {len(cmp.only_b)}" if cmp.only_a or cmp.only_b else ""),
              highlight=False, soft_wrap=True)
    out.print(cmp.test.text(), highlight=False, soft_wrap=True)
    out.print(f"[bold]{cmp.test.verdict(alpha)}[/]", highlight=False, soft_wrap=True)
