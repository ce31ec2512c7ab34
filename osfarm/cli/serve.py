"""``osfarm serve``: check the settings, bind the port, print where the farm is and its token, and
run the farm API (uvicorn) with a warm pool of desktops until Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
import signal
import socket
from pathlib import Path
from typing import Annotated

import typer
from rich.panel import Panel

from osfarm.cli.common import ConfigOpt, err, fail, out, settings_or_exit
from osfarm.cli.logging_setup import setup_logging
from osfarm.config import ConfigError
from osfarm.http.hosts import is_loopback_host
from osfarm.http.listen import listening_socket


def _bind(host: str, port: int) -> socket.socket:
    try:
        return listening_socket(host, port)
    except OSError as e:
        raise fail(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port") from None


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
    settings = settings_or_exit(
        config, provider=provider, pool_min=pool_size, pool_max=pool_max, host=host, port=port, token=token,
        width=width, height=height, state_dir=state_dir, ui_runs_dir=runs,
    )  # fmt: skip
    if not is_loopback_host(settings.host) and not allow_remote:
        raise fail(
            f"refusing to listen on {settings.host}: the farm API drives desktops and runs commands in them; "
            "bind a loopback address, or pass --allow-remote if the network is trusted",
            2,
        )
    if settings.ui_runs_dir is not None and not settings.ui_runs_dir.is_dir():
        raise fail(f"ui_runs_dir {settings.ui_runs_dir}: no such directory (the folder of run dirs /ui shows)", 2)
    setup_logging(log_level, log_format)
    settings.ensure_token()
    if (settings.tls_certfile is None) != (settings.tls_keyfile is None):
        raise fail("tls_certfile and tls_keyfile (OSFARM_TLS_CERTFILE, OSFARM_TLS_KEYFILE) go together", 2)
    for tls_file in (settings.tls_certfile, settings.tls_keyfile):
        if tls_file is not None and not tls_file.is_file():
            raise fail(f"{tls_file}: no such file (TLS certificate or key)", 2)
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
        raise fail(str(e), 2) from None
    from osfarm.providers import make_provider
    from osfarm.providers.base import ProviderError

    try:  # checks the box tools, Xvfb and the state dir now, with a fix in the message
        prov = make_provider(settings)
    except ProviderError as e:
        raise fail(str(e)) from None
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
                       timeout_graceful_shutdown=10, loop=settings.server_loop,
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
        raise fail(f"the farm did not start: {why}" if why else "the farm did not start")
