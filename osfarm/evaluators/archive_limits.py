"""Zip bombs: an archive the agent made (an .xlsx, .docx, .pptx, .zip is a zip file) is checked
before any metric opens it.

Python's :mod:`zipfile` never yields more than a member's declared ``file_size`` (and fails the
CRC check when the data disagree), and every metric library here reads zips through it
(openpyxl, python-docx, python-pptx, our own ``zipfile`` calls). So the sum of the declared
sizes in the central directory bounds what opening the file can unpack, and is known without
unpacking anything. Over :data:`MAX_UNPACKED_BYTES` or :data:`MAX_MEMBERS`, the file is not
scored (the getter returns None: the metric scores 0, the agent's failure).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

MAX_UNPACKED_BYTES = 512 << 20
MAX_MEMBERS = 20_000


def archive_problem(path: Path, max_unpacked: int = MAX_UNPACKED_BYTES, max_members: int = MAX_MEMBERS) -> str | None:
    """Why the zip file at ``path`` may not be opened, or None (also for a file that is no zip)."""
    try:
        if not zipfile.is_zipfile(path):
            return None
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return None  # not a readable archive: the metric's own reading fails and scores 0
    if len(infos) > max_members:
        return f"an archive of {len(infos)} members (limit {max_members})"
    total = sum(i.file_size for i in infos)
    if total > max_unpacked:
        return f"an archive that unpacks to {total} bytes (limit {max_unpacked})"
    return None


def read_member(zf: zipfile.ZipFile, name: str, max_bytes: int = MAX_UNPACKED_BYTES) -> bytes:
    """One member's bytes, refused (ValueError) when it declares more than ``max_bytes``."""
    info = zf.getinfo(name)
    if info.file_size > max_bytes:
        raise ValueError(f"archive member {name} unpacks to {info.file_size} bytes (limit {max_bytes})")
    return zf.read(info)


__all__ = ["MAX_MEMBERS", "MAX_UNPACKED_BYTES", "archive_problem", "read_member"]
