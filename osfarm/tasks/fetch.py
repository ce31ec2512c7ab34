"""Every file a suite downloads, and fetching them into a file cache (``osfarm tasks fetch``).

A task needs the files of its ``download`` steps (``config`` and ``evaluator.postconfig``:
``files[].url``, cached as OSWorld does at ``<cache>/<task_id>/<uuid5(url)>_<basename(path)>``)
and of its ``cloud_file`` getters (``path``, cached at ``<cache>/<task_id>/<dest>``, where
OSWorld's getter keeps it). Only http(s) URLs are assets; other paths are the suite's own files.
Live web pages a task opens (``chrome_open_tabs``, ``info_from_website``) are not files to
cache: they need the internet at run time.

:func:`fetch_assets` downloads what is missing with bounded concurrency, resumes partial files,
fetches a URL once however many tasks name it (the other copies are hard links), records every
file's SHA-256 in the cache's manifest and, with ``verify``, re-checks cached files against it.
One failure costs its asset, never the others.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from osfarm.http.download import DownloadError, DownloadPolicy, DownloadRefused, download, file_sha256
from osfarm.tasks.filecache import FileCache, cache_name
from osfarm.tasks.manifest import Manifest
from osfarm.tasks.model import Task

AssetKind = Literal["download", "cloud_file"]


@dataclass(frozen=True)
class Asset:
    """One file a task needs: where it comes from, where it goes in the cache, who asks for it."""

    url: str
    task_id: str
    name: str  # the file name the task gives it
    kind: AssetKind
    where: str  # JSON path in the task file

    def cache_path(self, root: Path) -> Path:
        """OSWorld's place for it under ``root``."""
        name = FileCache.file_name(self.url, self.name)
        if self.kind == "cloud_file":
            return root / self.task_id / name
        return root / self.task_id / cache_name(self.url, name)


def _is_web(url: Any) -> bool:
    return isinstance(url, str) and urlsplit(url).scheme in ("http", "https")


def task_assets(task: Task) -> list[Asset]:
    """The http(s) files ``task`` downloads, in file order."""
    out: list[Asset] = []
    steps = [("config", i, s) for i, s in enumerate(task.config)]
    steps += [("evaluator.postconfig", i, s) for i, s in enumerate(task.evaluator.postconfig)]
    for section, i, step in steps:
        if step.type != "download":
            continue
        files = step.parameters.get("files")
        for j, f in enumerate(files if isinstance(files, list) else []):
            if isinstance(f, dict) and _is_web(f.get("url")) and isinstance(f.get("path"), str):
                out.append(Asset(f["url"], task.id, os.path.basename(f["path"]), "download",
                                 f"$.{section}[{i}].parameters.files[{j}].url"))
    ev = task.evaluator
    for key in ("result", "expected"):
        specs = ev.aligned(key)
        many = isinstance(specs, list)
        for k, spec in enumerate(specs if many else [specs]):
            if spec is None or spec.type != "cloud_file":
                continue
            cfg = spec.to_json()
            paths, dests = cfg.get("path"), cfg.get("dest")
            listed = isinstance(paths, list)
            if not listed:
                paths, dests = [paths], [dests]
            if not isinstance(dests, list):
                continue
            base = f"$.evaluator.{key}" + (f"[{k}]" if many else "")
            for n, (url, dest) in enumerate(zip(paths, dests, strict=False)):
                if _is_web(url) and isinstance(dest, str):
                    where = f"{base}.path" + (f"[{n}]" if listed else "")
                    out.append(Asset(url, task.id, dest, "cloud_file", where))
    return out


def suite_assets(tasks: Iterable[Task]) -> list[Asset]:
    """Every asset of ``tasks``, one per cache path (a task naming a file twice needs it once)."""
    seen: dict[tuple[str, str, str], Asset] = {}
    for t in tasks:
        for a in task_assets(t):
            seen.setdefault((a.task_id, a.kind, a.name if a.kind == "cloud_file" else a.url + "\0" + a.name), a)
    return list(seen.values())


Status = Literal["fetched", "cached", "linked", "failed", "refused"]


@dataclass
class AssetResult:
    asset: Asset
    status: Status
    path: Path
    size: int = 0
    sha256: str | None = None
    error: str | None = None
    resumed_from: int = 0


@dataclass
class FetchReport:
    results: list[AssetResult] = field(default_factory=list)

    def count(self, status: Status) -> int:
        return sum(1 for r in self.results if r.status == status)

    @property
    def failed(self) -> list[AssetResult]:
        return [r for r in self.results if r.status in ("failed", "refused")]

    @property
    def bytes_fetched(self) -> int:
        return sum(r.size for r in self.results if r.status == "fetched")


# (asset, bytes so far, total or None) while downloading; (asset, None, None) when it is done
Progress = Callable[[Asset, int | None, int | None], None]


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".link-tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


async def fetch_assets(assets: list[Asset], root: Path, policy: DownloadPolicy, *, concurrency: int = 4,
                       verify: bool = False, progress: Progress | None = None) -> FetchReport:
    """Download every asset not yet under ``root`` (at most ``concurrency`` at once)."""
    root = Path(root)
    manifest = Manifest(root)
    known = manifest.read()
    report = FetchReport()
    by_url: dict[str, list[Asset]] = {}
    for a in assets:
        by_url.setdefault(a.url, []).append(a)
    sem = asyncio.Semaphore(max(1, concurrency))

    async def have(a: Asset) -> AssetResult | None:
        """The result for an asset already cached (and, with ``verify``, still intact)."""
        p = a.cache_path(root)
        if not p.is_file():
            return None
        entry = known.get(Path(os.path.relpath(p, root)).as_posix())
        if entry is not None and not verify:
            return AssetResult(a, "cached", p, p.stat().st_size, entry.get("sha256"))
        digest = await asyncio.to_thread(file_sha256, p)
        if entry is not None and entry.get("sha256") != digest:
            p.unlink()  # corrupted or replaced since it was fetched: fetch again
            return None
        if entry is None:  # e.g. copied from an OSWorld cache: record what it is now
            await asyncio.to_thread(manifest.record, p, a.url, digest, p.stat().st_size)
        return AssetResult(a, "cached", p, p.stat().st_size, digest)

    async def one_url(client: httpx.AsyncClient, url: str, group: list[Asset]) -> None:
        pending: list[Asset] = []
        source: AssetResult | None = None
        for a in group:
            r = await have(a)
            if r is None:
                pending.append(a)
            else:
                report.results.append(r)
                source = source or r
                if progress is not None:
                    progress(a, None, None)
        if not pending:
            return
        first = pending[0]
        if source is None:
            async with sem:
                dest = first.cache_path(root)
                try:
                    got = await download(url, dest, policy, client=client,
                                         progress=(lambda n, t: progress(first, n, t)) if progress else None)
                except DownloadError as e:
                    status: Status = "refused" if isinstance(e, DownloadRefused) else "failed"
                    for a in pending:
                        report.results.append(AssetResult(a, status, a.cache_path(root), error=e.reason))
                        if progress is not None:
                            progress(a, None, None)
                    return
            await asyncio.to_thread(manifest.record, got.path, url, got.sha256, got.size)
            source = AssetResult(first, "fetched", got.path, got.size, got.sha256, resumed_from=got.resumed_from)
            report.results.append(source)
            if progress is not None:
                progress(first, None, None)
            pending = pending[1:]
        for a in pending:  # the same URL for other tasks: one download, linked into place
            p = a.cache_path(root)
            await asyncio.to_thread(_link_or_copy, source.path, p)
            await asyncio.to_thread(manifest.record, p, url, source.sha256 or "", source.size)
            report.results.append(AssetResult(a, "linked", p, source.size, source.sha256))
            if progress is not None:
                progress(a, None, None)

    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=policy.connect_timeout_s)) as client:
        await asyncio.gather(*(one_url(client, url, group) for url, group in by_url.items()))
    order = {id(a): i for i, a in enumerate(assets)}
    report.results.sort(key=lambda r: order.get(id(r.asset), 0))
    return report


__all__ = ["Asset", "AssetResult", "FetchReport", "fetch_assets", "suite_assets", "task_assets"]
