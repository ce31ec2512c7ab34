"""Every host path a task file names, confined: task files are hostile input.

A task runs on the farm's host as much as in its desktop: its ``id`` names folders
(``cache/<id>/``, ``<out>/<domain>/<id>/``), ``execute`` steps save their output under the names
in ``stdout``/``stderr``, getters save fetched files under ``dest``, ``cache_file`` reads
``path``, ``upload_file`` reads ``local_path``, and ``download``/``cloud_file`` URLs may be
``file://`` or plain paths. Unchecked, ``"id": "../../etc"`` or ``"stdout": "/etc/cron.d/x"`` write
where the farm's user may write, and ``file:///etc/shadow`` uploads the host's secrets into the
desktop the agent controls. So:

* **statically**, when a task is parsed (:func:`task_path_problems`, called by
  :func:`osfarm.tasks.model.parse_task`): the id must be a plain name, and every name the task
  gives to a file on the host must be relative, without ``..``; an error names the task file and
  the JSON path (``calc/x.json: $.config[2].parameters.stdout: ...``), so a suite refuses the task
  (an ``infra_error`` episode) and the farm API answers 422;
* **at run time**, every path is opened through :func:`inside` (under a per-episode or cache
  folder; symlinks refused on the way) or :func:`readable_inside` (a file to read must resolve
  inside the configured roots: the suite and the file cache), raising :class:`TaskPathError`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

# Step types whose parameters name host files, and which keys.
_OUTPUT_KEYS = ("stdout", "stderr")  # execute / command: saved in the episode's folder
_EXECUTE_TYPES = ("execute", "command")
_MAX_NAME = 255


class TaskPathError(ValueError):
    """A path from a task that would leave its folder (absolute, ``..``, a symlink, outside the
    roots). ``where`` is the JSON path or parameter it came from, when known."""

    def __init__(self, reason: str, where: str = ""):
        self.reason, self.where = reason, where
        super().__init__(f"{where}: {reason}" if where else reason)


# -- the rules --------------------------------------------------------------------------------------


def plain_name_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a task id (a folder name on the host), or None."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if value in (".", "..") or "/" in value or "\\" in value or "\0" in value:
        return (f"{value!r} must be a plain name (no slash, backslash or NUL; not '.' or '..'): "
                "it names folders on the host")
    if len(value.encode()) > _MAX_NAME:
        return f"is longer than {_MAX_NAME} bytes"
    return None


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
    if any(len(part.encode()) > _MAX_NAME for part in p.parts):
        return f"{value!r}: a path component is longer than {_MAX_NAME} bytes"
    if not p.parts or p.parts == (".",):
        return f"{value!r} names no file"
    return None


def _getters(evaluator: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for key in ("result", "expected"):
        spec = evaluator.get(key)
        if isinstance(spec, dict):
            yield f"$.evaluator.{key}", spec
        elif isinstance(spec, list):
            for i, g in enumerate(spec):
                if isinstance(g, dict):
                    yield f"$.evaluator.{key}[{i}]", g


def _steps(data: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    evaluator = data.get("evaluator")
    post = evaluator.get("postconfig") if isinstance(evaluator, dict) else None
    for where, steps in (("$.config", data.get("config")), ("$.evaluator.postconfig", post)):
        if isinstance(steps, list):
            for i, step in enumerate(steps):
                if isinstance(step, dict):
                    yield f"{where}[{i}]", step


def task_path_problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    """``(JSON path, problem)`` for every host path of a task JSON object that is not confined."""
    out: list[tuple[str, str]] = []
    if (why := plain_name_problem(data.get("id"))) is not None:
        out.append(("$.id", why))
    for where, step in _steps(data):
        params = step.get("parameters")
        if not isinstance(params, dict):
            continue
        if step.get("type") in _EXECUTE_TYPES:
            for key in _OUTPUT_KEYS:
                if params.get(key) and (why := relative_problem(params[key])) is not None:
                    out.append((f"{where}.parameters.{key}", why))
        if step.get("type") == "upload_file" and isinstance(params.get("files"), list):
            for j, f in enumerate(params["files"]):
                if isinstance(f, dict) and "local_path" in f and \
                        (why := relative_problem(f["local_path"], "the suite or the file cache")) is not None:
                    out.append((f"{where}.parameters.files[{j}].local_path", why))
    evaluator = data.get("evaluator")
    if isinstance(evaluator, dict):
        for where, getter in _getters(evaluator):
            dest = getter.get("dest")
            names = dest if isinstance(dest, list) else [dest] if dest is not None else []
            for k, name in enumerate(names):
                if (why := relative_problem(name)) is not None:
                    out.append((f"{where}.dest" + (f"[{k}]" if isinstance(dest, list) else ""), why))
            if getter.get("type") == "cache_file" and (why := relative_problem(getter.get("path"))) is not None:
                out.append((f"{where}.path", why))
    return out


# -- at run time ----------------------------------------------------------------------------------


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


__all__ = ["TaskPathError", "inside", "open_for_writing", "plain_name_problem", "readable_inside",
           "relative_problem", "task_path_problems", "write_inside"]
