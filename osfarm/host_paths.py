"""Host paths named by hostile input (task files), kept inside the folders the farm chose for them.

:func:`relative_problem` is the rule for a name (relative, no ``..``); at run time every path is
opened through :func:`inside` (under a per-episode or cache folder; symlinks refused on the way)
or :func:`readable_inside` (a file to read must resolve inside the configured roots: the suite and
the file cache), raising :class:`TaskPathError`. The rules a task file's names must follow when it
is parsed are :mod:`osfarm.tasks.task_paths`'s.

Layer-neutral (standard library only): the task lifecycle (:mod:`osfarm.tasks`) and the evaluators
(the files getters save in an episode's cache, :mod:`osfarm.evaluators.getters.env`) both confine
with it, and neither imports the other's package for it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from osfarm.errors import OsfarmError

MAX_NAME = 255  # bytes in one path component (Linux's NAME_MAX)


class TaskPathError(OsfarmError, ValueError):
    """A path from a task that would leave its folder (absolute, ``..``, a symlink, outside the
    roots). ``where`` is the JSON path or parameter it came from, when known."""

    def __init__(self, reason: str, where: str = ""):
        self.reason, self.where = reason, where
        super().__init__(f"{where}: {reason}" if where else reason)


def relative_problem(value: Any, base: str = "the episode's folder") -> str | None:
    """Why ``value`` cannot name a file inside a task's folder (``base``, for the message), or
    None: it must be a relative path without ``..`` (sub-folders are fine)."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string naming a file"
    if "\0" in value:
        return "contains a NUL byte"
    p = PurePosixPath(value)
    if p.is_absolute() or value.startswith("~"):
        return f"{value!r} is an absolute path: name a file relative to {base}"
    if ".." in p.parts:
        return f"{value!r} contains '..': name a file inside {base}"
    if any(len(part.encode()) > MAX_NAME for part in p.parts):
        return f"{value!r}: a path component is longer than {MAX_NAME} bytes"
    if not p.parts or p.parts == (".",):
        return f"{value!r} names no file"
    return None


def inside(root: Path, name: str, where: str = "", *, create_parents: bool = False) -> Path:
    """``root / name`` for a task-given ``name``; TaskPathError when ``name`` is absolute, has
    ``..``, or any existing component on the way (below ``root``) is a symlink. ``root`` itself
    is the farm's (a per-episode or cache folder), never the task's. With ``create_parents`` the
    missing folders on the way are made (mode 0700)."""
    if (why := relative_problem(name)) is not None:
        raise TaskPathError(why, where)
    parts = PurePosixPath(name).parts
    p = Path(root)
    for i, part in enumerate(parts):
        p = p / part
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            if create_parents and i < len(parts) - 1:
                p.mkdir(mode=0o700)
            continue
        if stat.S_ISLNK(st.st_mode):
            raise TaskPathError(f"{name!r}: {'/'.join(parts[: i + 1])} is a symlink; refused", where)
        if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
            raise TaskPathError(f"{name!r}: {'/'.join(parts[: i + 1])} is not a folder", where)
    return p


def open_for_writing(path: Path) -> int:
    """A file descriptor to write ``path`` from the start, never through a symlink (O_NOFOLLOW)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def write_inside(root: Path, name: str, data: bytes, where: str = "") -> Path:
    """Write ``data`` to ``root / name`` (see :func:`inside`); the path written."""
    path = inside(root, name, where, create_parents=True)
    fd = open_for_writing(path)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def readable_inside(path: Path, roots: Iterable[Path], what: str, where: str = "") -> Path:
    """``path`` resolved (symlinks followed), if it lies inside one of ``roots`` (resolved too);
    TaskPathError otherwise: a task may read a host file only from the suite and the file cache."""
    roots = [Path(r) for r in roots if r is not None]
    try:
        real = Path(path).resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except (OSError, RuntimeError) as e:  # a symlink loop, a permission problem
        raise TaskPathError(f"{what} {path}: cannot be resolved ({e})", where) from None
    for root in roots:
        try:
            base = root.resolve(strict=True)
        except OSError:
            continue
        if real.is_relative_to(base) and real != base:
            return real
    allowed = ", ".join(str(r) for r in roots) or "none configured"
    raise TaskPathError(f"{what} {path} is outside the folders task files may be read from ({allowed})", where)


__all__ = ["MAX_NAME", "TaskPathError", "inside", "open_for_writing", "readable_inside", "relative_problem",
           "write_inside"]
