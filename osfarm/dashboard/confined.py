"""Files under one root directory, read without ever leaving it.

Run dirs are written by agents' episodes, third-party suites and whoever copied them here, so the
dashboard treats them as hostile: a name with ``..``, an absolute path, or a symlink anywhere on
the way (a run dir holding ``blobs -> /etc``) must not reach a file outside the root. Resolving a
path and then opening it would leave a window in which a component is swapped for a symlink, so
every component is opened relative to its parent's descriptor with ``O_NOFOLLOW``: the kernel
refuses a symlink at the moment of the open. Only regular files are read (no FIFO that blocks a
reader, no device), and reads are capped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from osfarm.errors import OsfarmError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Refused(OsfarmError, LookupError):
    """A path that is not a readable regular file inside the root (the reason says why)."""


@dataclass(frozen=True)
class Entry:
    name: str
    is_dir: bool
    size: int
    mtime: float


def clean_parts(rel: str | PurePosixPath) -> list[str]:
    """The components of a relative path; Refused for absolute paths, ``..``, NUL or empties."""
    text = str(rel)
    if "\x00" in text or "\\" in text:
        raise Refused(f"path {text!r}: invalid character")
    if text.startswith("/"):
        raise Refused(f"path {text!r}: must be relative to the runs root")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise Refused(f"path {text!r}: '..' is not allowed")
    return parts


class ConfinedDir:
    """A directory tree read through descriptors only (see the module doc)."""

    def __init__(self, root: Path):
        # The root itself is the operator's choice (trusted): resolve it once.
        self.root = Path(root).resolve(strict=True)
        if not self.root.is_dir():
            raise NotADirectoryError(f"{self.root} is not a directory")

    @contextlib.contextmanager
    def _dir_fd(self, parts: list[str]) -> Iterator[int]:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts:
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    raise Refused(self._why(parts, part, e)) from None
                os.close(fd)
                fd = nfd
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _why(parts: list[str], part: str, e: OSError) -> str:
        where = "/".join(parts)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            return f"{where}: {part!r} is a symlink or not a directory"
        if e.errno == errno.ENOENT:
            return f"{where}: not found"
        return f"{where}: {e.strerror}"

    @contextlib.contextmanager
    def open(self, rel: str | PurePosixPath) -> Iterator[tuple[int, os.stat_result]]:
        """An open descriptor of the regular file ``rel`` and its stat; Refused otherwise."""
        parts = clean_parts(rel)
        if not parts:
            raise Refused("no file named")
        with self._dir_fd(parts[:-1]) as dfd:
            try:
                fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=dfd)
            except OSError as e:
                raise Refused(self._why(parts, parts[-1], e)) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Refused(f"{'/'.join(parts)}: not a regular file")
            os.set_blocking(fd, True)
            yield fd, st
        finally:
            os.close(fd)

    def read_bytes(self, rel: str | PurePosixPath, max_bytes: int) -> bytes:
        with self.open(rel) as (fd, st):
            if st.st_size > max_bytes:
                raise Refused(f"{rel}: {st.st_size} bytes, more than the {max_bytes} this page reads")
            chunks, left = [], max_bytes + 1
            while left > 0:
                b = os.read(fd, min(left, 1 << 20))
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
            data = b"".join(chunks)
        if len(data) > max_bytes:  # grew while we read it
            raise Refused(f"{rel}: more than {max_bytes} bytes")
        return data

    def read_text(self, rel: str | PurePosixPath, max_bytes: int) -> str:
        return self.read_bytes(rel, max_bytes).decode("utf-8", "replace")

    def lines(self, rel: str | PurePosixPath, max_line: int) -> Iterator[tuple[int, bytes]]:
        """(offset, line) of each line of a text file; a line longer than ``max_line`` is skipped."""
        with self.open(rel) as (fd, _st), os.fdopen(os.dup(fd), "rb") as f:
            offset = 0
            while True:
                line = f.readline(max_line + 1)
                if not line:
                    return
                start = offset
                offset += len(line)
                if len(line) > max_line and not line.endswith(b"\n"):
                    while line and not line.endswith(b"\n"):  # skip the rest of the long line
                        line = f.readline(1 << 20)
                        offset += len(line)
                    continue
                yield start, line

    def read_at(self, rel: str | PurePosixPath, offset: int, max_bytes: int) -> bytes:
        """The line starting at ``offset`` (an offset :meth:`lines` gave)."""
        with self.open(rel) as (fd, _st), os.fdopen(os.dup(fd), "rb") as f:
            f.seek(offset)
            return f.readline(max_bytes)

    def is_file(self, rel: str | PurePosixPath) -> bool:
        try:
            with self.open(rel):
                return True
        except Refused:
            return False

    def stat(self, rel: str | PurePosixPath) -> os.stat_result | None:
        try:
            with self.open(rel) as (_fd, st):
                return st
        except Refused:
            return None

    def entries(self, rel: str | PurePosixPath = "") -> list[Entry]:
        """A directory's entries (sorted by name), symlinks left out; Refused if it is not a
        directory inside the root."""
        parts = clean_parts(rel)
        out: list[Entry] = []
        with self._dir_fd(parts) as fd, os.scandir(fd) as it:
            for e in it:
                try:
                    if e.is_symlink():
                        continue
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                    out.append(Entry(e.name, stat.S_ISDIR(st.st_mode), st.st_size, st.st_mtime))
        return sorted(out, key=lambda x: x.name)
