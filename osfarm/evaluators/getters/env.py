"""The ``env`` object OSWorld's getters receive: where to reach the desktop, where to save files.

OSWorld passes its ``DesktopEnv``; our getters need only a few of its attributes, so the
evaluator builds an :class:`EvalEnv` instead. ``controller`` is a
:class:`osfarm.tasks.controller.GuestController` (sync), ``cache_dir`` is where fetched files
are written (OSWorld's ``env.cache_dir``, ``cache/<task_id>``), ``offline_cache`` resolves the
URLs of ``cloud_file`` getters to local files (an object with ``lookup(url, name) -> Path | None``),
and ``clock`` is the "now" that relative-date rules are computed from (injectable for tests).

Files land in ``cache_dir`` through :meth:`EvalEnv.fetch_vm_file` (streamed from the desktop with
the controller's byte cap, an archive's declared unpacked size checked: the agent made the file)
and :meth:`EvalEnv.save`; names come from task files and never leave ``cache_dir`` (no absolute
path, no ``..``, no symlink on the way, files opened with ``O_NOFOLLOW``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from osfarm.evaluators.archive_limits import archive_problem
from osfarm.evaluators.errors import RuleError
from osfarm.host_paths import TaskPathError, inside, open_for_writing
from osfarm.http.errors import GuestError

log = logging.getLogger(__name__)

# The desktop user's home, as in OSWorld's VM: where apps keep the profiles getters read.
HOME = "/home/user"


class OfflineCache(Protocol):
    def lookup(self, url: str, name: str | None = None) -> Path | None:
        """The local copy of ``url`` (``name``: the file name the task gives it), or None."""
        ...


@dataclass
class EvalEnv:
    controller: Any
    cache_dir: Path
    task_id: str = ""
    offline_cache: OfflineCache | None = None
    screen: tuple[int, int] = (1920, 1080)
    clock: Callable[[], datetime] = field(default=datetime.now)

    def __post_init__(self) -> None:
        self.cache_dir = Path(self.cache_dir)

    def inside_cache(self, name: str, create_parents: bool = False) -> Path:
        """``cache_dir / name``, refused (:class:`RuleError`) unless it stays inside ``cache_dir``:
        names come from task files, which may be hostile, and the evaluator runs on the host."""
        if create_parents:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            return inside(self.cache_dir, name, create_parents=create_parents)
        except TaskPathError as e:
            raise RuleError(f"{name!r} must name a file inside the episode's cache dir ({e.reason})") from None

    def cache_path(self, name: str) -> Path:
        """``cache_dir / name`` (see :meth:`inside_cache`), creating ``cache_dir`` and
        sub-folders of ``name`` on demand."""
        return self.inside_cache(name, create_parents=True)

    def save(self, name: str, data: bytes) -> str:
        """Write ``data`` to ``cache_dir / name``; the local path a metric receives."""
        p = self.cache_path(name)
        with os.fdopen(open_for_writing(p), "wb") as f:
            f.write(data)
        return str(p)

    def fetch_vm_file(self, path: str, name: str) -> Path | None:
        """Copy the desktop's file ``path`` to ``cache_dir / name``, streamed with the controller's
        byte cap; None (a metric then scores 0) when it is missing, over the cap, an archive
        that unpacks to more than the limit, or the desktop does not answer. A bad ``name``
        raises RuleError (the task's fault)."""
        local = self.cache_path(name)
        try:
            found = self.controller.download_file(path, local)
        except GuestError as e:  # over the cap, or the desktop is gone: the agent's result is unusable
            log.warning("vm file %s: %s", path, e)
            return None
        if not found:
            log.info("vm file %s not found in the desktop", path)
            return None
        if (why := archive_problem(local)) is not None:
            log.warning("vm file %s: %s; scored as missing", path, why)
            local.unlink()
            return None
        return local
