"""Rollout-wise scheduling: up to N episodes in flight, the next starts the moment any finishes.

``RolloutScheduler`` is an async producer fed continuously: ``submit`` items at any time (an
evaluation submits a whole suite, a trainer keeps topping up), iterate ``results()`` in
completion order, ``close()`` when nothing more will come. With ``sync_batches=True`` it keeps
the barrier of batch rollouts (a batch of N starts only when the previous batch has entirely
finished), for comparison (DART's environment utilisation figure, bench/env_utilization.py).

Every item's start and end (monotonic seconds) are kept, so utilisation can be computed from
them: :func:`utilisation` is that arithmetic.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Done(Generic[T, R]):
    item: T
    result: R | None
    error: BaseException | None
    started: float  # time.monotonic()
    finished: float
    slot: int  # which of the N slots ran it (0..N-1)


class _Closed:
    """The end marker of the scheduler's queues (no more items; no more results)."""


_CLOSED = _Closed()


class RolloutScheduler(Generic[T, R]):
    def __init__(self, run_one: Callable[[T], Awaitable[R]], max_concurrent: int, *, sync_batches: bool = False):
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
        self.run_one = run_one
        self.max_concurrent = max_concurrent
        self.sync_batches = sync_batches
        self._todo: asyncio.Queue[T | _Closed] = asyncio.Queue()
        self._done: asyncio.Queue[Done[T, R] | _Closed] = asyncio.Queue()
        self._closed = False
        self._runner: asyncio.Task[None] | None = None
        self.in_flight = 0
        self.submitted = 0

    def submit(self, item: T) -> None:
        if self._closed:
            raise RuntimeError("submit() after close()")
        self.submitted += 1
        self._todo.put_nowait(item)
        self._ensure_started()

    def close(self) -> None:
        """No more items: ``results()`` ends once everything submitted has finished."""
        if not self._closed:
            self._closed = True
            self._todo.put_nowait(_CLOSED)
            self._ensure_started()

    def _ensure_started(self) -> None:
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run())

    async def _one(self, item: T, slot: int) -> Done[T, R]:
        self.in_flight += 1
        t0 = time.monotonic()
        try:
            res: R | None = await self.run_one(item)
            err: BaseException | None = None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which decides
            res, err = None, e
        finally:
            self.in_flight -= 1
        return Done(item, res, err, t0, time.monotonic(), slot)

    async def _slot(self, slot: int) -> None:
        while True:
            item = await self._todo.get()
            if isinstance(item, _Closed):
                self._todo.put_nowait(_CLOSED)  # let the other slots see it too
                return
            self._done.put_nowait(await self._one(item, slot))

    async def _batches(self) -> None:
        ended = False
        while not ended:
            batch: list[T] = []
            while len(batch) < self.max_concurrent:
                # wait for the first item; take more only while they are already queued or the
                # batch is not full yet (a streaming producer fills it)
                item = await self._todo.get()
                if isinstance(item, _Closed):
                    ended = True
                    break
                batch.append(item)
            if batch:
                for d in await asyncio.gather(*(self._one(x, i) for i, x in enumerate(batch))):
                    self._done.put_nowait(d)

    async def _run(self) -> None:
        try:
            if self.sync_batches:
                await self._batches()
            else:
                await asyncio.gather(*(self._slot(i) for i in range(self.max_concurrent)))
        finally:
            self._done.put_nowait(_CLOSED)

    async def results(self) -> AsyncIterator[Done[T, R]]:
        """Finished items in completion order; ends after ``close()`` once all have finished."""
        self._ensure_started()
        while True:
            d = await self._done.get()
            if isinstance(d, _Closed):
                failed = self._runner.exception() if self._runner is not None and self._runner.done() else None
                if failed is not None:
                    raise failed
                return
            yield d

    async def aclose(self) -> None:
        if self._runner is not None and not self._runner.done():
            self._runner.cancel()
            try:
                await self._runner
            except asyncio.CancelledError:
                pass


def utilisation(spans: Sequence[tuple[float, float]], slots: int, start: float, end: float) -> float:
    """Busy slot-seconds over available slot-seconds in the window [start, end]: each busy span
    is clipped to the window, then sum(b_i - a_i) / (slots * (end - start))."""
    wall = end - start
    if wall <= 0 or slots <= 0:
        return 0.0
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans) / (slots * wall)
