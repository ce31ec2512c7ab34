"""What the commands of ``osfarm.cli`` share: the two consoles, the farm and settings options, and
errors turned into one red line and an exit code (no traceback)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from osfarm.config import ConfigError, FarmSettings, load_settings

out = Console()
err = Console(stderr=True)

UrlOpt = Annotated[str, typer.Option("--url", envvar="OSFARM_URL", help="farm URL")]
TokenOpt = Annotated[str, typer.Option("--token", envvar="OSFARM_TOKEN", help="farm token", show_default=False)]
OwnerOpt = Annotated[
    str | None, typer.Option("--owner", envvar="OSFARM_OWNER", help="lease owner (sent as X-Osfarm-Owner)")
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML settings file (keys as in FarmSettings)", show_default=False)
]


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``message`` as one red line on stderr; the caller raises the exit (``raise fail(...)``)."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def settings_or_exit(config: Path | None, **overrides: Any) -> FarmSettings:
    """The settings from ``config``, the environment and ``overrides``; a bad one exits 2 naming it."""
    try:
        return load_settings(config, **overrides)
    except ConfigError as e:
        raise fail(str(e), 2) from None


@contextmanager
def farm_errors() -> Iterator[None]:
    """Turn client errors into one red line and exit 1 (no traceback)."""
    from osfarm.client import FarmAPIError

    try:
        yield
    except FarmAPIError as e:
        raise fail(f"{e.status or 'unreachable'}: {e.detail}" if e.status else e.detail) from None
    except ValueError as e:  # e.g. no token configured
        raise fail(str(e)) from None
