"""A farm inside this process, for the commands and benches that need desktops but were given no
farm URL (``osfarm eval``/``train``/``demo``, bench scripts): settings, start, stop, in one place.

::

    with local_farm(local_farm_settings(envs=4)) as server:
        run(server.url, server.token)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from osfarm.config import FarmSettings, load_settings
from osfarm.farm.api import UiMount
from osfarm.farm.server import FarmServer
from osfarm.providers import make_provider


def local_farm_settings(envs: int, spares: int = 1, config: Path | None = None, **overrides: Any) -> FarmSettings:
    """Settings of an in-process farm for ``envs`` episodes at once: any free loopback port and
    ``envs + spares`` desktops kept warm, so the next episode leases a ready spare while the
    desktop just released is being reset. ``overrides`` are FarmSettings fields (width, provider...)."""
    n = max(1, envs) + max(0, spares)
    return load_settings(config, **{"port": 0, **overrides, "pool_min": n, "pool_max": n})


@runtime_checkable
class _OwnStartTimeout(Protocol):
    """A provider that waits longer for a start than the settings say (libvirt under TCG)."""

    start_timeout_s: float


def start_local_farm(settings: FarmSettings, extra_wait_s: float = 30.0, ui: UiMount | None = None) -> FarmServer:
    """Start the farm and wait for its warm pool (the provider's start timeout + ``extra_wait_s``
    at most); the caller stops it. The provider is made first, so a missing box tool/Xvfb/docker
    raises its ProviderError (naming the fix) before anything starts; a farm that does not come up
    raises RuntimeError."""
    provider = make_provider(settings)
    start_s = settings.start_timeout_s
    if isinstance(provider, _OwnStartTimeout):
        start_s = max(start_s, provider.start_timeout_s)
    server = FarmServer(settings, provider, ui=ui)
    server.start(timeout=start_s + extra_wait_s)
    return server


@contextlib.contextmanager
def local_farm(settings: FarmSettings, extra_wait_s: float = 30.0, ui: UiMount | None = None) -> Iterator[FarmServer]:
    """:func:`start_local_farm` as a context manager: the farm and its desktops stop on exit."""
    server = start_local_farm(settings, extra_wait_s, ui)
    try:
        yield server
    finally:
        server.stop()
