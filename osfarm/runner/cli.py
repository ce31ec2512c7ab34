"""``osfarm eval``: run an agent on a suite of OSWorld-format tasks (registered by osfarm/cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from osfarm.runner.options import FarmTokenOpt, FarmUrlOpt
from osfarm.schema.guest import DEFAULT_ACTION_TIMING

if TYPE_CHECKING:
    from osfarm.schema.guest import ActionTiming


def eval_command(
    suite: Annotated[
        Path, typer.Option("--suite", help="folder of <domain>/<id>.json tasks (or OSWorld's evaluation_examples/)")
    ],
    agent: Annotated[str, typer.Option("--agent", help="agent name: replay, noop, fail, vlm, choice")] = "replay",
    index: Annotated[
        Path | None,
        typer.Option("--index", help="index file {domain: [ids]} (default: every task; OSWorld's test_all.json when "
                     "present)", show_default=False),
    ] = None,
    envs: Annotated[int, typer.Option("--envs", min=1, help="episodes run at once (desktops)")] = 1,
    max_steps: Annotated[int, typer.Option("--max-steps", min=1, help="agent steps per episode")] = 15,
    out: Annotated[Path, typer.Option("--out", help="run directory")] = Path("results"),
    resume: Annotated[bool, typer.Option("--resume", help="skip tasks whose result.txt exists in --out")] = False,
    repeats: Annotated[
        int,
        typer.Option("--repeats", min=1, help="run each task K times, each an independent episode on a reset desktop "
                     "(repeat r under <out>/repeat-<r>/); results.json adds per-task success counts, mean ± s.e. "
                     "across repeats, pass@k, pass^k and the flip rate"),
    ] = 1,
    url: FarmUrlOpt = None,
    token: FarmTokenOpt = None,
    cache: Annotated[
        Path | None, typer.Option("--cache", help="offline file cache (default <suite>/cache)", show_default=False)
    ] = None,
    offline: Annotated[
        bool,
        typer.Option("--offline/--online", help="never download task files (--online: download what the cache lacks, "
                     "as `osfarm tasks fetch` does)"),
    ] = True,
    allow_host: Annotated[
        list[str] | None,
        typer.Option("--allow-host", help="--online: download only from this host (repeatable; default "
                     "$OSFARM_DOWNLOAD_ALLOW_HOSTS, else any public host)", show_default=False),
    ] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", help="wall-clock seconds per episode")] = 600.0,
    retries: Annotated[int, typer.Option("--retries", min=0, help="retries of an infra error per task")] = 2,
    action_space: Annotated[str, typer.Option("--action-space", help="pyautogui or computer_13")] = "pyautogui",
    action_timing: Annotated[
        str,
        typer.Option("--action-timing", envvar="OSFARM_ACTION_TIMING",
                     help="settle: OSWorld's semantics (each code action a fresh python state, pyautogui's "
                     "defaults), each 0.1 s pause cut short once the screen answered; osworld: paced exactly as "
                     "OSWorld paces them (each code action a new python, the whole pause after every call), for "
                     "exact replication; fast: one kept interpreter, no pause, observations wait for the screen to "
                     "settle (recorded in results.json and every episode record)"),
    ] = DEFAULT_ACTION_TIMING,
    width: Annotated[int | None, typer.Option(help="screen width (in-process farm)", show_default=False)] = None,
    height: Annotated[int | None, typer.Option(help="screen height (in-process farm)", show_default=False)] = None,
    provider: Annotated[
        str | None,
        typer.Option("--provider", help="box of the in-process farm: sandbox, docker or libvirt (default: "
                     "OSFARM_PROVIDER or sandbox)", show_default=False),
    ] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="show a progress bar")] = True,
    record: Annotated[
        bool, typer.Option("--record/--no-record", help="save each episode's screen as recording.mp4")
    ] = False,
    solutions: Annotated[
        Path | None,
        typer.Option("--solutions", help="replay: folder of <task id>.json solutions (instead of each task's "
                     "trajectory)", show_default=False),
    ] = None,
    model_url: Annotated[
        str | None,
        typer.Option("--model-url", envvar="OSFARM_MODEL_URL",
                     help="vlm: OpenAI-compatible policy server (root or /v1 URL)", show_default=False),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", envvar="OSFARM_MODEL", help="vlm: model name sent to the policy server",
                     show_default=False),
    ] = None,
    prompt_format: Annotated[
        str | None,
        typer.Option("--prompt-format", help="vlm: pyautogui, computer_13 or uitars (default: follows "
                     "--action-space)", show_default=False),
    ] = None,
    agent_opt: Annotated[
        list[str] | None,
        typer.Option("--agent-opt", help="vlm, choice: agent option key=value (repeatable), e.g. history_turns=3 "
                     "observation=screenshot_a11y", show_default=False),
    ] = None,
    executor: Annotated[
        str,
        typer.Option("--executor", help="inprocess (episodes in this process) or celery (queued to `osfarm "
                     "worker`s)"),
    ] = "inprocess",
    broker: Annotated[
        str | None,
        typer.Option("--broker", envvar="OSFARM_BROKER", help="celery: Redis URL of the broker", show_default=False),
    ] = None,
    max_concurrent: Annotated[
        int | None,
        typer.Option("--max-concurrent", min=1, help="episodes in flight (default: --envs; celery: every task); the "
                     "next starts when any finishes", show_default=False),
    ] = None,
    sync_batches: Annotated[
        bool,
        typer.Option("--sync-batches", help="run batches of --max-concurrent with a barrier (comparison baseline)"),
    ] = False,
    stream_url: Annotated[
        str | None,
        typer.Option("--stream-url", envvar="OSFARM_REDIS", help="also publish records to this Redis stream "
                     "(in-process executor)", show_default=False),
    ] = None,
    stream: Annotated[
        str, typer.Option("--stream", envvar="OSFARM_STREAM", help="stream key for --stream-url")
    ] = "osfarm:episodes",
) -> None:
    """Run AGENT on every task of SUITE; write OSWorld's per-task layout, results.json and report.html."""
    from osfarm.agents import UnknownAgent
    from osfarm.providers.base import ProviderError
    from osfarm.runner.results import print_table
    from osfarm.runner.run import RunOptions, run_eval
    from osfarm.tasks.model import TaskError

    err = Console(stderr=True)
    from osfarm.schema.guest import ACTION_TIMINGS

    timing: ActionTiming | None = next((t for t in ACTION_TIMINGS if t == action_timing), None)
    if timing is None:
        err.print(f"[bold red]error:[/] --action-timing must be one of {', '.join(ACTION_TIMINGS)}, "
                  f"got {action_timing!r}", highlight=False)
        raise typer.Exit(2)
    overrides = {k: v for k, v in (("width", width), ("height", height), ("provider", provider)) if v is not None}
    opts = RunOptions(suite=suite, agent=agent, out=out, index=index, envs=envs, max_steps=max_steps, resume=resume,
                      url=url, token=token, cache=cache, offline=offline, time_limit_s=time_limit,
                      infra_retries=retries, action_space=action_space, progress=progress, record=record,
                      solutions=solutions, farm_overrides=overrides, executor=executor, broker=broker,
                      max_concurrent=max_concurrent, sync_batches=sync_batches, stream_url=stream_url, stream=stream,
                      allow_hosts=tuple(allow_host) if allow_host else None, action_timing=timing,
                      repeats=repeats)
    if executor not in ("inprocess", "celery"):
        err.print(f"[bold red]error:[/] --executor must be inprocess or celery, got {executor!r}", highlight=False)
        raise typer.Exit(2)
    try:
        from osfarm.agents.vlm import parse_agent_opts

        opts.model_url, opts.model, opts.prompt_format = model_url, model, prompt_format
        opts.agent_opts = parse_agent_opts(agent_opt or [])
        summary = run_eval(opts, console=err)
    except TaskError as e:
        err.print(f"[bold red]error:[/] invalid suite:\n{e}", highlight=False)
        raise typer.Exit(2) from None
    except (UnknownAgent, ValueError, ProviderError, RuntimeError) as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(1) from None
    print_table(summary, Console())
    Console().print(f"results: {out / 'results.json'}  report: {out / 'report.html'}", highlight=False)
