"""Rollout controller: planning, staleness capacity, re-queueing and resume, on a real event loop."""

from __future__ import annotations

import asyncio
import random

import pytest

from osfarm.trainer.allocation import TaskStats
from osfarm.trainer.rollout_controller import (
    ControllerConfig,
    RolloutController,
    plan_round,
)


def stats_of(**rewards: list[float]) -> dict[str, TaskStats]:
    out = {}
    for task, rs in rewards.items():
        st = TaskStats()
        for r in rs:
            st.add(r, r == 1)
        out[task] = st
    return out


class Recorder:
    """The submit callback: remembers (task, n, version) of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    async def __call__(self, task: str, n: int, version: int) -> None:
        self.calls.append((task, n, version))


def test_plan_round_dart_and_xrpo():
    stats = stats_of(b=[1, 1], c=[1, 1, 1, 1, 0])
    cfg = ControllerConfig(batch_size=4, shuffle=False)
    # a: never tried → 8; b: sr 1.0 → int(9 − 7) = 2; c: sr 0.8 → int(11.25 − 7) = 4
    assert plan_round(["a", "b", "c"], stats, cfg) == [["a", 8], ["b", 2], ["c", 4]]
    # a group-size callback (the data manager's) overrides DART's formula
    assert plan_round(["a", "b"], stats, cfg, n_for_task=lambda t: 3) == [["a", 3], ["b", 3]]
    # XRPO, budget 5, no base: A (rewards [1, 0]) 4, B ([0, 0, 0, 0]) 1 — see test_trainer_math
    xcfg = ControllerConfig(batch_size=4, allocator="xrpo", xrpo_budget=5, xrpo_base=0, shuffle=False)
    assert plan_round(["A", "B"], stats_of(A=[1, 0], B=[0, 0, 0, 0]), xcfg) == [["A", 4], ["B", 1]]
    # shuffling is seeded: the same order every time for one seed
    shuffled = ControllerConfig(batch_size=4, seed=3)
    assert plan_round(list("abcdef"), {}, shuffled) == plan_round(list("abcdef"), {}, shuffled)
    with pytest.raises(ValueError, match="allocator"):
        ControllerConfig(batch_size=4, allocator="random")


async def test_fill_stops_at_the_staleness_capacity():
    rec = Recorder()
    ctrl = RolloutController(["a"], rec, ControllerConfig(batch_size=4, eta=1, shuffle=False))
    # (η + v + 1)·B = (1 + 0 + 1)·4 = 8: the whole first round of a (8 rollouts) goes out at version 0
    assert await ctrl.fill() == 8
    assert rec.calls == [("a", 8, 0)]
    assert await ctrl.fill() == 0
    for _ in range(3):
        ctrl.on_episode("a", accepted=True)
    assert ctrl.capacity() == 0  # accepted 3 + running 5 = 8
    ctrl.set_version(1)  # (1 + 1 + 1)·4 − 8 = 4 more
    assert await ctrl.fill() == 4
    assert rec.calls[-1] == ("a", 4, 1)
    assert ctrl.submitted_by_task == {"a": 12} and ctrl.rounds == 2


async def test_fill_respects_max_concurrent():
    rec = Recorder()
    ctrl = RolloutController(["a"], rec, ControllerConfig(batch_size=4, eta=1, max_concurrent=3, shuffle=False))
    assert await ctrl.fill() == 3  # min(3 − 0, 8 − 0) = 3
    ctrl.on_episode("a", accepted=True)
    assert await ctrl.fill() == 1  # min(3 − 2, 8 − (1 + 2)) = 1
    assert rec.calls == [("a", 3, 0), ("a", 1, 0)]


async def test_rejected_rollouts_are_requeued_a_bounded_number_of_times():
    rec = Recorder()
    cfg = ControllerConfig(batch_size=2, eta=0, shuffle=False, max_requeue=2)
    ctrl = RolloutController(["a", "b"], rec, cfg, n_for_task=lambda t: 2)
    await ctrl.fill()  # capacity (0 + 0 + 1)·2 = 2: a's block of 2
    assert rec.calls == [("a", 2, 0)]
    ctrl.on_episode("a", accepted=False)  # infra error: slot back, a re-queued in front of b
    await ctrl.fill()
    assert rec.calls[-1] == ("a", 1, 0)
    ctrl.on_episode("a", accepted=False)
    await ctrl.fill()
    assert rec.calls[-1] == ("a", 1, 0)
    ctrl.on_episode("a", accepted=False)  # third rejection in a row: not re-queued, b goes next
    await ctrl.fill()
    assert rec.calls[-1] == ("b", 1, 0)
    assert ctrl.gate.state.rejected == 3


async def test_release_gives_capacity_back():
    rec = Recorder()
    ctrl = RolloutController(["a"], rec, ControllerConfig(batch_size=2, eta=0, shuffle=False))
    await ctrl.fill()
    ctrl.on_episode("a", True)
    ctrl.on_episode("a", True)
    assert ctrl.capacity() == 0
    ctrl.release(2)  # the data manager dropped the group (all successes): the learner still needs a batch
    assert ctrl.capacity() == 2 and ctrl.released == 2


async def test_state_survives_a_restart_with_areal_resume_rule(tmp_path):
    rec = Recorder()
    cfg = ControllerConfig(batch_size=4, eta=1, shuffle=False)
    ctrl = RolloutController(["a", "b"], rec, cfg, state_path=tmp_path / "ctrl.json", n_for_task=lambda t: 6)
    await ctrl.fill()  # 8 = a's 6 + 2 of b's 6; b has 4 left in the queue
    for _ in range(8):
        ctrl.on_episode("a", True)
    ctrl.set_version(1)  # saves
    await ctrl.fill()  # 4 more: the rest of b
    for _ in range(4):
        ctrl.on_episode("b", True)
    ctrl.set_version(2)
    await ctrl.fill()  # (1 + 2 + 1)·4 − 12 = 4 from the next round
    ctrl.save()
    assert ctrl.gate.state.accepted == 12 and ctrl.gate.state.running == 4
    ctrl2 = RolloutController(["a", "b"], Recorder(), cfg, state_path=tmp_path / "ctrl.json", n_for_task=lambda t: 6)
    assert ctrl2.load()
    # resume: accepted = version·B = 2·4 = 8 (not 12, not 0), running 0 → (1 + 2 + 1)·4 − 8 = 8
    assert (ctrl2.version, ctrl2.gate.state.accepted, ctrl2.gate.state.running) == (2, 8, 0)
    assert ctrl2.capacity() == 8
    assert [list(b) for b in ctrl2.queue] == [["a", 2], ["b", 6]]  # the unsent rest of the round
    assert ctrl2.submitted_by_task == {"a": 10, "b": 6}
    (tmp_path / "bad.json").write_text('{"schema": "x"}')
    with pytest.raises(ValueError, match="not a rollout controller state"):
        ctrl2.load(tmp_path / "bad.json")
    assert not ctrl2.load(tmp_path / "none.json")


async def _simulate(eta: int, *, batch: int = 4, envs: int = 3, updates: int = 8, reject_every: int = 5,
                    seed: int = 0, in_order: bool = False, window: int | None = None) -> dict:
    """A farm of ``envs`` environments (episodes of random length), a learner that trains on the
    oldest ``batch`` accepted episodes per update, and the controller's run loop between them.

    ``in_order``: episodes finish in the order they were submitted (each waits for the one
    before it). ``window``: the learner drops episodes older than that many versions (the data
    manager's version window) and gives their capacity back with ``release``."""
    rng = random.Random(seed)
    accepted: list[int] = []  # start versions of accepted, not yet trained episodes (FIFO)
    arrived = asyncio.Event()
    farm: set[asyncio.Task] = set()
    seen = {"running": 0, "max_running": 0, "finished": 0, "staleness": [], "dropped": 0, "over_capacity": 0}
    last_done: list[asyncio.Future | None] = [None]
    ctrl: RolloutController

    async def episode(task: str, version: int, before: asyncio.Future | None, done: asyncio.Future) -> None:
        seen["running"] += 1
        seen["max_running"] = max(seen["max_running"], seen["running"])
        await asyncio.sleep(rng.random() * 0.003)
        if before is not None:
            await before
        seen["running"] -= 1
        seen["finished"] += 1
        if seen["finished"] % reject_every == 0:
            ctrl.on_episode(task, accepted=False)
        else:
            accepted.append(version)
            ctrl.on_episode(task, accepted=True)
        done.set_result(None)
        arrived.set()

    async def submit(task: str, n: int, version: int) -> None:
        st = ctrl.gate.state  # the reservation is already counted in running
        if st.accepted + st.running > (eta + version + 1) * batch:
            seen["over_capacity"] += 1
        for _ in range(n):
            done = asyncio.get_running_loop().create_future()
            before = last_done[0] if in_order else None
            last_done[0] = done
            t = asyncio.create_task(episode(task, version, before, done))
            farm.add(t)
            t.add_done_callback(farm.discard)

    ctrl = RolloutController(["a", "b", "c"], submit, ControllerConfig(batch_size=batch, eta=eta, max_concurrent=envs,
                                                                       shuffle=False), n_for_task=lambda t: 2)
    stop = asyncio.Event()
    loop_task = asyncio.create_task(ctrl.run(stop))
    version = 0
    while version < updates:
        while True:
            if window is not None:
                fresh = [v for v in accepted if version - v <= window]
                if len(fresh) < len(accepted):
                    ctrl.release(len(accepted) - len(fresh))
                    seen["dropped"] += len(accepted) - len(fresh)
                    accepted[:] = fresh
            if len(accepted) >= batch:
                break
            arrived.clear()
            await arrived.wait()
        trained, accepted[:] = accepted[:batch], accepted[batch:]
        seen["staleness"] += [version - v for v in trained]
        await asyncio.sleep(0.002)  # the update
        version += 1
        ctrl.set_version(version)
    stop.set()
    await loop_task
    await asyncio.gather(*farm)
    return seen


@pytest.mark.parametrize("eta", [0, 1, 2])
async def test_run_loop_keeps_the_capacity_rule_and_the_farm_limit(eta):
    # episodes finish in submission order: AReaL's rule alone bounds staleness by η
    seen = await asyncio.wait_for(_simulate(eta, in_order=True), timeout=120)
    assert len(seen["staleness"]) == 8 * 4
    assert max(seen["staleness"]) <= eta
    assert seen["over_capacity"] == 0 and seen["max_running"] <= 3
    if eta == 0:
        assert set(seen["staleness"]) == {0}


@pytest.mark.parametrize("eta", [1, 2])
async def test_out_of_order_episodes_need_the_version_window(eta):
    # Episodes of random length finish out of order, so an early long one can be accepted after
    # later ones filled the batches of its versions: the capacity rule bounds how many start per
    # version, not when each finishes. The data manager's version window (= η) is the hard bound;
    # the released capacity keeps the loop going.
    seen = await asyncio.wait_for(_simulate(eta, seed=1, updates=12, window=eta), timeout=120)
    assert len(seen["staleness"]) == 12 * 4
    assert max(seen["staleness"]) <= eta
    assert seen["over_capacity"] == 0 and seen["max_running"] <= 3


async def test_run_loop_retries_a_failing_submit():
    calls: list[tuple[str, int, int]] = []
    stop = asyncio.Event()

    async def flaky(task: str, n: int, version: int) -> None:
        if not calls:
            calls.append(("fail", 0, 0))
            raise ConnectionError("broker restarting")
        calls.append((task, n, version))
        stop.set()

    ctrl = RolloutController(["a"], flaky, ControllerConfig(batch_size=2, eta=0, shuffle=False, retry_s=0.01))
    await asyncio.wait_for(ctrl.run(stop), timeout=30)
    # the failed call gave its reservation back, so the retry submits the same 2 rollouts
    assert calls == [("fail", 0, 0), ("a", 2, 0)]
    assert ctrl.gate.state.running == 2 and ctrl.gate.state.submitted == 2
