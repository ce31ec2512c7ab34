"""The file cache's manifest: what was downloaded, from where, with which SHA-256.

``<cache>/fetch-manifest.json`` beside OSWorld's ``<task_id>/<file>`` layout (OSWorld ignores
it). ``osfarm tasks fetch`` and online runs record every file they download; ``--verify`` checks
files against it, so a cache prepared on a machine with internet can be trusted on one without.
Writers in several threads or processes may share a cache: each update re-reads the file under
an exclusive lock and replaces it atomically.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

MANIFEST_NAME = "fetch-manifest.json"
SCHEMA = "osfarm.fetch/1"


class Manifest:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.path = self.root / MANIFEST_NAME
        self._lock = threading.Lock()

    def _key(self, path: Path) -> str:
        return Path(os.path.relpath(path, self.root)).as_posix()

    def read(self) -> dict[str, dict[str, Any]]:
        """``{relative path: {url, sha256, size, fetched_at}}``; empty when there is none (or it is
        unreadable: it is a record, never a reason to fail a run)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        files = data.get("files") if isinstance(data, dict) else None
        return files if isinstance(files, dict) else {}

    def entry(self, path: Path) -> dict[str, Any] | None:
        return self.read().get(self._key(path))

    def record(self, path: Path, url: str, sha256: str, size: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock, open(self.root / (MANIFEST_NAME + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            files = self.read()
            files[self._key(path)] = {"url": url, "sha256": sha256, "size": size,
                                      "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            tmp = self.path.with_name(f"{MANIFEST_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps({"schema": SCHEMA, "files": dict(sorted(files.items()))}, indent=1))
            os.replace(tmp, self.path)


__all__ = ["MANIFEST_NAME", "Manifest"]
