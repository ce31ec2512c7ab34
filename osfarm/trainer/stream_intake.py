"""Feeding the data manager from record streams without blocking the trainer's event loop.

Records arrive from blocking sources (a followed JSONL file, a Redis Stream); each read runs in
a worker thread so rollouts and learning keep going meanwhile. A Redis Stream is read through a
journal (:class:`osfarm.stream.consumer.StreamConsumer`), so that a trainer killed at any moment
loses no episode and takes none twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

from osfarm.stream.consumer import CLAIM_IDLE_MS, GroupSource, StreamConsumer

# where consume_redis journals records before acknowledging them (in the blob root by default)
STREAM_JOURNAL = "stream-journal.jsonl"

AddedFn = Callable[[dict[str, Any], str], None]  # (record, outcome)


class Intake(Protocol):
    """What the stream readers feed (the data manager)."""

    blob_root: str | None
    seen: set[str]

    def add(self, record: dict[str, Any], blob_root: Path | str | None = None) -> str: ...


T = TypeVar("T")


def _next_of(it: Iterator[T]) -> tuple[T] | None:
    """The next item of ``it`` in a 1-tuple, or None when it is exhausted (an item may be None)."""
    for item in it:
        return (item,)
    return None


async def iterate_in_thread(it: Iterator[T]) -> AsyncIterator[T]:
    """An async iterator over a blocking one (e.g. :func:`osfarm.stream.jsonl.follow_jsonl`):
    each ``next`` runs in a worker thread so the event loop keeps going."""
    while True:
        got = await asyncio.to_thread(_next_of, it)
        if got is None:
            return
        yield got[0]


async def consume_records(intake: Intake, records: AsyncIterable[dict[str, Any]] | Iterable[dict[str, Any]],
                          blob_root: Path | None = None, on_added: AddedFn | None = None) -> int:
    """:meth:`osfarm.trainer.data_manager.DataManager.consume`."""
    n = 0
    items = records if isinstance(records, AsyncIterable) else iterate_in_thread(iter(records))
    async for rec in items:
        n += 1
        out = intake.add(rec, blob_root)
        if on_added:
            on_added(rec, out)
    return n


async def consume_redis(intake: Intake, source: GroupSource, blob_root: Path | None = None, *,
                        journal: Path | None = None, stop: Callable[[], bool] | None = None,
                        on_added: AddedFn | None = None, block_ms: int = 1000,
                        claim_idle_ms: int = CLAIM_IDLE_MS,
                        blob_root_of: Callable[[dict[str, Any]], Path] | None = None) -> int:
    """:meth:`osfarm.trainer.data_manager.DataManager.consume_redis`; ``blob_root_of``: each
    record's own blob root (workers that keep each run's blobs in a dir of its own) instead of
    ``blob_root``."""
    root = Path(blob_root) if blob_root else (Path(intake.blob_root) if intake.blob_root else None)
    if journal is None and root is None:
        raise ValueError("consume_redis needs a journal path (or a blob_root to keep it in)")
    consumer = StreamConsumer(source, journal or Path(root or ".") / STREAM_JOURNAL, claim_idle_ms=claim_idle_ms)
    n = 0

    def take(record: dict[str, Any]) -> None:
        nonlocal n
        out = intake.add(record, blob_root_of(record) if blob_root_of is not None else blob_root)
        n += 1
        if on_added:
            on_added(record, out)

    for rec in await asyncio.to_thread(lambda: list(consumer.replay())):
        if rec["episode_id"] not in intake.seen:
            take(rec)
    while stop is None or not stop():
        for e in await asyncio.to_thread(consumer.poll, 16, block_ms):
            take(e.record)
    return n
