"""``osfarm worker``: a Celery worker that runs episodes on one farm (registered by osfarm/cli.py)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from osfarm.http.source_address import SourceAddressError, set_source_address


def worker_command(
    farm: Annotated[
        str, typer.Option("--farm", envvar="OSFARM_FARM_URL", help="URL of the farm this worker runs episodes on")
    ],
    token: Annotated[str, typer.Option("--token", envvar="OSFARM_TOKEN", help="the farm's token", show_default=False)],
    broker: Annotated[
        str,
        typer.Option("--broker", envvar="OSFARM_BROKER", help="Redis URL: Celery broker, result backend, claims"),
    ] = "redis://127.0.0.1:6379/0",
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", min=1, help="episodes run at once (pool processes)")
    ] = 1,
    stream: Annotated[
        str, typer.Option("--stream", envvar="OSFARM_STREAM", help="Redis stream the records go to ('' for none)")
    ] = "osfarm:episodes",
    out: Annotated[
        Path | None,
        typer.Option("--out", envvar="OSFARM_WORKER_OUT", help="write task files under OUT/<run id> instead of the "
                     "runner's run dir (no shared filesystem)", show_default=False),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="worker name (default osfarm@<host>-<pid>)", show_default=False)
    ] = None,
    loglevel: Annotated[str, typer.Option("--loglevel", help="Celery log level")] = "info",
    bind_address: Annotated[
        str | None,
        typer.Option("--bind-address", envvar="OSFARM_WORKER_BIND_ADDRESS",
                     help="this host's address to connect from: the farm, the policy servers and Redis see the "
                          "worker's connections come from it (one of this machine's addresses)",
                     show_default=False),
    ] = None,
) -> None:
    """Run episodes queued by `osfarm eval --executor celery` on the farm at --farm."""
    err = Console(stderr=True)
    if not token:
        err.print("[bold red]error:[/] --token (or OSFARM_TOKEN) is required: the farm's token")
        raise typer.Exit(2)
    if not broker.startswith(("redis://", "rediss://", "unix://")):
        err.print(f"[bold red]error:[/] --broker must be a Redis URL (redis://host:port/db), got {broker!r}")
        raise typer.Exit(2)
    source: str | None = None
    if bind_address:
        try:  # in the environment: the pool children's farm, policy and Redis clients read it there
            source = set_source_address(bind_address, "--bind-address")
        except SourceAddressError as e:
            err.print(f"[bold red]error:[/] {e}")
            raise typer.Exit(2) from None
    # the pool children read their settings from the environment (they are forked from here)
    os.environ.update(OSFARM_FARM_URL=farm.rstrip("/"), OSFARM_TOKEN=token, OSFARM_BROKER=broker, OSFARM_STREAM=stream)
    if out is not None:
        os.environ["OSFARM_WORKER_OUT"] = str(out.resolve())
    from osfarm.runner.executors.celery_app import QUEUE, make_app

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per farm request drowns the episode log

    app = make_app(broker, source_address=source)
    hostname = name or f"osfarm@{socket.gethostname()}-{os.getpid()}"
    tmp = _private_tmp(hostname)
    try:
        app.worker_main(["worker", f"--concurrency={concurrency}", "--pool=prefork",
                         f"--loglevel={loglevel.upper()}", "-Q", QUEUE, "-n", hostname, "--without-gossip",
                         "--without-mingle", "--without-heartbeat"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _private_tmp(hostname: str) -> Path:
    """A temp dir of this worker's own (TMPDIR for it and its pool processes), emptied when a
    worker of the same name starts again: a SIGKILLed worker (OOM, a lost container) cannot remove
    the temp dirs its processes made (multiprocessing's pymp-*, spooled files), and they would pile
    up under /tmp for ever."""
    base = Path(tempfile.gettempdir())
    tmp = base / ("osfarm-worker-" + re.sub(r"[^A-Za-z0-9_.@-]", "_", hostname))
    try:
        st = tmp.lstat()
    except FileNotFoundError:
        pass
    else:
        # never follow or empty what someone else planted under a shared /tmp
        if tmp.is_symlink() or not tmp.is_dir() or st.st_uid != os.getuid():
            raise typer.BadParameter(f"{tmp} exists and is not this user's directory: remove it")
        shutil.rmtree(tmp)
    tmp.mkdir(mode=0o700)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # recomputed from TMPDIR
    return tmp
