"""Sandbox boxes for tests: a throwaway desktop, and the processes of boxes (to prove none is left)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import psutil

from osfarm.config import FarmSettings
from osfarm.providers.base import DesktopSpec
from osfarm.providers.sandbox import SANDBOX_ENV, SandboxProvider
from osfarm.tasks.controller import GuestController


def box_processes(state_dir: Path) -> list[psutil.Process]:
    """Live (non-zombie) processes that belong to sandboxes under ``state_dir``."""
    prefix = f"{state_dir}/sandbox/"
    found = []
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if any(a.startswith(prefix) for a in p.info["cmdline"] or ()):  # unshare, the box's init
                found.append(p)
            elif p.environ().get(SANDBOX_ENV, "").startswith(prefix):
                found.append(p)
        except psutil.Error:
            continue
    return found


@contextlib.asynccontextmanager
async def sandbox_guest(desktop_id: str, width: int, height: int) -> AsyncIterator[GuestController]:
    """One sandbox desktop in a throwaway state dir, driven through a GuestController."""
    state = Path(tempfile.mkdtemp(prefix=f"of{desktop_id}", dir="/tmp"))
    provider = SandboxProvider(FarmSettings(state_dir=state))
    handle = await provider.start(desktop_id, DesktopSpec(width=width, height=height))
    ctl = GuestController.from_endpoint(handle.endpoint)
    try:
        yield ctl
    finally:
        ctl.close()
        await provider.stop(handle)
        await provider.close()
        shutil.rmtree(state, ignore_errors=True)
