"""The ``osfarm`` command.

* ``osfarm serve``   run the farm API (uvicorn) with a warm pool of desktops
* ``osfarm desktop`` run the session launcher (``run``) or manage leases on a farm
* ``osfarm demo``    the scripted main job: lease a desktop, open a terminal, type, screenshot

Settings come from ``--config FILE`` (YAML) and ``OSFARM_*`` variables, flags win. A bad
setting prints ``FILE:LINE: message`` and exits 2; a farm error prints its status and message
and exits 1; neither prints a traceback.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from typer.core import TyperCommand

from osfarm.config import ConfigError, FarmSettings, load_settings
from osfarm.http.errors import error_detail
from osfarm.http.hosts import is_loopback_host
from osfarm.runner.audit_cli import audit_command
from osfarm.runner.cli import eval_command
from osfarm.runner.options import FarmTokenOpt, FarmUrlOpt
from osfarm.tasks.cli import tasks_app

app = typer.Typer(
    name="osfarm",
    help="Real Linux desktops as async HTTP environments for GUI agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="rich",
)
desktop_app = typer.Typer(
    help="Run the desktop session launcher, or lease and drive desktops on a farm.",
    no_args_is_help=True,
)
app.add_typer(desktop_app, name="desktop")
tasks_app.command("audit")(audit_command)  # runs episodes: the runner's layer, above tasks/
app.add_typer(tasks_app, name="tasks")
app.command("eval")(eval_command)
from osfarm.runner.executors.worker import worker_command  # noqa: E402
from osfarm.stream.cli import stream_app  # noqa: E402

app.command("worker")(worker_command)
app.add_typer(stream_app, name="stream")
from osfarm.images.cli import image_app  # noqa: E402

app.add_typer(image_app, name="image")
from osfarm.farm.cli import tokens_app  # noqa: E402

app.add_typer(tokens_app, name="tokens")
from osfarm.policy.cli import policy_app  # noqa: E402

app.add_typer(policy_app, name="policy")
from osfarm.trainer.cli import train_command  # noqa: E402

app.command("train")(train_command)
from osfarm.dashboard.cli import report_app, ui_command  # noqa: E402

app.command("ui")(ui_command)
app.add_typer(report_app, name="report")

out = Console()
err = Console(stderr=True)

# ---- shared options ---------------------------------------------------------------------------

UrlOpt = Annotated[str, typer.Option("--url", envvar="OSFARM_URL", help="farm URL")]
TokenOpt = Annotated[str, typer.Option("--token", envvar="OSFARM_TOKEN", help="farm token", show_default=False)]
OwnerOpt = Annotated[
    str | None, typer.Option("--owner", envvar="OSFARM_OWNER", help="lease owner (sent as X-Osfarm-Owner)")
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML settings file (keys as in FarmSettings)", show_default=False)
]


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


def _fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _settings(config: Path | None, **overrides: Any) -> FarmSettings:
    try:
        return load_settings(config, **overrides)
    except ConfigError as e:
        raise _fail(str(e), 2) from None


@contextmanager
def _farm_errors() -> Iterator[None]:
    """Turn client errors into one red line and exit 1 (no traceback)."""
    from osfarm.client import FarmAPIError

    try:
        yield
    except FarmAPIError as e:
        raise _fail(f"{e.status or 'unreachable'}: {e.detail}" if e.status else e.detail) from None
    except ValueError as e:  # e.g. no token configured
        raise _fail(str(e)) from None


def _client(url: str, token: str) -> Any:
    from osfarm.client import Farm

    with _farm_errors():
        return Farm(url, token)


# ---- logging ----------------------------------------------------------------------------------


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=info logger=osfarm.farm.pool msg="..."``: one greppable line per event."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).isoformat(timespec="milliseconds")
        fields = {"ts": ts, "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        line = " ".join(f"{k}={_logfmt_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += " exc=" + _logfmt_value(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def _logfmt_value(v: str) -> str:
    if v and not any(c in v for c in ' ="\n\t'):
        return v
    return json.dumps(v)


def setup_logging(level: str = "info", fmt: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    # httpx logs every request at info: the pool's guest health checks would flood the log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))


# ---- serve ------------------------------------------------------------------------------------


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise _fail(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port") from None
    return sock


@app.command()
def serve(
    provider: Annotated[
        str | None, typer.Option(help="desktop provider: sandbox, docker, libvirt", show_default=False)
    ] = None,
    pool_size: Annotated[
        int | None, typer.Option("--pool-size", help="desktops kept warm (pool_min)", show_default=False)
    ] = None,
    pool_max: Annotated[
        int | None, typer.Option("--pool-max", help="most desktops alive at once", show_default=False)
    ] = None,
    host: Annotated[str | None, typer.Option(help="address to bind (default 127.0.0.1)", show_default=False)] = None,
    port: Annotated[
        int | None, typer.Option(help="port to bind (default 8765; 0 = any free)", show_default=False)
    ] = None,
    token: Annotated[str | None, typer.Option(help="API token (default: generated)", show_default=False)] = None,
    width: Annotated[int | None, typer.Option(help="screen width of each desktop", show_default=False)] = None,
    height: Annotated[int | None, typer.Option(help="screen height of each desktop", show_default=False)] = None,
    state_dir: Annotated[Path | None, typer.Option(help="where desktops keep their files", show_default=False)] = None,
    runs: Annotated[Path | None, typer.Option("--runs", help="folder of run dirs the dashboard (/ui) shows",
                                                 show_default=False)] = None,
    config: ConfigOpt = None,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="allow binding a non-loopback address")] = False,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error")] = "info",
    log_format: Annotated[str, typer.Option(help="logfmt or json")] = "logfmt",
) -> None:
    """Run the farm API with a warm pool of desktops (Ctrl-C stops it and every desktop)."""
    settings = _settings(
        config, provider=provider, pool_min=pool_size, pool_max=pool_max, host=host, port=port, token=token,
        width=width, height=height, state_dir=state_dir, ui_runs_dir=runs,
    )  # fmt: skip
    if not is_loopback_host(settings.host) and not allow_remote:
        raise _fail(
            f"refusing to listen on {settings.host}: the farm API drives desktops and runs commands in them; "
            "bind a loopback address, or pass --allow-remote if the network is trusted",
            2,
        )
    if settings.ui_runs_dir is not None and not settings.ui_runs_dir.is_dir():
        raise _fail(f"ui_runs_dir {settings.ui_runs_dir}: no such directory (the folder of run dirs /ui shows)", 2)
    setup_logging(log_level, log_format)
    settings.ensure_token()
    if (settings.tls_certfile is None) != (settings.tls_keyfile is None):
        raise _fail("tls_certfile and tls_keyfile (OSFARM_TLS_CERTFILE, OSFARM_TLS_KEYFILE) go together", 2)
    for tls_file in (settings.tls_certfile, settings.tls_keyfile):
        if tls_file is not None and not tls_file.is_file():
            raise _fail(f"{tls_file}: no such file (TLS certificate or key)", 2)
    if not is_loopback_host(settings.host) and settings.tls_certfile is None:
        err.print(Panel.fit(
            f"[bold]The farm API listens on {settings.host} WITHOUT TLS.[/]\n"
            "Every token, action, screenshot and task crosses the network in clear text: anyone on the path\n"
            "can read a token and drive the desktops. Serve HTTPS (OSFARM_TLS_CERTFILE + OSFARM_TLS_KEYFILE),\n"
            "or put a TLS proxy in front and bind the farm to loopback.",
            title="[bold red]WARNING: no TLS[/]", border_style="bold red"), highlight=False)
        logging.getLogger("osfarm.serve").warning("listening on %s without TLS", settings.host)

    from osfarm.dashboard.app import farm_ui
    from osfarm.farm.api import create_app, farm_tokens

    try:  # a bad token file or OSFARM_TOKENS entry stops here, naming it
        clients = [p for p in farm_tokens(settings).principals() if p.name != "admin" or p.role != "admin"]
    except ConfigError as e:
        raise _fail(str(e), 2) from None
    from osfarm.providers import make_provider
    from osfarm.providers.base import ProviderError

    try:  # checks the box tools, Xvfb and the state dir now, with a fix in the message
        prov = make_provider(settings)
    except ProviderError as e:
        raise _fail(str(e)) from None
    sock = _bind(settings.host, settings.port)
    bound_port = sock.getsockname()[1]
    shown_host = f"[{settings.host}]" if ":" in settings.host else settings.host
    url = f"{'https' if settings.tls_certfile else 'http'}://{shown_host}:{bound_port}"
    out.print(
        Panel.fit(
            f"[bold]farm[/]   {url}\n[bold]token[/]  {settings.token}\n[bold]docs[/]   {url}/docs\n"
            f"[bold]ui[/]     {url}/ui/\n\n"
            f"export OSFARM_URL={url} OSFARM_TOKEN={settings.token}"
            + (f"\n\n{len(clients)} client token(s): {', '.join(f'{p.name} ({p.role})' for p in clients)}"
               if clients else ""),
            title="osfarm serve",
        ),
        highlight=False,
    )
    import uvicorn

    fapp = create_app(settings, prov, ui=farm_ui(settings.ui_runs_dir))
    server = uvicorn.Server(
        uvicorn.Config(fapp, log_config=None, log_level=log_level.lower(), lifespan="on", access_log=True,
                       timeout_graceful_shutdown=10,
                       ssl_certfile=str(settings.tls_certfile) if settings.tls_certfile else None,
                       ssl_keyfile=str(settings.tls_keyfile) if settings.tls_keyfile else None)
    )  # fmt: skip
    # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown; with these handlers in place
    # that re-raise is a no-op, so a requested stop exits 0 instead of 130/-15.
    stop_signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop_signals.append(signum))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:
        why = fapp.state.farm.start_error
        raise _fail(f"the farm did not start: {why}" if why else "the farm did not start")


# ---- desktop ----------------------------------------------------------------------------------


@desktop_app.command(
    "run",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def desktop_run(ctx: typer.Context) -> None:
    """Run the desktop session launcher here (Xvfb, WM, D-Bus, AT-SPI, guest server).

    Every argument goes to the launcher; see `osfarm desktop run --help`.
    """
    from osfarm.desktop.launcher import main

    raise typer.Exit(main(list(ctx.args)))


@desktop_app.command("ls")
def desktop_ls(url: UrlOpt = "http://127.0.0.1:8765", token: TokenOpt = "") -> None:
    """Show the farm's pool: desktops and their states."""
    farm = _client(url, token)
    with farm, _farm_errors():
        status = farm.pool()
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
    with farm, _farm_errors():
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
    with farm, _farm_errors():
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
    with farm, _farm_errors():
        r = farm.desktop(lease_id, owner=owner).guest("POST", "/execute", json=body, timeout=timeout, check=False)
    try:
        reply = r.json()
    except ValueError:
        reply = {}
    if r.status_code >= 400 or not isinstance(reply, dict) or reply.get("status") != "success":
        raise _fail(f"{r.status_code}: {error_detail(r.content)}")
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
    ``digest``. A warm reset must give the cold start's digest (osfarm/desktop/fingerprint.py, warm.py).

    Example: osfarm desktop fingerprint ID | jq .digest
    """
    farm = _client(url, token)
    with farm, _farm_errors():
        r = farm.desktop(lease_id, owner=owner).guest("GET", "/v1/session/fingerprint", timeout=timeout, check=False)
    if r.status_code >= 400:
        raise _fail(f"{r.status_code}: {error_detail(r.content)}")
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
    with farm, _farm_errors():
        farm.release(lease_id, owner=owner)
    out.print(f"released {lease_id}", highlight=False)


# ---- demo -------------------------------------------------------------------------------------


class _Phases:
    """Named, timed phases shown as a rich progress list."""

    def __init__(self, progress: Any):
        self.progress = progress
        self.timings: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        task = self.progress.add_task(name, total=1)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.timings[name] = dt
            self.progress.update(task, completed=1, description=f"{name} [dim]{dt * 1000:.0f} ms[/]")


def _wait_focused(desk: Any, wm_class: str, timeout: float = 30.0) -> bool:
    """Wait until a window of ``wm_class`` has the keyboard focus: a window is listed before the
    window manager has mapped and focused it (GNOME's mutter takes a frame or more), and keys
    typed before then go elsewhere."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obs = desk.observe(screenshot=False, windows=True, cursor=False)
        if any(w.focused and wm_class in w.wm_class.lower() for w in obs.windows or []):
            return True
        time.sleep(0.1)
    return False


def _wait_settled(desk: Any, timeout: float = 5.0) -> bytes:
    """Screenshots until two in a row are identical: the screen finished redrawing."""
    prev = desk.screenshot("png")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cur = desk.screenshot("png")
        if cur == prev:
            return cur
        prev = cur
    return prev


@app.command()
def demo(
    out_dir: Annotated[Path, typer.Option("--out", help="run directory root")] = Path("runs"),
    url: FarmUrlOpt = None,
    token: FarmTokenOpt = None,
    text: Annotated[str, typer.Option("--text", help="command typed into the terminal")] = "echo hello from osfarm",
    width: Annotated[int | None, typer.Option(help="screen width (in-process farm)", show_default=False)] = None,
    height: Annotated[int | None, typer.Option(help="screen height (in-process farm)", show_default=False)] = None,
    config: ConfigOpt = None,
) -> None:
    """The main job: lease a desktop, open a terminal, type a command, save a screenshot."""
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from osfarm.client import Farm, FarmAPIError

    settings = None
    if url is None:
        settings = _settings(config, pool_min=1, pool_max=1, port=0, width=width, height=height)
    run_dir = out_dir / datetime.now().strftime("%Y%m%d-%H%M%S")
    server = None
    t_all = time.perf_counter()
    with Progress(SpinnerColumn(finished_text="[green]✓[/]"), TextColumn("{task.description}"),
                  console=err) as progress:
        phase = _Phases(progress)
        try:
            if settings is not None:
                with phase("start farm (1 warm desktop)"):
                    from osfarm.farm.local import start_local_farm
                    from osfarm.providers.base import ProviderError

                    try:  # a missing box tool or Xvfb is one clear line, not a traceback
                        server = start_local_farm(settings)
                    except (ProviderError, RuntimeError) as e:
                        raise _fail(str(e)) from None
                    url, token = server.url, server.token
            assert url is not None
            with _farm_errors(), Farm(url, token) as farm:
                with phase("lease a desktop"):
                    desk = farm.lease(owner="osfarm-demo", ttl_s=300)
                try:
                    with phase("launch xfce4-terminal"):
                        desk.guest("POST", "/setup/launch", json={"command": ["xfce4-terminal"], "shell": False})
                    with phase("wait for its window"):
                        r = desk.guest("POST", "/v1/wait_for_window",
                                       json={"wm_class": "xfce4-terminal", "timeout": 30})
                        if not r.json().get("ok"):
                            raise FarmAPIError(504, f"the terminal window did not appear: {r.json().get('detail')}")
                        if not _wait_focused(desk, "xfce4-terminal"):
                            raise FarmAPIError(504, "the terminal window did not take the keyboard focus in 30 s")
                        # painted and idle (osfarm.desktop.settle): GNOME's compositor shows a new
                        # window a few frames after it is focused
                        desk.guest("POST", "/execute", json={"command": [
                            "osfarm-settle", "--window", "Terminal", "--timeout", "30", "--quiet", "0.3"]}, timeout=40)
                    with phase(f"type {text!r} + Enter"):
                        res = desk.step([
                            {"action_type": "TYPING", "parameters": {"text": text}},
                            {"action_type": "PRESS", "parameters": {"key": "enter"}},
                        ])  # fmt: skip
                        bad = [a for a in res.results if not a.ok]
                        if bad:
                            raise FarmAPIError(500, f"action {bad[0].index} failed: {bad[0].error}")
                    with phase("screenshot"):
                        png = _wait_settled(desk)
                        run_dir.mkdir(parents=True, exist_ok=True)
                        (run_dir / "screenshot.png").write_bytes(png)
                finally:
                    with phase("release"):
                        desk.close()
        finally:
            if server is not None:
                with phase("stop farm"):
                    server.stop()
    total = time.perf_counter() - t_all
    timings = {**phase.timings, "total": total}
    (run_dir / "timings.json").write_text(json.dumps({k: round(v, 4) for k, v in timings.items()}, indent=2))
    table = Table("phase", "ms", title="osfarm demo")
    for name, dt in timings.items():
        table.add_row(name, f"{dt * 1000:.0f}")
    out.print(table)
    out.print(f"screenshot: {run_dir / 'screenshot.png'}", highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
