"""Run-dir JSONL: ``episodes.jsonl``, one ``osfarm.episode/1`` record per line.

Appends take an exclusive ``flock`` and write one whole line, so several processes (the
in-process runner, Celery workers on a shared run dir) can append to the same file without
interleaving. The source reads records back, validated, optionally following the file as it grows.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from osfarm.schema.episode import SchemaError, check_record


class JsonlSink:
    def __init__(self, path: Path, fsync: bool = False):
        self.path = Path(path)
        self.fsync = fsync

    def publish(self, rec: dict[str, Any]) -> None:
        line = (json.dumps(rec, ensure_ascii=False) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.write(line)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def read_jsonl(path: Path, validate: bool = True) -> Iterator[dict[str, Any]]:
    """Every record of ``path``; a bad line raises SchemaError naming ``path:line``."""
    with Path(path).open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
                yield check_record(rec) if validate else rec
            except (ValueError, SchemaError) as e:
                raise SchemaError(f"{path}:{n}: {e}") from None


def follow_jsonl(path: Path, poll_s: float = 0.5, stop: Any = None) -> Iterator[dict[str, Any]]:
    """Records appended to ``path`` from now on (``tail -f``); ends when ``stop()`` is true."""
    path = Path(path)
    pos = path.stat().st_size if path.exists() else 0
    buf = b""
    while stop is None or not stop():
        if path.exists() and path.stat().st_size > pos:
            with path.open("rb") as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                if raw.strip():
                    yield check_record(json.loads(raw))
        else:
            time.sleep(poll_s)
