"""A stream consumer that loses no episode and takes none twice, whatever dies.

Reading a consumer group hands each entry to one consumer and keeps it *pending* until that
consumer acknowledges it. :class:`StreamConsumer` acknowledges an entry only after its record is
durably written to a local journal (JSONL, fsynced); so a consumer killed at any moment either
acknowledged a record that is on its disk, or left it pending in Redis, where:

* the same consumer (same name) reads its own pending entries first when it comes back, and
* another consumer reclaims them (``XAUTOCLAIM``) once they idled ``claim_idle_ms``: a timer
  runs the claim every ``claim_every_s`` while the consumer reads.

A record is journaled once per episode id (a redelivered entry finds its id in the journal and is
only acknowledged), and :meth:`StreamConsumer.replay` gives back what the journal holds, for the
state the caller rebuilds after a restart (the trainer skips the episode ids its checkpoint has
seen). Invalid entries and poison entries go to the dead-letter stream
(:mod:`osfarm.stream.redis_stream`); the stream is trimmed to what every group acknowledged.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from osfarm.schema.episode import SchemaError, check_record
from osfarm.stream.jsonl import JsonlSink

log = logging.getLogger("osfarm.stream.consumer")

CLAIM_IDLE_MS = 60_000  # a consumer silent this long on an entry is taken for dead
CLAIM_EVERY_S = 15.0
TRIM_EVERY = 50  # acknowledgements between two trims


class GroupEntry(Protocol):
    id: str
    record: dict[str, Any]


class GroupSource(Protocol):
    """One consumer of a consumer group: :class:`osfarm.stream.redis_stream.RedisStreamSource`
    (a protocol here, so that importing this module does not import the redis package)."""

    def pending_mine(self, count: int = ...) -> Sequence[GroupEntry]: ...

    def claim_stale(self, min_idle_ms: int, count: int = ...) -> Sequence[GroupEntry]: ...

    def read(self, count: int = ..., block_ms: int | None = ...) -> Sequence[GroupEntry]: ...

    def ack(self, *ids: str) -> int: ...

    def trim(self) -> int: ...


class StreamConsumer:
    """Durable consumption of one consumer group (blocking calls: run them in a thread)."""

    def __init__(self, source: GroupSource, journal: Path, *, claim_idle_ms: int = CLAIM_IDLE_MS,
                 claim_every_s: float = CLAIM_EVERY_S, trim_every: int = TRIM_EVERY,
                 monotonic: Callable[[], float] = time.monotonic):
        self.source = source
        self.journal = Path(journal)
        self.claim_idle_ms = claim_idle_ms
        self.claim_every_s = claim_every_s
        self.trim_every = trim_every
        self._monotonic = monotonic
        self._sink = JsonlSink(self.journal, fsync=True)
        self._journaled: set[str] = {rec["episode_id"] for rec in self._read_journal()}
        self._own_pending_done = False
        self._next_claim = 0.0  # claim at the first poll: a restarted trainer has a new name
        self._acked = 0
        self.stats = {"read": 0, "claimed": 0, "duplicates": 0, "acked": 0}

    # -- the journal ---------------------------------------------------------------------------

    def _read_journal(self) -> Iterator[dict[str, Any]]:
        """The journal's records; a torn last line (killed mid-write) is cut off, not fatal."""
        if not self.journal.is_file():
            return
        good_end = 0
        with self.journal.open("rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # torn by a crash mid-append: never acknowledged, Redis still has it
                try:
                    rec = check_record(json.loads(raw))
                except (ValueError, SchemaError) as e:
                    raise SchemaError(f"{self.journal}: byte {good_end}: {e}") from None
                good_end += len(raw)
                yield rec
        if good_end != self.journal.stat().st_size:
            log.warning("journal %s: dropping a torn last line (%d bytes)", self.journal,
                        self.journal.stat().st_size - good_end)
            with self.journal.open("r+b") as f:
                f.truncate(good_end)
                os.fsync(f.fileno())

    def replay(self) -> Iterator[dict[str, Any]]:
        """Every record the journal holds (acknowledged ones included), in order."""
        yield from self._read_journal()

    # -- reading -------------------------------------------------------------------------------

    def poll(self, count: int = 16, block_ms: int | None = 1000) -> list[GroupEntry]:
        """The next entries, each durably journaled and acknowledged before it is returned.

        Order of sources: this consumer's own pending entries (after a restart under the same
        name), entries of dead consumers (on the claim timer), then new ones."""
        entries: list[GroupEntry] = []
        if not self._own_pending_done:
            entries = list(self.source.pending_mine(count))
            if len(entries) < count:
                self._own_pending_done = True
        now = self._monotonic()
        if not entries and now >= self._next_claim:
            self._next_claim = now + self.claim_every_s
            entries = list(self.source.claim_stale(self.claim_idle_ms, count))
            self.stats["claimed"] += len(entries)
        if not entries:
            entries = list(self.source.read(count, block_ms))
        self.stats["read"] += len(entries)
        return self._commit(entries)

    def _commit(self, entries: list[GroupEntry]) -> list[GroupEntry]:
        """Journal (fsync) what is new, then acknowledge everything: the ack comes after the write."""
        fresh: list[GroupEntry] = []
        for e in entries:
            eid = e.record["episode_id"]
            if eid in self._journaled:
                self.stats["duplicates"] += 1
                continue
            self._sink.publish(e.record)
            self._journaled.add(eid)
            fresh.append(e)
        if entries:
            self.source.ack(*[e.id for e in entries])
            self._acked += len(entries)
            self.stats["acked"] += len(entries)
            if self.trim_every and self._acked >= self.trim_every:
                self._acked = 0
                self.source.trim()
        return fresh
