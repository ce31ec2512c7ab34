"""No model call reaches a policy server mid-swap when the rollouts run on workers of other hosts.

In process, :class:`~osfarm.trainer.weight_sync.WeightSync` holds each call to a server behind its
own gate. Over the queue (``rollout.executor: celery``) the calls come from workers the trainer
cannot gate, so a swap is fenced in Redis (the keys and scripts are in
osfarm/runner/executors/rollout_control.py): :meth:`QueueFence.begin` marks the server swapping and
waits until the calls the workers already sent to it are back; from then on a worker's step sees the
mark and waits, or goes to another server that serves what it needs; :meth:`QueueFence.end` publishes
the server's new route and lifts the mark at once. The mark is renewed while the swap runs and
lapses on its own (``MARK_TTL_S``) if the trainer dies mid-swap: the fleet never stays stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis

from osfarm.http.retry import backoff_s
from osfarm.runner.executors.rollout_control import MARK_TTL_S, clear_swapping, mark_swapping

log = logging.getLogger("osfarm.trainer.swap_fence")

BrokerCall = Callable[[Callable[[], Any]], Awaitable[Any]]  # a blocking Redis call, run off the loop


class QueueFence:
    """The trainer's marks on the servers it swaps (one run's keys)."""

    def __init__(self, r: redis.Redis, run_id: str, broker_call: BrokerCall, *, mark_ttl_s: float = MARK_TTL_S):
        self.r, self.run_id, self.broker_call, self.mark_ttl_s = r, run_id, broker_call, mark_ttl_s
        self._renewing: dict[str, asyncio.Task[None]] = {}
        self.drain_timeouts = 0  # swaps that began with calls still in flight after the wait (hung or dead callers)

    async def begin(self, url: str, hold_s: float) -> None:
        """Mark ``url`` swapping, then wait (at most ``hold_s``) for the calls in flight to it."""
        try:
            in_flight = await self._mark(url)
        except redis.RedisError as e:  # Redis out: so are the workers' steps (they go on as their job said)
            log.warning("%s: could not mark the server swapping: %s", url, e)
            return
        self._renewing[url] = asyncio.create_task(self._renew(url))
        deadline = time.monotonic() + hold_s
        attempt = 0
        while in_flight:
            if time.monotonic() > deadline:  # a call that hangs does not hold the sync forever
                self.drain_timeouts += 1
                log.warning("%s: %d model call(s) still in flight after %.0f s; swapping anyway", url, in_flight,
                            hold_s)
                return
            attempt += 1
            await asyncio.sleep(backoff_s(attempt, base_s=0.02, cap_s=0.5))
            with contextlib.suppress(redis.RedisError):
                in_flight = await self._mark(url)

    async def end(self, url: str, route: tuple[str, int | None], held: Sequence[str]) -> None:
        """The swap of ``url`` is over: its new route and lift the mark (one transaction)."""
        renewing = self._renewing.pop(url, None)
        if renewing is not None:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
        try:
            await self.broker_call(functools.partial(clear_swapping, self.r, self.run_id, url, route, list(held)))
        except redis.RedisError as e:  # the mark lapses on its own
            log.warning("%s: could not lift the swap mark (%s); it lapses in %.0f s", url, e, self.mark_ttl_s)

    async def _mark(self, url: str) -> int:
        return int(await self.broker_call(functools.partial(mark_swapping, self.r, self.run_id, url,
                                                            self.mark_ttl_s)))

    async def _renew(self, url: str) -> None:
        while True:
            await asyncio.sleep(self.mark_ttl_s / 3)
            try:
                await self._mark(url)
            except redis.RedisError as e:  # Redis out: the next renewal tries again
                log.warning("%s: could not renew the swap mark: %s", url, e)
