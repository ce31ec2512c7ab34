"""``osfarm train --config train.yaml``: asynchronous RL on the farm (see osfarm/trainer/loop.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

err = Console(stderr=True)


def train_command(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="train.yaml (default: the embedded tiny setup)",
                                                   show_default=False)] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="where checkpoints, episodes and metrics go",
                                                    show_default=False)] = None,
    updates: Annotated[
        int | None, typer.Option("--updates", help="stop at this policy version", show_default=False)
    ] = None,
    eta: Annotated[int | None, typer.Option("--eta", help="max staleness in versions (0 = synchronous)",
                                               show_default=False)] = None,
    envs: Annotated[int | None, typer.Option("--envs", help="episodes at once", show_default=False)] = None,
    executor: Annotated[str | None, typer.Option("--executor", help="where rollouts run: inprocess (the trainer's "
                                                   "farm) or celery (`osfarm worker`s on any host)",
                                                   show_default=False)] = None,
    broker: Annotated[str | None, typer.Option("--broker", envvar="OSFARM_BROKER", help="--executor celery: Redis URL "
                                                 "of the queue and the record stream", show_default=False)] = None,
    no_resume: Annotated[bool, typer.Option("--no-resume", help="ignore the run dir's checkpoints")] = False,
    nproc: Annotated[int | None, typer.Option("--nproc", min=1, help="learner ranks on this machine (torchrun: "
                                               "torch.distributed, FSDP2 on GPUs, data parallel on CPUs)",
                                               show_default=False)] = None,
) -> None:
    """Train a policy with decoupled PPO while the farm keeps running rollouts.

    With no config: the tiny model, an in-process sandbox farm, one CPU policy server and the
    tiny choice suite. Re-running with the same --run-dir resumes from its latest checkpoint.
    """
    from pydantic import ValidationError

    from osfarm.config import validation_message
    from osfarm.trainer.config import RolloutSection, TrainConfigError, load_train_config
    from osfarm.trainer.loop import TrainError, train

    try:
        cfg = load_train_config(config, run_dir=run_dir, updates=updates, nproc=nproc)
        given = {"eta": eta, "envs": envs, "executor": executor, "broker": broker}
        rollout = RolloutSection.model_validate({**cfg.rollout.model_dump(), **{k: v for k, v in given.items()
                                                                                if v is not None}})
        cfg = cfg.model_copy(update={"rollout": rollout, "resume": cfg.resume and not no_resume})
    except ValidationError as e:
        err.print(f"[bold red]error:[/] {validation_message(e, None, '', 'train options')}", highlight=False,
                  soft_wrap=True)
        raise typer.Exit(2) from None
    except TrainConfigError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if cfg.nproc > 1 and "WORLD_SIZE" not in os.environ:
        # torchrun semantics: the same command once per rank (each sees RANK, WORLD_SIZE, ...)
        if cfg.run_dir is None:
            err.print("[bold red]error:[/] --nproc needs --run-dir (every rank loads the same checkpoints)",
                      highlight=False)
            raise typer.Exit(2)
        from osfarm.trainer.distributed import torchrun_argv

        argv = torchrun_argv(cfg.nproc, _without_nproc(sys.argv[1:]))  # the ranks read WORLD_SIZE instead
        os.execv(argv[0], argv)
    try:
        summary = train(cfg, err)
    except (TrainError, FileNotFoundError, ValueError) as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if "rank" in summary:  # another learner rank: rank 0 reports
        return
    err.print(f"[bold green]done[/]: version {summary['version']} in {summary['run_dir']}", highlight=False)


def _without_nproc(args: list[str]) -> list[str]:
    """``args`` less ``--nproc N`` / ``--nproc=N`` (torchrun's own parser would take it for its
    ``--nproc-per-node``)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out
