"""The ``osfarm`` command.

* ``osfarm serve``   run the farm API (uvicorn) with a warm pool of desktops
* ``osfarm desktop`` run the session launcher (``run``) or manage leases on a farm
* ``osfarm demo``    the scripted main job: lease a desktop, open a terminal, type, screenshot

Settings come from ``--config FILE`` (YAML) and ``OSFARM_*`` variables, flags win. A bad
setting prints ``FILE:LINE: message`` and exits 2; a farm error prints its status and message
and exits 1; neither prints a traceback.

This module is the app: it registers the commands above (``serve.py``, ``desktop_cmds.py``,
``demo.py``) and each part's own (``osfarm.<part>.cli``). What those three share (consoles,
options, errors as one red line) is ``common.py``; the farm's log format is ``logging_setup.py``.
A command loads its implementation when it runs, so that ``osfarm --help`` starts fast.
"""

from __future__ import annotations

import typer

from osfarm.cli.demo import demo
from osfarm.cli.desktop_cmds import desktop_app
from osfarm.cli.serve import serve
from osfarm.dashboard.cli import report_app, ui_command
from osfarm.farm.cli import tokens_app
from osfarm.images.cli import image_app
from osfarm.policy.cli import policy_app
from osfarm.runner.audit_cli import audit_command
from osfarm.runner.cli import eval_command
from osfarm.runner.executors.worker import worker_command
from osfarm.stream.cli import stream_app
from osfarm.tasks.cli import tasks_app
from osfarm.trainer.cli import train_command

app = typer.Typer(
    name="osfarm",
    help="Real Linux desktops as async HTTP environments for GUI agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="rich",
)
# `osfarm --help` lists the commands, then the groups, each in the order registered here.
app.add_typer(desktop_app, name="desktop")
tasks_app.command("audit")(audit_command)  # runs episodes: the runner's layer, above tasks/
app.add_typer(tasks_app, name="tasks")
app.command("eval")(eval_command)
app.command("worker")(worker_command)
app.add_typer(stream_app, name="stream")
app.add_typer(image_app, name="image")
app.add_typer(tokens_app, name="tokens")
app.add_typer(policy_app, name="policy")
app.command("train")(train_command)
app.command("ui")(ui_command)
app.add_typer(report_app, name="report")
app.command("serve")(serve)
app.command("demo")(demo)


def main() -> None:
    app()


__all__ = ["app", "main"]
