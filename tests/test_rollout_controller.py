"""Rollout controller: group planning, staleness capacity, the per-rollout lifecycle (ROLL: retry,
redundant rollouts, aborts) and resume, on a real event loop."""

from __future__ import annotations

import asyncio
import contextlib
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
    """The callbacks: submit (task, n, version, group), plan and close."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, str]] = []
        self.planned: list[tuple[str, str, int]] = []
        self.closed: list[str] = []

    async def __call__(self, task: str, n: int, version: int, group: str) -> None:
        self.calls.append((task, n, version, group))

    def plan(self, group: str, task: str, n: int) -> None:
        self.planned.append((group, task, n))

    def close(self, group: str) -> None:
        self.closed.append(group)


def controller(tasks: list[str], rec: Recorder, **cfg) -> RolloutController:
    return RolloutController(tasks, rec, ControllerConfig(**{"shuffle": False, **cfg}), on_plan=rec.plan,
                             on_close=rec.close)


def test_plan_round_dart_fixed_and_xrpo():
    stats = stats_of(b=[1, 1], c=[1, 1, 1, 1, 0])
    cfg = ControllerConfig(batch_size=4, shuffle=False)
    # a: never tried → 8; b: sr 1.0 → int(9 − 7) = 2; c: sr 0.8 → int(11.25 − 7) = 4
    assert plan_round(["a", "b", "c"], stats, cfg) == [["a", 8], ["b", 2], ["c", 4]]
    # fixed n (BroRL's broad groups are this with hundreds)
    assert plan_round(["a", "b"], stats, ControllerConfig(batch_size=256, allocator="fixed", group_size=256,
                                                          shuffle=False)) == [["a", 256], ["b", 256]]
    # a group-size callback overrides the allocator's n
    assert plan_round(["a", "b"], stats, cfg, n_for_task=lambda t: 3) == [["a", 3], ["b", 3]]
    # XRPO, budget 6, base 2: A (rewards [1, 0]) is the uncertain one and gets the rest
    xcfg = ControllerConfig(batch_size=4, allocator="xrpo", xrpo_budget=6, xrpo_base=2, shuffle=False)
    assert plan_round(["A", "B"], stats_of(A=[1, 0], B=[0, 0, 0, 0]), xcfg) == [["A", 4], ["B", 2]]
    # shuffling is seeded: the same order every time for one seed
    shuffled = ControllerConfig(batch_size=4, seed=3)
    assert plan_round(list("abcdef"), {}, shuffled) == plan_round(list("abcdef"), {}, shuffled)
    with pytest.raises(ValueError, match="allocator"):
        ControllerConfig(batch_size=4, allocator="random")
    with pytest.raises(ValueError, match="xrpo_base"):  # a share of 1 would be a group without an advantage
        ControllerConfig(batch_size=4, allocator="xrpo", xrpo_base=1)


async def test_groups_are_planned_announced_and_closed():
    rec = Recorder()
    ctrl = controller(["a", "b"], rec, batch_size=4, eta=1, allocator="fixed", group_size=2)
    # (η + 1)·B = 8 with groups of 2 tiling a batch of 4: no slack, two rounds go out
    assert ctrl.slack() == 0 and await ctrl.fill() == 8
    assert [(t, n) for t, n, _, _ in rec.calls] == [("a", 2), ("b", 2), ("a", 2), ("b", 2)]
    assert [g for g, _, _ in rec.planned] == [g for *_, g in rec.calls]  # each submit is a planned group
    first = rec.calls[0][3]
    ctrl.on_episode(first, "accepted")
    assert rec.closed == []
    ctrl.on_episode(first, "accepted")
    assert rec.closed == [first]  # n accepted: the group is complete
    ctrl.release(2)  # the data manager dropped it (all successes): the capacity comes back
    assert ctrl.capacity() == 2 and ctrl.released == 2


async def test_redundant_rollouts_keep_the_first_that_finish():
    rec = Recorder()
    ctrl = controller(["a"], rec, batch_size=4, eta=0, allocator="fixed", group_size=4, redundancy=2)
    assert await ctrl.fill() == 4  # capacity (η + 1)·B = 4 first
    g = rec.calls[0][3]
    for _ in range(4):
        ctrl.on_episode(g, "accepted")
    assert rec.closed == [g]  # complete before its 2 redundant rollouts even started: they never will
    assert ctrl.running_of(g) == 0 and all(x.group_id != g for x in ctrl.queue)
    rec2 = Recorder()
    ctrl = controller(["a"], rec2, batch_size=8, eta=0, allocator="fixed", group_size=4, redundancy=2)
    await ctrl.fill()
    g = rec2.calls[0][3]
    assert rec2.calls[0][1] == 6  # n + redundancy started at once
    for _ in range(4):
        ctrl.on_episode(g, "accepted")
    assert rec2.closed == [g]  # the trainer now cancels the other 2; they come back aborted
    before = ctrl.gate.state.running
    ctrl.on_episode(g, "aborted")
    ctrl.on_episode(g, "aborted")
    assert ctrl.gate.state.running == before - 2 and rec2.closed == [g]


async def test_a_rejected_rollout_is_retried_within_its_group():
    rec = Recorder()
    ctrl = controller(["a"], rec, batch_size=4, eta=0, allocator="fixed", group_size=4, max_retries=1)
    await ctrl.fill()
    g = rec.calls[0][3]
    ctrl.on_episode(g, "rejected")  # infra error: one retry granted
    assert await ctrl.fill() == 1 and rec.calls[-1][3] == g
    ctrl.on_episode(g, "rejected")  # retries spent: the group shrinks to what it can still get
    assert await ctrl.fill() == 1 and rec.calls[-1][3] != g  # the freed slot goes to the next group
    for _ in range(3):
        ctrl.on_episode(g, "accepted")
    assert rec.closed == [g]  # 3 accepted, nothing left running or to start
    with pytest.raises(ValueError, match="outcome"):
        ctrl.on_episode(g, "maybe")


async def test_state_survives_a_restart_with_areal_resume_rule(tmp_path):
    rec = Recorder()
    cfg = {"batch_size": 4, "eta": 1, "allocator": "fixed", "group_size": 4}
    ctrl = controller(["a", "b"], rec, **cfg)
    await ctrl.fill()  # 8: a's and b's groups
    for _, _, _, g in rec.calls:
        for _ in range(4):
            ctrl.on_episode(g, "accepted")
    ctrl.set_version(1, consumed=4)  # the first update trained on a's group
    await ctrl.fill()  # room for one more group
    assert ctrl.gate.state.accepted == 8 and ctrl.gate.state.running == 4 and ctrl.gate.state.consumed == 4
    path = ctrl.save(tmp_path / "ctrl.json")
    ctrl2 = controller(["a", "b"], Recorder(), **cfg)
    # resume: accepted = consumed + what the data manager restored (b's group), nothing running
    assert ctrl2.load(path, pending=4)
    assert (ctrl2.version, ctrl2.gate.state.accepted, ctrl2.gate.state.running) == (1, 8, 0)
    assert ctrl2.capacity() == 4  # (η + 1)·B + consumed − accepted = 8 + 4 − 8
    assert ctrl2.group_seq == ctrl.group_seq  # new groups get new ids
    (tmp_path / "bad.json").write_text('{"schema": "x"}')
    with pytest.raises(ValueError, match="not a rollout controller state"):
        ctrl2.load(tmp_path / "bad.json")
    assert not ctrl2.load(tmp_path / "none.json")


async def _simulate(eta: int, *, batch: int = 4, envs: int = 3, updates: int = 8, reject_every: int = 5,
                    seed: int = 0, in_order: bool = False, window: int | None = None,
                    sizes: dict[str, int] | None = None) -> dict:
    """A farm of ``envs`` environments (episodes of random length), a learner that trains on whole
    closed groups until it has ``batch`` episodes per update, and the controller's run loop between
    them (the data manager's part: groups by planned id, closed when the controller says).

    ``in_order``: episodes finish in the order they were submitted. ``window``: the learner drops
    episodes older than that many versions and gives their capacity back with ``release``.
    ``sizes``: the groups' n per task (default 2 each, which tiles the batch)."""
    rng = random.Random(seed)
    members: dict[str, list[int]] = {}  # group -> start versions of its accepted episodes
    closed: list[str] = []
    arrived = asyncio.Event()
    farm: set[asyncio.Task] = set()
    seen = {"running": 0, "max_running": 0, "finished": 0, "staleness": [], "dropped": 0, "over_capacity": 0,
            "batches": []}
    last_done: list[asyncio.Future | None] = [None]
    ctrl: RolloutController
    sizes = sizes or {"a": 2, "b": 2, "c": 2}

    async def episode(group: str, version: int, before: asyncio.Future | None, done: asyncio.Future) -> None:
        seen["running"] += 1
        seen["max_running"] = max(seen["max_running"], seen["running"])
        await asyncio.sleep(rng.random() * 0.003)
        if before is not None:
            await before
        seen["running"] -= 1
        seen["finished"] += 1
        if seen["finished"] % reject_every == 0:
            ctrl.on_episode(group, "rejected")
        else:
            members.setdefault(group, []).append(version)
            ctrl.on_episode(group, "accepted")
        done.set_result(None)
        arrived.set()

    async def submit(task: str, n: int, version: int, group: str) -> None:
        st = ctrl.gate.state  # the reservation is already counted in running
        if st.accepted + st.running > (eta + 1) * batch + ctrl.slack() + st.consumed:
            seen["over_capacity"] += 1
        for _ in range(n):
            done = asyncio.get_running_loop().create_future()
            before = last_done[0] if in_order else None
            last_done[0] = done
            t = asyncio.create_task(episode(group, version, before, done))
            farm.add(t)
            t.add_done_callback(farm.discard)

    def on_close(group: str) -> None:
        closed.append(group)
        arrived.set()

    ctrl = RolloutController(list(sizes), submit, ControllerConfig(batch_size=batch, eta=eta, max_concurrent=envs,
                                                                   shuffle=False, max_retries=0),
                             n_for_task=lambda t: sizes[t], on_close=on_close)
    stop = asyncio.Event()
    loop_task = asyncio.create_task(ctrl.run(stop))
    version = 0
    while version < updates:
        taken: list[int] = []
        while True:
            if window is not None:
                for g, vs in members.items():
                    fresh = [v for v in vs if version - v <= window]
                    if len(fresh) < len(vs):
                        ctrl.release(len(vs) - len(fresh))
                        seen["dropped"] += len(vs) - len(fresh)
                        members[g] = fresh
            while closed and len(taken) < batch:
                taken += members.pop(closed.pop(0), [])
            if len(taken) >= batch or (taken and ctrl.blocked()):  # the loop's flush rule
                break
            arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), 0.05)
        seen["staleness"] += [version - v for v in taken]
        seen["batches"].append(len(taken))
        await asyncio.sleep(0.002)  # the update
        version += 1
        ctrl.set_version(version, consumed=len(taken))
    stop.set()
    await loop_task
    await asyncio.gather(*farm)
    return seen


@pytest.mark.parametrize("eta", [0, 1, 2])
async def test_run_loop_keeps_the_capacity_rule_and_the_farm_limit(eta):
    # episodes finish in submission order and groups of 2 tile a batch of 4, but a rejected
    # rollout leaves its group short and the learner may then train on less than a batch (the
    # flush rule), so a group started at v can finish at v + 1: the version window drops what
    # went stale, the capacity never exceeds AReaL's bound and the farm limit holds
    seen = await asyncio.wait_for(_simulate(eta, in_order=True, window=eta), timeout=120)
    assert len(seen["batches"]) == 8
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
    assert len(seen["batches"]) == 12
    assert max(seen["staleness"]) <= eta
    assert seen["over_capacity"] == 0 and seen["max_running"] <= 3


@pytest.mark.parametrize("eta", [0, 1])
async def test_groups_that_do_not_tile_a_batch_never_stall(eta):
    # DART's dynamic n gives groups of several sizes: 3 and 5 never add up to a batch of 4 exactly.
    # The learner takes whole groups until it has a batch; the slack (largest group − 1) keeps room
    # for the group it waits for, so every update comes.
    seen = await asyncio.wait_for(_simulate(eta, sizes={"a": 3, "b": 5}, updates=10, reject_every=10**9,
                                            window=eta), timeout=120)
    assert len(seen["batches"]) == 10 and min(seen["batches"]) >= 4
    assert max(seen["staleness"]) <= eta


async def test_run_loop_retries_a_failing_submit():
    calls: list[tuple[str, int, int]] = []
    stop = asyncio.Event()

    async def flaky(task: str, n: int, version: int, group: str) -> None:
        if not calls:
            calls.append(("fail", 0, 0))
            raise ConnectionError("broker restarting")
        calls.append((task, n, version))
        stop.set()

    ctrl = RolloutController(["a"], flaky, ControllerConfig(batch_size=2, eta=0, shuffle=False, retry_s=0.01,
                                                            allocator="fixed", group_size=2))
    await asyncio.wait_for(ctrl.run(stop), timeout=30)
    # the failed call gave its reservation back, so the retry submits the same 2 rollouts
    assert calls == [("fail", 0, 0), ("a", 2, 0)]
    assert ctrl.gate.state.running == 2 and ctrl.gate.state.submitted == 2
