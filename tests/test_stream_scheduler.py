"""Rollout-wise scheduling vs synchronous batches (RolloutScheduler), and utilisation arithmetic."""

from __future__ import annotations

import asyncio

import pytest

from osfarm.runner.scheduler import RolloutScheduler, utilisation


class Controlled:
    """Items finish only when the test says so; records what started."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.gates: dict[int, asyncio.Event] = {}

    def gate(self, i: int) -> asyncio.Event:
        return self.gates.setdefault(i, asyncio.Event())

    async def run(self, i: int) -> int:
        self.started.append(i)
        await self.gate(i).wait()
        if i == 99:
            raise ValueError("boom")
        return i * 10


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_rollout_wise_starts_the_next_episode_when_any_finishes() -> None:
    c = Controlled()
    s: RolloutScheduler[int, int] = RolloutScheduler(c.run, 2)
    for i in range(4):
        s.submit(i)
    await settle()
    assert c.started == [0, 1] and s.in_flight == 2
    c.gate(1).set()  # the second one finishes first; 0 is still running
    await settle()
    assert c.started == [0, 1, 2]  # no barrier: 2 started next to the long 0
    for i in (2, 3, 0):
        c.gate(i).set()
    s.close()
    done = [d async for d in s.results()]
    assert [d.item for d in done] == [1, 2, 3, 0] and [d.result for d in done] == [10, 20, 30, 0]
    assert all(d.error is None and d.finished >= d.started for d in done)


async def test_sync_batches_keep_the_barrier() -> None:
    c = Controlled()
    s: RolloutScheduler[int, int] = RolloutScheduler(c.run, 2, sync_batches=True)
    for i in range(3):
        s.submit(i)
    s.close()
    await settle()
    assert c.started == [0, 1]
    c.gate(1).set()
    await settle()
    assert c.started == [0, 1]  # 2 waits for the whole batch
    c.gate(0).set()
    await settle()
    assert c.started == [0, 1, 2]
    c.gate(2).set()
    assert sorted([d.item async for d in s.results()]) == [0, 1, 2]


async def test_items_can_be_fed_while_results_stream_and_errors_are_handed_over() -> None:
    c = Controlled()
    s: RolloutScheduler[int, int] = RolloutScheduler(c.run, 3)
    s.submit(99)
    c.gate(99).set()
    it = s.results()
    first = await it.__anext__()
    assert first.item == 99 and isinstance(first.error, ValueError) and first.result is None
    s.submit(5)  # a trainer tops up after seeing a result
    c.gate(5).set()
    second = await it.__anext__()
    assert second.result == 50
    s.close()
    assert [d async for d in it] == []
    with pytest.raises(RuntimeError, match="after close"):
        s.submit(1)
    with pytest.raises(ValueError, match="at least 1"):
        RolloutScheduler(c.run, 0)


def test_utilisation_is_busy_slot_seconds_over_available() -> None:
    # 2 slots for 10 s: one busy 0-10, the other 0-5 -> 15 / 20
    assert utilisation([(0, 10), (0, 5)], slots=2, start=0, end=10) == pytest.approx(0.75)
    assert utilisation([], slots=2, start=0, end=0) == 0.0
    # spans are clipped to the window: (8, 14) counts 2 s of [0, 10]; (-3, 1) counts 1 s
    assert utilisation([(8, 14), (-3, 1)], slots=1, start=0, end=10) == pytest.approx(0.3)
