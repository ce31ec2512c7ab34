"""Command-line options shared by the commands that drive a farm (eval, audit, demo)."""

from __future__ import annotations

from typing import Annotated

import typer

FarmUrlOpt = Annotated[
    str | None, typer.Option("--url", help="use this farm instead of starting one in-process", show_default=False)
]
FarmTokenOpt = Annotated[
    str | None, typer.Option("--token", envvar="OSFARM_TOKEN", help="token of --url", show_default=False)
]
