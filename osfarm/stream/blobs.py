"""Content-addressed blobs (screenshots, a11y trees, model requests) referenced from records.

A ref is ``{"sha256", "path", "media_type", "size"}``; ``path`` is ``blobs/<sha[:2]>/<sha>.<ext>``
relative to the store's root (the run dir), so a run dir moves as one folder. Writing the same
bytes twice is a no-op, and a write is atomic (temp file + rename), so concurrent writers on a
shared filesystem are safe.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any, Protocol

from osfarm.errors import OsfarmError


class BlobMissing(OsfarmError, KeyError):
    """A ref whose bytes the store does not hold."""


class Blobs(Protocol):
    """What records need from a blob store (a local dir today; S3-compatible later, same refs)."""

    def put(self, data: bytes, ext: str, media_type: str) -> dict[str, Any]: ...

    def get(self, ref: dict[str, Any]) -> bytes: ...

    def has(self, ref: dict[str, Any]) -> bool: ...


def blob_ref(data: bytes, ext: str, media_type: str) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    return {"sha256": digest, "path": f"blobs/{digest[:2]}/{digest}.{ext.lstrip('.')}",
            "media_type": media_type, "size": len(data)}


class LocalBlobStore:
    """Blobs as files under ``root`` (``root/blobs/..``)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def put(self, data: bytes, ext: str, media_type: str) -> dict[str, Any]:
        ref = blob_ref(data, ext, media_type)
        p = self.root / ref["path"]
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
            tmp.write_bytes(data)
            tmp.replace(p)
        return ref

    def _path(self, ref: dict[str, Any]) -> Path:
        rel = Path(str(ref.get("path", "")))
        if rel.is_absolute() or ".." in rel.parts:
            raise ValueError(f"blob ref path {ref.get('path')!r} must be relative to the store, without '..'")
        return self.root / rel

    def has(self, ref: dict[str, Any]) -> bool:
        return self._path(ref).is_file()

    def get(self, ref: dict[str, Any]) -> bytes:
        p = self._path(ref)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise BlobMissing(f"blob {ref.get('sha256')} not found at {p}") from None
        if ref.get("sha256") and hashlib.sha256(data).hexdigest() != ref["sha256"]:
            raise BlobMissing(f"blob at {p} does not match its sha256 {ref['sha256']} (corrupt file)")
        return data


# The name results.py and run.py have used since the first runner.
BlobStore = LocalBlobStore
