"""File getters (OSWorld ``getters/file.py``): copy a file out of the desktop or out of the
offline download cache into ``env.cache_dir`` and hand its local path to the metric.

A file that does not exist gives ``None`` in its place, so the metric scores 0.
"""

from __future__ import annotations

import logging
import shutil
from datetime import datetime
from typing import Any

import pandas as pd

from osfarm.evaluators.archive_limits import archive_problem
from osfarm.evaluators.errors import RuleError, UnsupportedOption
from osfarm.evaluators.getters.env import EvalEnv

log = logging.getLogger(__name__)


def _as_lists(config: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    if config.get("multi", False):
        return list(config["path"]), list(config["dest"])
    return [config["path"]], [config["dest"]]


def _pick(paths: list[str | None]) -> str | None | list[str | None]:
    """OSWorld returns a bare value for one given file, else the list."""
    return paths[0] if len(paths) == 1 else paths


def _with_time_suffix(name: str, fmt: str, now: datetime) -> str:
    # OSWorld inserts the date before the first "." (``a.xlsx`` -> ``a2024_01_31.xlsx``).
    if "." not in name:
        return name
    parts = name.split(".")
    return parts[0] + now.strftime(fmt) + "." + parts[1]


def vm_file(env: EvalEnv, path: str, dest: str) -> str | None:
    """The desktop's file ``path`` saved as ``dest`` in the cache dir: its local path, or None."""
    local = env.fetch_vm_file(path, dest)
    return None if local is None else str(local)


def get_vm_file(env: EvalEnv, config: dict[str, Any]) -> str | None | list[str | None]:
    """Config: ``path`` (desktop path), ``dest`` (name in the cache dir); ``multi`` (both are
    lists), ``gives`` (indices returned, default ``[0]``); single file only: ``time_suffix``,
    ``time_format`` (default ``%Y_%m_%d``) to append today's date to both names."""
    paths, dests = _as_lists(config)
    if not config.get("multi", False) and config.get("time_suffix"):
        fmt = config.get("time_format", "%Y_%m_%d")
        now = env.clock()
        paths = [_with_time_suffix(p, fmt, now) for p in paths]
        dests = [_with_time_suffix(d, fmt, now) for d in dests]
    gives = set(config.get("gives", [0]))
    out: list[str | None] = []
    for i, (p, d) in enumerate(zip(paths, dests, strict=False)):
        # streamed to disk with a byte cap; missing, too large or gone: None, the metric scores 0
        local = vm_file(env, p, d)
        if i in gives:
            out.append(local)
    return _pick(out)


def get_cloud_file(env: EvalEnv, config: dict[str, Any]) -> str | None | list[str | None]:
    """Config: ``path`` (URL), ``dest``; ``multi``, ``gives`` as in :func:`get_vm_file`.

    Offline: the URL is resolved through ``env.offline_cache`` (a file already in the cache dir
    under ``dest`` is reused, as OSWorld does); an URL that is not cached gives ``None``.
    """
    paths, dests = _as_lists(config)
    gives = set(config.get("gives", [0]))
    out: list[str | None] = []
    for i, (url, d) in enumerate(zip(paths, dests, strict=False)):
        local = env.cache_path(d)
        if not local.exists():
            # the dest names the cached copy, as in OSWorld's cache/<task_id>/<dest>
            src = env.offline_cache.lookup(url, d) if env.offline_cache is not None else None
            if src is None or not src.exists():
                log.warning("cloud_file: %s is not in the offline cache", url)
                if i in gives:
                    out.append(None)
                continue
            shutil.copyfile(src, local, follow_symlinks=False)
            if (why := archive_problem(local)) is not None:
                raise RuleError(f"cloud_file {url}: {why}")  # the task's own file: its fault, not the agent's
        if i in gives:
            out.append(str(local))
    return _pick(out)


def get_cache_file(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """Config: ``path`` relative to the cache dir (a file an earlier step saved there)."""
    p = env.inside_cache(config["path"])
    return str(p) if p.exists() else None


def get_content_from_vm_file(env: EvalEnv, config: dict[str, Any]) -> Any:
    """Config: ``path`` (desktop path), ``file_type`` (only ``xlsx``), ``file_content``
    (only ``last_row``: the last data row as a list of strings)."""
    path = config["path"]
    local = get_vm_file(env, {"path": path, "dest": path.rstrip("/").rsplit("/", 1)[-1]})
    if local is None:
        return None
    file_type, content = config.get("file_type"), config.get("file_content")
    if file_type == "xlsx" and content == "last_row":
        try:
            df = pd.read_excel(local)
        except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
            log.warning("content_from_vm_file: cannot read %s: %r", path, e)
            return None
        if df.empty:
            return None
        return df.iloc[-1].astype(str).tolist()
    raise UnsupportedOption(f"content_from_vm_file: file_type={file_type!r} file_content={content!r}")
