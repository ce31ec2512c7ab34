"""The ``env`` object OSWorld's getters receive: where to reach the desktop, where to save files.

OSWorld passes its ``DesktopEnv``; our getters need only a few of its attributes, so the
evaluator builds an :class:`EvalEnv` instead. ``controller`` is a
:class:`osfarm.tasks.controller.GuestController` (sync), ``cache_dir`` is where fetched files
are written (OSWorld's ``env.cache_dir``, ``cache/<task_id>``), ``offline_cache`` resolves the
URLs of ``cloud_file`` getters to local files (an object with ``lookup(url, name) -> Path | None``),
and ``clock`` is the "now" that relative-date rules are computed from (injectable for tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from osfarm.evaluators.errors import RuleError

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

    def inside_cache(self, name: str) -> Path:
        """``cache_dir / name``, refused (:class:`RuleError`) unless it stays inside ``cache_dir``:
        names come from task files, which may be hostile, and the evaluator runs on the host."""
        p = self.cache_dir / name
        root = self.cache_dir.resolve()
        if Path(name).is_absolute() or not p.resolve().is_relative_to(root) or p.resolve() == root:
            raise RuleError(f"{name!r} must name a file inside the episode's cache dir")
        return p

    def cache_path(self, name: str) -> Path:
        """``cache_dir / name`` (see :meth:`inside_cache`), creating ``cache_dir`` and
        sub-folders of ``name`` on demand."""
        p = self.inside_cache(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def save(self, name: str, data: bytes) -> str:
        """Write ``data`` to ``cache_dir / name``; the local path a metric receives."""
        p = self.cache_path(name)
        p.write_bytes(data)
        return str(p)
