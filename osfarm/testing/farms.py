"""The one way to start a farm in a test or a bench: :func:`running_farm`.

In this process by default (uvicorn on 127.0.0.1 in a thread: :class:`~osfarm.farm.server.FarmServer`),
over the provider the settings name (sandbox, docker, libvirt) or a provider object handed in (a
:class:`~osfarm.testing.memory_provider.MemoryProvider`: the whole farm, no desktop). With
``process=True`` it is an ``osfarm serve`` process instead (:class:`~osfarm.testing.farm_process.FarmProcess`),
for a test that kills and restarts the farm or measures the farm's own process. Either way it
runs on a loopback port, and on exit its desktops are stopped and a state dir it made is removed.

osfarm's tests share one in-process farm, started once per session by the ``farm`` fixture of
tests/conftest.py with :func:`farm_settings`' defaults; ``running_farm`` starts the others.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, overload

import httpx

from osfarm.config import FarmSettings
from osfarm.farm.api import UiMount
from osfarm.farm.local import local_farm
from osfarm.farm.server import FarmServer
from osfarm.providers.base import Provider
from osfarm.testing.farm_process import FarmProcess

W, H = 1024, 768
TOKEN = "test-farm-token-1234"


def farm_settings(state_dir: str | Path, **overrides: Any) -> FarmSettings:
    """The test farm's settings (``overrides`` win): 1024x768 sandbox desktops, two kept warm,
    three at most (the tests lease up to three at once). private_network gives each box its own
    network namespace, so its X server's abstract socket (@/tmp/.X11-unix/X0) cannot collide
    with other X servers on this host."""
    values: dict[str, Any] = dict(pool_min=2, pool_max=3, width=W, height=H, state_dir=state_dir, token=TOKEN,
                                  private_network=True, lease_ttl_s=120, health_interval_s=1.0, port=0)
    return FarmSettings(**{**values, **overrides})


@contextlib.contextmanager
def short_state_dir(prefix: str) -> Iterator[Path]:
    """A temporary state dir, removed on exit. Short (guest sockets live under it and sun_path is
    108 bytes): under OSFARM_STATE_DIR when set, else /tmp."""
    base = os.environ.get("OSFARM_STATE_DIR") or "/tmp"
    Path(base).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=base) as d:
        yield Path(d)


@overload
def running_farm(prefix: str = ..., start_timeout_s: float = ..., ui: UiMount | None = ..., *,
                 process: Literal[False] = ..., provider: str | Provider | None = ...,
                 settings: FarmSettings | None = ..., state_dir: Path | None = ..., env: dict[str, str] | None = ...,
                 ready: int | None = ...,
                 **overrides: Any) -> contextlib.AbstractContextManager[FarmServer]: ...


@overload
def running_farm(prefix: str = ..., start_timeout_s: float = ..., ui: UiMount | None = ..., *,
                 process: Literal[True], provider: str | Provider | None = ...,
                 settings: FarmSettings | None = ..., state_dir: Path | None = ..., env: dict[str, str] | None = ...,
                 ready: int | None = ...,
                 **overrides: Any) -> contextlib.AbstractContextManager[FarmProcess]: ...


def running_farm(prefix: str = "osf", start_timeout_s: float = 180.0, ui: UiMount | None = None, *,
                 process: bool = False, provider: str | Provider | None = None, settings: FarmSettings | None = None,
                 state_dir: Path | None = None, env: dict[str, str] | None = None, ready: int | None = None,
                 **overrides: Any) -> contextlib.AbstractContextManager[FarmServer | FarmProcess]:
    """A running farm, stopped with its desktops on exit; ``start_timeout_s`` bounds its start
    (and the warm pool's).

    In this process (the default): settings are :func:`farm_settings` with ``overrides`` (any
    FarmSettings field: ``pool_min``, ``token``, ``reset_mode`` ...), or ``settings`` as given;
    ``provider`` names one (``"sandbox"``, ``"docker"``, ``"libvirt"``; default: the settings'
    own, sandbox unless OSFARM_PROVIDER says otherwise) or is a provider object (a
    ``MemoryProvider``); ``ui`` mounts the dashboard. Yields the FarmServer.

    ``process=True``: ``osfarm serve`` (``provider="memory"``: the farm over memory boxes) on a
    fixed port of its own, so a restart comes back where clients look. ``overrides`` are its
    flags (``pool_min``, ``pool_max``, ``token``, ``width``, ``height``, ``port``, ``log_name``),
    ``env`` extra environment (``OSFARM_*`` settings), ``ready`` how many desktops must be ready
    before it is handed out (default one). Yields the FarmProcess (``kill``, ``restart``, ``rss_bytes`` ...).

    Without ``state_dir`` (or ``settings``) a short temporary one is made (``prefix``) and removed.
    """
    if process:
        if settings is not None or ui is not None or not isinstance(provider, str | None):
            raise ValueError("process=True: the farm process takes no settings object, ui or provider object "
                             "(give provider by name and settings as flags or OSFARM_* env)")
        return _farm_process(prefix, start_timeout_s, provider or "sandbox", state_dir, env, ready, overrides)
    if env is not None or ready is not None:
        raise ValueError("env and ready are for process=True: an in-process farm reads its settings")
    return _farm_in_process(prefix, start_timeout_s, ui, provider, settings, state_dir, overrides)


@contextlib.contextmanager
def _farm_in_process(prefix: str, start_timeout_s: float, ui: UiMount | None, provider: str | Provider | None,
                     settings: FarmSettings | None, state_dir: Path | None,
                     overrides: dict[str, Any]) -> Iterator[FarmServer]:
    with contextlib.ExitStack() as stack:
        if settings is None:
            if isinstance(provider, str):
                overrides = {"provider": provider, **overrides}
            d = state_dir or stack.enter_context(short_state_dir(prefix))
            settings = farm_settings(d, **overrides)
        elif overrides or state_dir is not None:
            raise ValueError("give either settings or overrides/state_dir, not both")
        if provider is None or isinstance(provider, str):
            if provider is not None and provider != settings.provider:
                raise ValueError(f"provider={provider!r} but the settings say {settings.provider!r}")
            extra_wait_s = max(0.0, start_timeout_s - settings.start_timeout_s)
            yield stack.enter_context(local_farm(settings, extra_wait_s=extra_wait_s, ui=ui))
            return
        server = FarmServer(settings, provider, ui=ui)
        server.start(timeout=start_timeout_s)
        stack.callback(server.stop)
        yield server


@contextlib.contextmanager
def _farm_process(prefix: str, start_timeout_s: float, provider: str, state_dir: Path | None,
                  env: dict[str, str] | None, ready: int | None, flags: dict[str, Any]) -> Iterator[FarmProcess]:
    with contextlib.ExitStack() as stack:
        d = state_dir or stack.enter_context(short_state_dir(prefix))
        farm = FarmProcess(d, provider=provider, env=env, **flags)
        stack.callback(farm.stop)
        farm.start(timeout=start_timeout_s, ready=ready)
        yield farm


def release_all_leases(server: FarmServer) -> int:
    """End every lease still held (by a test that failed or killed its client); returns how many."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=60) as c:
        held = [d["lease_id"] for d in c.get("/v1/pool").raise_for_status().json()["desktops"] if d.get("lease_id")]
        for lease_id in held:
            c.delete(f"/v1/desktops/{lease_id}")
    return len(held)
