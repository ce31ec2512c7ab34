"""``osfarm tokens``: the farm's per-client tokens (``tokens_file``, see osfarm/http/principals.py).

A token is shown once, when it is made; the file keeps only its SHA-256.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.table import Table

from osfarm.config import ConfigError
from osfarm.http.principals import ROLES, new_token, token_digest
from osfarm.http.token_sources import TokenEntry, read_token_file

tokens_app = typer.Typer(help="Per-client tokens of the farm API (a tokens file stores their SHA-256 only).",
                         no_args_is_help=True)
out = Console()
err = Console(stderr=True)

FileOpt = Annotated[
    Path, typer.Option("--file", envvar="OSFARM_TOKENS_FILE", help="the tokens file (the farm's tokens_file)")
]

HEADER = """\
# osfarm tokens file: the farm's tokens_file setting (OSFARM_TOKENS_FILE). One entry per client;
# sha256 is the hex SHA-256 of its token (the token itself is shown once by `osfarm tokens add`).
# role: admin (every lease, the whole pool) | client (its own leases) | viewer (read-only status).
"""


def _fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _read(path: Path) -> list[TokenEntry]:
    if not path.exists():
        return []
    try:
        return read_token_file(path)
    except ConfigError as e:
        raise _fail(str(e), 2) from None


def _write(path: Path, entries: list[TokenEntry]) -> None:
    data = {"clients": [e.model_dump(exclude_none=True) for e in entries]}
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(HEADER + yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)


@tokens_app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="the client's name (shown in logs and lease details)")],
    file: FileOpt,
    role: Annotated[str, typer.Option("--role", help="admin, client or viewer")] = "client",
    max_leases: Annotated[
        int | None, typer.Option("--max-leases", help="most leases held at once", show_default=False)
    ] = None,
    max_ttl: Annotated[
        float | None, typer.Option("--max-ttl", help="longest lease TTL in s", show_default=False)
    ] = None,
) -> None:
    """Make a token for NAME, add its SHA-256 to the file and print the token (only this once).
    The farm reads the file when it starts."""
    if role not in ROLES:
        raise _fail(f"--role {role}: expected one of {', '.join(ROLES)}", 2)
    entries = _read(file)
    if any(e.name == name for e in entries):
        raise _fail(f"{file}: a client named {name!r} exists; remove it first (`osfarm tokens remove`)", 2)
    token = new_token()
    try:
        entry = TokenEntry(name=name, role=role, sha256=token_digest(token), max_leases=max_leases,
                           max_ttl_s=max_ttl)
    except ValueError as e:
        raise _fail(f"{name}: {e}", 2) from None
    _write(file, [*entries, entry])
    err.print(f"added {name} ({role}) to {file}; its token (shown only now, give it to the client as OSFARM_TOKEN):",
              highlight=False)
    print(token)


@tokens_app.command("remove")
def remove(name: Annotated[str, typer.Argument()], file: FileOpt) -> None:
    """Remove NAME's token from the file (the farm forgets it at its next start)."""
    entries = _read(file)
    kept = [e for e in entries if e.name != name]
    if len(kept) == len(entries):
        raise _fail(f"{file}: no client named {name!r}", 1)
    _write(file, kept)
    err.print(f"removed {name} from {file}; restart the farm to revoke it", highlight=False)


@tokens_app.command("list")
def list_tokens(file: FileOpt) -> None:
    """The clients of the file: name, role, limits (and the first digits of each digest)."""
    table = Table()
    for col in ("name", "role", "max_leases", "max_ttl_s", "sha256"):
        table.add_column(col)
    for e in _read(file):
        table.add_row(e.name, e.role, str(e.max_leases or "-"), f"{e.max_ttl_s:g}" if e.max_ttl_s else "-",
                      e.sha256[:12] + "...")
    out.print(table)


@tokens_app.command("hash")
def hash_token() -> None:
    """Read a token on stdin and print ``sha256:<hex>``, the form OSFARM_TOKENS entries may carry
    instead of the token (``name:role:sha256:<hex>``)."""
    token = sys.stdin.readline().strip()
    if not token:
        raise _fail("no token on stdin", 2)
    print(f"sha256:{token_digest(token)}")


__all__ = ["tokens_app"]
