"""Offline-first lookup of the files a task downloads (``download`` steps, ``cloud_file`` getters).

Where a URL's bytes are looked for, in order:

1. OSWorld's cache layout under ``root``: ``<root>/<task_id>/<uuid5(url)>_<file name>`` (what
   OSWorld's own runs leave behind) or ``<root>/<task_id>/<file name>``;
2. the URL map (``url -> path``; a JSON or YAML file's relative paths are relative to that file,
   a dict's relative paths to ``root``);
3. ``file://`` URLs, and plain paths (relative ones against ``suite_dir``);
4. http(s), downloaded once into the OSWorld layout above (never when ``offline``), under a
   :class:`~osfarm.http.download.DownloadPolicy` (http(s) only, no redirect off http(s), size and
   time limits, no private addresses, optional host allow-list: task files are hostile), and
   recorded with its SHA-256 in the cache's manifest (:mod:`osfarm.tasks.manifest`).

A file that cannot be found raises :class:`AssetMissing`, whose message names the URL and every
place that was looked at.

Task files are hostile, and so is what a third-party suite ships in its cache: a file found any
of these ways is read only if it resolves (symlinks followed) inside the cache's ``roots``: the
cache root, the suite folder, the folder of a URL map file the operator named, and any
``roots=`` given. ``file:///etc/shadow``, a plain ``/etc/shadow`` or a cache entry that is a
symlink out of the cache raise :class:`~osfarm.tasks.task_paths.TaskPathError`. Downloads are
written only through paths without symlinks.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import yaml

from osfarm.errors import OsfarmError
from osfarm.http.download import DownloadError, DownloadPolicy, download_sync
from osfarm.tasks.manifest import Manifest
from osfarm.tasks.task_paths import (
    TaskPathError,
    inside,
    plain_name_problem,
    readable_inside,
)

if TYPE_CHECKING:
    from osfarm.tasks.suite import Suite

URL_MAP_NAMES = ("url_map.json", "url_map.yaml", "url_map.yml")


class AssetMissing(OsfarmError, FileNotFoundError):
    """A task's file is in none of the places looked at (and may not be downloaded)."""

    def __init__(self, url: str, looked: list[str], reason: str = "not available offline"):
        self.url, self.looked, self.reason = url, list(looked), reason
        where = "; ".join(self.looked) if self.looked else "nowhere"
        super().__init__(f"asset {url} {reason}; looked in: {where}")


def load_url_map(path: str | Path) -> dict[str, str]:
    """Read a JSON or YAML ``{url: path}`` file; relative paths become relative to its folder."""
    path = Path(path)
    text = path.read_text()
    if path.suffix.lower() in (".yaml", ".yml"):
        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise TypeError(f"{path}: expected a mapping of url -> path, got {type(data).__name__}")
    out: dict[str, str] = {}
    for url, p in data.items():
        if not isinstance(url, str) or not isinstance(p, str):
            raise TypeError(f"{path}: entry {url!r}: expected a string path, got {type(p).__name__}")
        out[url] = str((path.parent / p).resolve()) if not os.path.isabs(p) else p
    return out


def cache_name(url: str, name: str) -> str:
    """OSWorld's cache file name: ``<uuid5(NAMESPACE_URL, url)>_<name>``."""
    return f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{name}"


class FileCache:
    def __init__(self, root: Path, url_map: dict[str, str] | None = None, *, suite_dir: Path | None = None,
                 offline: bool = False, timeout: float = 300.0, policy: DownloadPolicy | None = None,
                 roots: list[Path] | tuple[Path, ...] = ()):
        self.root = Path(root)
        self.suite_dir = Path(suite_dir) if suite_dir else None
        # Where files a task names may be read from (see the module doc).
        self.roots: list[Path] = [self.root, *([self.suite_dir] if self.suite_dir else []), *map(Path, roots)]
        self.offline = offline
        self.policy = policy or DownloadPolicy.from_env(timeout_s=timeout)
        self.manifest = Manifest(self.root)
        self.url_map = {u: (p if os.path.isabs(p) else str(self.root / p)) for u, p in (url_map or {}).items()}

    @classmethod
    def with_map_file(cls, root: Path, map_file: str | Path, **kw: object) -> FileCache:
        """A cache with the URL map in ``map_file``, whose folder becomes one of the roots."""
        roots = [*kw.pop("roots", ()), Path(map_file).parent]  # type: ignore[misc]
        return cls(root, load_url_map(map_file), roots=roots, **kw)  # type: ignore[arg-type]

    def task_dir(self, task_id: str) -> Path:
        """``<root>/<task_id>``: where downloads and saved command output go (created; never a symlink)."""
        self._check_task_id(task_id)
        self.root.mkdir(parents=True, exist_ok=True)
        d = inside(self.root, task_id, "task id")
        d.mkdir(exist_ok=True)
        return d

    @staticmethod
    def _check_task_id(task_id: str) -> None:
        if (why := plain_name_problem(task_id)) is not None:
            raise TaskPathError(why, "task id")

    def _readable(self, path: Path, url: str) -> Path:
        """``path`` (an existing file) if it lies inside the roots; TaskPathError otherwise."""
        return readable_inside(path, self.roots, "file", url)

    @staticmethod
    def file_name(url: str, name: str | None = None) -> str:
        if name:
            return os.path.basename(name.rstrip("/")) or "file"
        return os.path.basename(unquote(urlparse(url).path).rstrip("/")) or "file"

    def fetch(self, url: str, task_id: str, name: str | None = None, offline: bool | None = None) -> Path:
        """Local path of ``url``'s bytes (``name``: the file name used in the cache)."""
        offline = self.offline if offline is None else offline
        self._check_task_id(task_id)
        fname = self.file_name(url, name)
        looked: list[str] = []
        tdir = self.root / task_id
        # the task's own name for the file (OSWorld: cache/<task>/<uuid5>_<name> for downloads,
        # cache/<task>/<dest> for cloud_file), then the URL's file name
        names = list(dict.fromkeys([fname, self.file_name(url)]))
        for cand in [tdir / cache_name(url, n) for n in names] + [tdir / n for n in names]:
            looked.append(str(cand))
            if cand.is_file():
                self._readable(cand, url)
                return cand
        if url in self.url_map:
            cand = Path(self.url_map[url])
            looked.append(f"url map -> {cand}")
            if cand.is_file():
                return self._readable(cand, url)
        else:
            looked.append("url map (no entry)")
        parsed = urlparse(url)
        if parsed.scheme == "file":
            cand = Path(unquote(parsed.path))
            looked.append(str(cand))
            if cand.is_file():
                return self._readable(cand, url)
            raise AssetMissing(url, looked, "does not exist")
        if parsed.scheme not in ("http", "https"):  # a plain path
            cand = Path(url)
            if not cand.is_absolute():
                if self.suite_dir is None:
                    looked.append(f"{url} (no suite dir to resolve it against)")
                    raise AssetMissing(url, looked, "does not exist")
                cand = self.suite_dir / cand
            looked.append(str(cand))
            if cand.is_file():
                return self._readable(cand, url)
            raise AssetMissing(url, looked, "does not exist")
        if offline:
            raise AssetMissing(url, looked)
        return self._download(url, self.task_dir(task_id) / cache_name(url, fname), looked)

    def _download(self, url: str, dest: Path, looked: list[str]) -> Path:
        # The downloader opens these by name: none of them may be a planted symlink.
        for side in ("", ".part", ".part.json", ".lock"):
            inside(dest.parent, dest.name + side, url)
        try:
            got = download_sync(url, dest, self.policy)
        except DownloadError as e:
            raise AssetMissing(url, looked + [url], f"could not be downloaded ({e.reason})") from e
        self.manifest.record(got.path, url, got.sha256, got.size)
        return dest


def suite_cache(suite: Suite, suite_dir: Path, cache: Path | None, out: Path, offline: bool,
                policy: DownloadPolicy | None = None) -> FileCache:
    """A suite's file cache: ``cache`` or else ``<suite_dir>/cache`` (OSWorld's ``cache/<task>/<file>``
    layout, plus an optional ``url_map.json``/``.yaml``), else ``<out>/cache``; relative task paths
    resolve against the suite's task root. ``policy`` rules online downloads (default: from the
    environment, see :meth:`DownloadPolicy.from_env`)."""
    root = cache if cache is not None else (suite_dir / "cache" if (suite_dir / "cache").is_dir() else out / "cache")
    url_map: dict[str, str] = {}
    for name in URL_MAP_NAMES:
        if (root / name).is_file():
            url_map = load_url_map(root / name)
            break
    return FileCache(root, url_map, suite_dir=suite.root, offline=offline, policy=policy)


__all__ = ["URL_MAP_NAMES", "AssetMissing", "FileCache", "cache_name", "load_url_map", "suite_cache"]
