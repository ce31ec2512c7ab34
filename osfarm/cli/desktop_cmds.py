"""``osfarm desktop``: run the desktop session launcher here (``run``), or lease and drive desktops
on a farm through its client (``ls``, ``lease``, ``screenshot``, ``exec``, ``fingerprint``,
``release``). A command that takes a lease id reads one that begins with '-' as the id
(``LeaseIdCommand``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from typer.core import TyperCommand

from osfarm.cli.common import OwnerOpt, TokenOpt, UrlOpt, fail, farm_errors, out
from osfarm.http.errors import error_detail

desktop_app = typer.Typer(
    help="Run the desktop session launcher, or lease and drive desktops on a farm.",
    no_args_is_help=True,
)

LeaseIdArg = Annotated[str, typer.Argument(help="lease id (one that reads as an option of this command goes after --)")]


def _dash_words_as_positionals(args: list[str], params: list[Any]) -> list[str]:
    """``args`` with every word that names none of ``params``' options moved, in order, after
    a ``--``: click reads any word that begins with '-' as an option (an id ``-Ao3...`` failed
    with "No such option: -A"); after ``--`` it is a positional argument like any other."""
    takes_value: dict[str, bool] = {}
    for p in params:
        if getattr(p, "param_type_name", None) == "option":
            takes_value.update(dict.fromkeys(p.opts, not (p.is_flag or p.count)))
            takes_value.update(dict.fromkeys(p.secondary_opts, False))
    options: list[str] = []
    positionals: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            positionals += args[i + 1 :]
            break
        long = word.startswith("--")
        name = word.split("=", 1)[0] if long else word[:2]
        if len(word) > 1 and word.startswith("-") and name in takes_value:
            options.append(word)
            attached = "=" in word if long else len(word) > 2  # --owner=x, -ofile
            if takes_value[name] and not attached and i + 1 < len(args):
                i += 1
                options.append(args[i])
        else:
            positionals.append(word)
        i += 1
    return [*options, "--", *positionals] if positionals else options


class LeaseIdCommand(TyperCommand):
    """A command that takes a lease id: the id may begin with '-', in place or after ``--``.

    A word that is one of the command's own options (``-ofile`` on ``screenshot``) stays that
    option, so an id that reads as one goes after ``--`` as on any command line.
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _dash_words_as_positionals(args, self.get_params(ctx)))


def _client(url: str, token: str) -> Any:
    from osfarm.client import Farm

    with farm_errors():
        return Farm(url, token)


@desktop_app.command(
    "run",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def desktop_run(ctx: typer.Context) -> None:
    """Run the desktop session launcher here (Xvfb, WM, D-Bus, AT-SPI, guest server).

    Every argument goes to the launcher; see `osfarm desktop run --help`.
    """
    from osfarm.desktop.launch.launcher import main

    raise typer.Exit(main(list(ctx.args)))


@desktop_app.command("ls")
def desktop_ls(url: UrlOpt = "http://127.0.0.1:8765", token: TokenOpt = "") -> None:
    """Show the farm's pool: desktops and their states."""
    farm = _client(url, token)
    with farm, farm_errors():
        status = farm.pool().model_dump()
    summary = Table(title=f"pool at {url}", show_header=False)
    rows: list[dict[str, Any]] = []
    for key, value in status.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            rows = value
        else:
            summary.add_row(key, json.dumps(value) if isinstance(value, (dict, list)) else str(value))
    out.print(summary)
    if rows:
        cols = list(dict.fromkeys(k for r in rows for k in r))
        table = Table(*cols, title="desktops")
        for r in rows:
            table.add_row(*(_cell(r.get(c)) for c in cols))
        out.print(table)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v)
    return str(v)


@desktop_app.command("lease")
def desktop_lease(
    ttl: Annotated[
        float | None, typer.Option("--ttl", help="lease TTL in seconds (default: the farm's)", show_default=False)
    ] = None,
    wait: Annotated[float, typer.Option("--wait", help="seconds to wait for a free desktop")] = 30.0,
    owner: OwnerOpt = None,
    url: UrlOpt = "http://127.0.0.1:8765",
    token: TokenOpt = "",
) -> None:
    """Lease a desktop and print the lease as JSON (release it with `osfarm desktop release ID`)."""
    farm = _client(url, token)
    with farm, farm_errors():
        desk = farm.lease(owner=owner, ttl_s=ttl, wait_s=wait)
    typer.echo(desk.info.model_dump_json(indent=2))


@desktop_app.command("screenshot", cls=LeaseIdCommand)
def desktop_screenshot(
    lease_id: LeaseIdArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="image file to write")],
    format: Annotated[str, typer.Option("--format", help="png, jpeg or webp")] = "png",
    scale: Annotated[float, typer.Option("--scale", help="resize factor (0, 1]")] = 1.0,
    quality: Annotated[int, typer.Option("--quality", help="JPEG/WebP quality")] = 80,
    owner: OwnerOpt = None,
    url: UrlOpt = "http://127.0.0.1:8765",
    token: TokenOpt = "",
) -> None:
    """Save a screenshot of a leased desktop."""
    farm = _client(url, token)
    with farm, farm_errors():
        data = farm.desktop(lease_id, owner=owner).screenshot(format, scale, quality)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(data)
    out.print(f"wrote {output} ({len(data)} bytes)", highlight=False)


@desktop_app.command("exec", cls=LeaseIdCommand)
def desktop_exec(
    lease_id: LeaseIdArg,
    command: Annotated[list[str], typer.Argument(help="command and arguments (after --)")],
    shell: Annotated[bool, typer.Option("--shell", help="run the words as one shell command line")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="HTTP timeout in seconds")] = 180.0,
    owner: OwnerOpt = None,
    url: UrlOpt = "http://127.0.0.1:8765",
    token: TokenOpt = "",
) -> None:
    """Run a command in a leased desktop (guest /execute) and exit with its return code.

    Example: osfarm desktop exec ID -- ls -la /home/user
    """
    farm = _client(url, token)
    body = {"command": " ".join(command) if shell else command, "shell": shell}
    with farm, farm_errors():
        r = farm.desktop(lease_id, owner=owner).guest("POST", "/execute", json=body, timeout=timeout, check=False)
    try:
        reply = r.json()
    except ValueError:
        reply = {}
    if r.status_code >= 400 or not isinstance(reply, dict) or reply.get("status") != "success":
        raise fail(f"{r.status_code}: {error_detail(r.content)}")
    if reply.get("output"):
        sys.stdout.write(reply["output"])
    if reply.get("error"):
        sys.stderr.write(reply["error"])
    raise typer.Exit(int(reply.get("returncode") or 0))


@desktop_app.command("fingerprint", cls=LeaseIdCommand)
def desktop_fingerprint(
    lease_id: LeaseIdArg,
    timeout: Annotated[float, typer.Option("--timeout", help="HTTP timeout in seconds")] = 60.0,
    owner: OwnerOpt = None,
    url: UrlOpt = "http://127.0.0.1:8765",
    token: TokenOpt = "",
) -> None:
    """Print a leased desktop's fingerprint as JSON: processes by command line, hashes of the
    writable trees (home, /tmp, /var/tmp, /dev/shm), the agent's /etc and mounts, X state (root
    window properties, selections, pressed keys, pointer, keyboard mapping, windows) and its
    ``digest``. A warm reset must give the cold start's digest (osfarm/desktop/warm/fingerprint.py, warm.py).

    Example: osfarm desktop fingerprint ID | jq .digest
    """
    farm = _client(url, token)
    with farm, farm_errors():
        r = farm.desktop(lease_id, owner=owner).guest("GET", "/v1/session/fingerprint", timeout=timeout, check=False)
    if r.status_code >= 400:
        raise fail(f"{r.status_code}: {error_detail(r.content)}")
    sys.stdout.write(json.dumps(r.json(), indent=1, sort_keys=True) + "\n")


@desktop_app.command("release", cls=LeaseIdCommand)
def desktop_release(
    lease_id: LeaseIdArg,
    owner: OwnerOpt = None,
    url: UrlOpt = "http://127.0.0.1:8765",
    token: TokenOpt = "",
) -> None:
    """Release a lease (its desktop is reset and returned to the pool)."""
    farm = _client(url, token)
    with farm, farm_errors():
        farm.release(lease_id, owner=owner)
    out.print(f"released {lease_id}", highlight=False)
