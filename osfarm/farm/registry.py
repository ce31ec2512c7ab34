"""The farm's memory on disk: the lease table and the desktop registry, so the farm survives its
own restart.

``<state_dir>/farm-registry.sqlite`` (SQLite in WAL mode, file mode 0600: it holds the guests'
tokens) keeps

* every desktop that holds a box: its id, state, lease and the provider's handle (how to reach
  its guest; what the provider needs to take the box over again);
* every live lease (id, desktop, owner, principal, ttl, times) and the last ``ENDED_KEPT`` ended
  ones with the message a client gets (410) when it names one.

Writes run in order on one writer thread (the event loop never waits on the disk); each write
method returns a future, and the pool awaits the ones a client's answer depends on (a granted
lease is on disk before its id is returned, a release before the 204). The writer commits every
write queued meanwhile in one transaction: under load (hundreds of leases a second) one commit
carries many writes instead of each waiting its turn. Heartbeats are not written: a lease taken
over after a restart gets a fresh TTL (its holder could not reach the farm while it was down).

What a restart does with this (``LeasePool.start``): each saved desktop is offered to the
provider's ``adopt`` (docker: the container still runs; libvirt: the VM still runs; sandbox: its
boxes died with the farm, by design); an adopted box whose guest answers keeps its state and its
lease; every other saved lease ends with a 410 that says its desktop did not survive the restart.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from osfarm.errors import OsfarmError
from osfarm.providers.base import DesktopHandle, DesktopSpec, GuestEndpoint

log = logging.getLogger("osfarm.farm.registry")
Statement = tuple[str, tuple[Any, ...]]  # SQL and its parameters

FILE_NAME = "farm-registry.sqlite"
LOCK_NAME = "farm-registry.lock"
ENDED_KEPT = 10_000
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS desktops (
    id TEXT PRIMARY KEY, state TEXT NOT NULL, lease_id TEXT, handle TEXT, since REAL NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY, desktop_id TEXT NOT NULL, owner TEXT, principal TEXT, created_at REAL NOT NULL,
    expires_at REAL NOT NULL, ttl_s REAL NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ended (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, owner TEXT, principal TEXT,
    message TEXT NOT NULL, ended_at REAL NOT NULL);
"""


class RegistryError(OsfarmError, RuntimeError):
    """The registry file cannot be used (another farm's newer schema, a corrupt file)."""


@dataclass
class SavedDesktop:
    id: str
    state: str
    lease_id: str | None
    handle: DesktopHandle | None
    since: float


@dataclass
class SavedLease:
    id: str
    desktop_id: str
    owner: str | None
    principal: str | None
    created_at: float
    expires_at: float
    ttl_s: float
    data: dict[str, Any]  # the rest of the lease (screen, provider, image, wait_s)


@dataclass
class SavedEnded:
    id: str
    owner: str | None
    principal: str | None
    message: str


@dataclass
class Snapshot:
    desktops: list[SavedDesktop]
    leases: list[SavedLease]
    ended: list[SavedEnded]  # oldest first


def handle_to_json(handle: DesktopHandle) -> str:
    return json.dumps(asdict(handle))


def handle_from_json(text: str) -> DesktopHandle:
    d = json.loads(text)
    return DesktopHandle(id=d["id"], provider=d["provider"], spec=DesktopSpec(**d["spec"]),
                         endpoint=GuestEndpoint(**d["endpoint"]), pid=d.get("pid"), info=dict(d.get("info") or {}))


class FarmRegistry:
    """The registry file of one state dir (see the module doc). ``open`` before use."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / FILE_NAME
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="osfarm-registry")
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._last: Future[None] | None = None
        self._queue: queue.SimpleQueue[tuple[list[Statement], Future[None]] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._ended_writes = 0

    # -- the file (on the registry thread) ---------------------------------------------------

    def _lock(self) -> None:
        """One farm per state dir: two would take over each other's desktops at their restarts."""
        lock = self.path.with_name(LOCK_NAME)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RegistryError(f"another farm uses the state dir {self.path.parent} (lock {lock} is held); "
                                f"stop it or set a different OSFARM_STATE_DIR") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._connect()
        except BaseException:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            raise

    def _connect(self) -> None:
        fresh = not self.path.exists()
        if fresh:  # create it private: it holds the guest tokens
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            # WAL + NORMAL: a commit survives the process being killed (the OS has it); only a
            # power loss may cost the last commits, and a restart then ends those leases with 410
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            row = conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                conn.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise RegistryError(f"{self.path}: registry schema {row[0]}, this farm knows {SCHEMA_VERSION}; "
                                    f"move the file away to start with an empty registry")
        except sqlite3.DatabaseError as e:
            conn.close()
            raise RegistryError(f"{self.path}: not a usable registry ({e}); move it away to start afresh") from None
        except BaseException:
            conn.close()
            raise
        os.chmod(self.path, 0o600)
        self._conn = conn

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RegistryError("the registry is not open")
        return self._conn

    def _load(self) -> Snapshot:
        db = self._db()
        desktops = [SavedDesktop(i, s, lid, handle_from_json(h) if h else None, since)
                    for i, s, lid, h, since in db.execute("SELECT id, state, lease_id, handle, since FROM desktops")]
        leases = [SavedLease(i, did, o, p, c, e, t, json.loads(data))
                  for i, did, o, p, c, e, t, data in db.execute(
                      "SELECT id, desktop_id, owner, principal, created_at, expires_at, ttl_s, data FROM leases")]
        ended = [SavedEnded(i, o, p, m) for i, o, p, m in db.execute(
            "SELECT id, owner, principal, message FROM ended ORDER BY seq")]
        return Snapshot(desktops, leases, ended)

    def _write_loop(self) -> None:
        """The writer thread: every write queued since the last commit goes in one transaction."""
        db = self._db()
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            stop = False
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            try:
                db.execute("BEGIN IMMEDIATE")
                for statements, _ in batch:
                    for sql, params in statements:
                        db.execute(sql, params)
                db.execute("COMMIT")
            except BaseException as e:  # noqa: BLE001 - handed to every waiting caller
                log.exception("registry write failed (%d writes): the farm goes on; a restart may not know them",
                              len(batch))
                if db.in_transaction:
                    db.execute("ROLLBACK")
                for _, fut in batch:
                    fut.set_exception(e)
            else:
                for _, fut in batch:
                    fut.set_result(None)
            if stop:
                return

    # -- the async face (event loop) ---------------------------------------------------------

    async def open(self) -> Snapshot:
        """Open (or create) the file and return what it holds; writes may follow."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._open)
        snapshot = await loop.run_in_executor(self._executor, self._load)
        self._writer = threading.Thread(target=self._write_loop, name="osfarm-registry", daemon=True)
        self._writer.start()
        return snapshot

    def _submit(self, statements: list[tuple[str, tuple[Any, ...]]]) -> Future[None]:
        fut: Future[None] = Future()
        self._queue.put((statements, fut))
        self._last = fut
        return fut

    async def flush(self) -> None:
        """Wait until every write queued so far is on disk (writes run in order)."""
        last = self._last
        if last is not None:
            await asyncio.wrap_future(last)

    def put_desktop(self, desktop_id: str, state: str, lease_id: str | None,
                    handle: DesktopHandle | None) -> Future[None]:
        return self._submit([("INSERT OR REPLACE INTO desktops VALUES (?, ?, ?, ?, ?)",
                              (desktop_id, state, lease_id, handle_to_json(handle) if handle else None, time.time()))])

    def drop_desktop(self, desktop_id: str) -> Future[None]:
        return self._submit([("DELETE FROM desktops WHERE id = ?", (desktop_id,))])

    def put_lease(self, lease_id: str, desktop_id: str, owner: str | None, principal: str | None, created_at: float,
                  expires_at: float, ttl_s: float, data: dict[str, Any], handle: DesktopHandle | None) -> Future[None]:
        """The lease and its desktop (leased, with the handle) in one transaction."""
        return self._submit([
            ("INSERT OR REPLACE INTO leases VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
             (lease_id, desktop_id, owner, principal, created_at, expires_at, ttl_s, json.dumps(data))),
            ("INSERT OR REPLACE INTO desktops VALUES (?, ?, ?, ?, ?)",
             (desktop_id, "leased", lease_id, handle_to_json(handle) if handle else None, time.time())),
        ])

    def end_lease(self, lease_id: str, owner: str | None, principal: str | None, message: str) -> Future[None]:
        self._ended_writes += 1
        statements: list[tuple[str, tuple[Any, ...]]] = [
            ("DELETE FROM leases WHERE id = ?", (lease_id,)),
            ("INSERT OR REPLACE INTO ended (id, owner, principal, message, ended_at) VALUES (?, ?, ?, ?, ?)",
             (lease_id, owner, principal, message, time.time())),
            ("UPDATE desktops SET lease_id = NULL WHERE lease_id = ?", (lease_id,)),
        ]
        if self._ended_writes % 500 == 0:  # keep the last ENDED_KEPT, as the pool does in memory
            statements.append(("DELETE FROM ended WHERE seq <= (SELECT MAX(seq) FROM ended) - ?", (ENDED_KEPT,)))
        return self._submit(statements)

    async def close(self) -> None:
        await self.flush()
        if self._writer is not None:
            self._queue.put(None)
            await asyncio.to_thread(self._writer.join)
            self._writer = None

        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

        await asyncio.get_running_loop().run_in_executor(self._executor, shut)
        self._executor.shutdown(wait=True)
