"""Find the processes of sandbox boxes, to prove that none is left behind."""

from __future__ import annotations

from pathlib import Path

import psutil

from osfarm.providers.sandbox import SANDBOX_ENV


def box_processes(state_dir: Path) -> list[psutil.Process]:
    """Live (non-zombie) processes that belong to sandboxes under ``state_dir``."""
    prefix = f"{state_dir}/sandbox/"
    found = []
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if p.info["name"] == "bwrap" and any(a.startswith(prefix) for a in p.info["cmdline"] or ()):
                found.append(p)
            elif p.environ().get(SANDBOX_ENV, "").startswith(prefix):
                found.append(p)
        except psutil.Error:
            continue
    return found
