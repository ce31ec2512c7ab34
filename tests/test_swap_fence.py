"""No model call reaches a policy server mid-swap over the queue (issue 29, item 3): a real
redis-server, a real ``osfarm worker`` process on the session farm, and a vLLM-like policy endpoint
(a real HTTP server on loopback) that logs every chat call, adapter load and unload, and whether a
swap was under way when a call arrived. The trainer's side is the real QueuedRollouts and
WeightSync, attached as ``osfarm train --executor celery`` attaches them.

* a swap waits for the call in flight, a worker's next call waits for the swap's end and then
  asks the new adapter (interruptible);
* the adapter a running non-interruptible rollout keeps is not unloaded by a sync and a prune,
  and is unloaded once its job's record comes; a mark left by a trainer that died mid-swap
  (past its deadline) does not hold the worker;
* ``max_adapters``: a load past it evicts the oldest adapter some job keeps and aborts that job.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
from PIL import Image
from test_celery import SUITE, TIME_LIMIT_S, Workers

from osfarm.farm.server import FarmServer
from osfarm.policy.client import PolicyServer
from osfarm.runner.executors.rollout_control import abort_key, swapping_key
from osfarm.testing.redis_server import RedisServer
from osfarm.trainer.data_manager import DataConfig, DataManager
from osfarm.trainer.queued_rollouts import QueuedRollouts, rollout_episode_id
from osfarm.trainer.weight_sync import WeightSync

pytestmark = pytest.mark.timeout(300)

LOAD_S = 1.5  # an adapter load takes this long: long enough for a worker's next step to come during it


class SwapServer:
    """vLLM serving LoRA adapters, as the trainer and the workers see it: ``/health``,
    ``/v1/models``, ``/v1/load_lora_adapter`` (slow), ``/v1/unload_lora_adapter`` and chat
    completions (always WAIT, no version; 404 for an adapter it does not hold). ``events`` is the
    log: ("call", model, swapping?), ("load", name), ("loaded", name), ("unload", name). Chat call
    number ``hold_at`` waits until ``go_on``."""

    def __init__(self, load_s: float = LOAD_S) -> None:
        self.load_s = load_s
        self.events: list[tuple[Any, ...]] = []
        self.adapters: dict[str, str] = {}
        self.swaps = 0  # loads and unloads under way
        self.lock = threading.Lock()
        self.hold_at = 0
        self.held, self.go_on = threading.Event(), threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, {})
                else:
                    self._send(200, {"data": [{"id": "policy"}] + [{"id": n, "parent": "policy", "root": p}
                                                                     for n, p in outer.adapters.items()]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.endswith("/load_lora_adapter"):
                    outer._swap("load", body["lora_name"], body["lora_path"])
                    return self._send(200, {})
                if self.path.endswith("/unload_lora_adapter"):
                    outer._swap("unload", body["lora_name"], None)
                    return self._send(200, {})
                with outer.lock:
                    outer.events.append(("call", body["model"], outer.swaps > 0))
                    n = sum(1 for e in outer.events if e[0] == "call")
                if n == outer.hold_at:
                    outer.held.set()
                    outer.go_on.wait(60)
                if body["model"] != "policy" and body["model"] not in outer.adapters:
                    return self._send(404, {"error": f"no adapter {body['model']}"})
                self._send(200, {"choices": [{"message": {"role": "assistant", "content": "WAIT"},
                                              "finish_reason": "stop"}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def _swap(self, what: str, name: str, path: str | None) -> None:
        with self.lock:
            self.swaps += 1
            self.events.append((what, name))
        if what == "load":
            time.sleep(self.load_s)
            self.adapters[name] = str(path)
            self.events.append(("loaded", name))
        else:
            self.adapters.pop(name, None)
        with self.lock:
            self.swaps -= 1

    def hold(self, at: int) -> None:
        """Hold the ``at``-th chat call from now on."""
        self.hold_at = sum(1 for e in self.events if e[0] == "call") + at
        self.held.clear()
        self.go_on.clear()

    def calls(self) -> list[tuple[Any, ...]]:
        return [e for e in self.events if e[0] == "call"]

    def close(self) -> None:
        self.go_on.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def worker(farm: FarmServer, broker: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    w = Workers(farm, broker, "test:swap", tmp_path_factory.mktemp("swap-workers"))
    w.start("w1")
    try:
        yield w
    finally:
        w.stop_all()


@pytest.fixture
def policy() -> Iterator[SwapServer]:
    s = SwapServer()
    try:
        yield s
    finally:
        s.close()


def checkpoint(tmp_path: Path, version: int) -> Path:
    """What the sync reads of a vllm_lora checkpoint: its adapter/ dir (the fake server loads nothing)."""
    (tmp_path / f"v{version}" / "adapter").mkdir(parents=True)
    return tmp_path / f"v{version}"


def on_v1(policy: SwapServer, tmp_path: Path, run: str, stream: str, broker: RedisServer,
          **kw: Any) -> tuple[QueuedRollouts[str], WeightSync]:
    """A trainer's queue and weight sync, attached, with the server holding policy-v1 (version 1)."""
    q: QueuedRollouts[str] = QueuedRollouts(broker.url, stream, run, time_limit_s=TIME_LIMIT_S, poll_s=0.2)
    sync = WeightSync([PolicyServer(url=policy.url, kind="vllm_lora", lora_name="policy", timeout_s=30)], **kw)
    asyncio.run(sync.sync(checkpoint(tmp_path, 1), 1))
    q.attach(sync)
    return q, sync


def job(policy: SwapServer, tmp_path: Path, steps: int, interruptible: bool) -> dict[str, Any]:
    return {"suite": str(SUITE), "index": None, "agent": "vlm",
            "agent_options": {"base_url": policy.url, "model": "policy-v1", "temperature": 0.0, "timeout_s": 60},
            "episode": {"max_steps": steps, "time_limit_s": TIME_LIMIT_S, "infra_retries": 0},
            "out": str(tmp_path / "run"), "cache": None, "offline": True, "policy_version": 1,
            "interruptible": interruptible}


def a_task() -> str:
    return json.loads(next((SUITE / "os").glob("*.json")).read_text())["id"]


async def ended(q: QueuedRollouts[str], eid: str) -> tuple[str, Any]:
    tid = q.jobs[eid].task_id
    for _ in range(600):
        ((state, result),) = await asyncio.to_thread(q.states, [tid])
        if state in ("SUCCESS", "FAILURE", "REVOKED"):
            return state, result
        await asyncio.sleep(0.2)
    raise AssertionError(f"job {eid} did not end")


def test_a_worker_waits_out_a_swap_then_asks_the_new_adapter(worker: Workers, broker: RedisServer,
                                                              policy: SwapServer, tmp_path: Path) -> None:
    """The swap starts while the worker's second call is in flight: the load waits for it; the
    worker's third call comes while the load runs and waits for its end (on the trainer's side
    nothing gates it: only the mark in Redis does), then asks the new adapter."""
    q, sync = on_v1(policy, tmp_path, "run-wait", worker.stream, broker)
    task_id = a_task()
    eid = rollout_episode_id("run-wait", task_id, 1)

    async def scenario() -> tuple[str, Any, list[bool]]:
        await q.publish_routes(q.routes() if q.routes else {})
        policy.hold(2)
        await q.submit("moved", task_id, 1, job(policy, tmp_path, 3, interruptible=True))
        assert await asyncio.to_thread(policy.held.wait, 120), "the worker's second call never came"
        swap = asyncio.create_task(sync.sync(checkpoint(tmp_path, 2), 2))
        await asyncio.sleep(0.5)
        loading_early = ("load", "policy-v2") in policy.events  # before the call in flight came back
        policy.go_on.set()
        results = await swap
        state, result = await ended(q, eid)
        return state, result, [loading_early, *(r.ok for r in results)]

    try:
        state, result, (loading_early, synced) = asyncio.run(scenario())
    finally:
        q.executor.close()
    assert state == "SUCCESS", result
    assert synced and not loading_early
    calls = policy.calls()
    assert [c[1] for c in calls] == ["policy-v1", "policy-v1", "policy-v2"]
    assert not any(during for _c, _m, during in calls), policy.events  # none came while the server swapped
    load = policy.events.index(("load", "policy-v2"))
    assert policy.events.index(calls[1]) < load < policy.events.index(("loaded", "policy-v2")) < \
        policy.events.index(calls[2])
    assert [s["model"]["policy_version"] for s in result["record"]["steps"]] == [1, 1, 2]
    assert not redis.Redis.from_url(broker.url).hgetall(swapping_key("run-wait"))  # the mark is lifted


def test_a_sync_keeps_the_adapter_a_running_rollout_needs(worker: Workers, broker: RedisServer,
                                                          policy: SwapServer, tmp_path: Path) -> None:
    """A non-interruptible rollout on policy-v1 runs while version 2 is synced and the trainer
    prunes (as after every update: no in-process episodes over the queue): policy-v1 stays loaded
    until the rollout's record comes, then it goes; every step asked policy-v1. A mark past its
    deadline (a trainer that died mid-swap) does not hold the worker."""
    q, sync = on_v1(policy, tmp_path, "run-keep", worker.stream, broker)
    r = redis.Redis.from_url(broker.url)
    r.hset(swapping_key("run-keep"), policy.url, "1")  # a deadline long past
    task_id = a_task()
    eid = rollout_episode_id("run-keep", task_id, 1)
    reports: list[tuple[Any, Any]] = []

    async def scenario() -> tuple[str, Any, bool, list[str]]:
        dm = DataManager(DataConfig(), blob_root=tmp_path / "run")
        policy.hold(2)
        await q.submit("kept", task_id, 1, job(policy, tmp_path, 2, interruptible=False))
        assert await asyncio.to_thread(policy.held.wait, 120), "the expired mark held the worker"
        swap = asyncio.create_task(sync.sync(checkpoint(tmp_path, 2), 2))
        await asyncio.sleep(0.5)
        policy.go_on.set()  # the swap waits for this call
        assert all(res.ok for res in await swap)
        errors = await sync.prune(set())
        state, result = await ended(q, eid)
        kept = "policy-v1" in policy.adapters  # the job has not been reported yet: it still keeps it
        # its record, as the stream's intake hands it over (consume_redis's on_added): the job ends
        # and its adapter is unloaded
        rec = result["record"]
        q.take(rec, dm.add(rec, tmp_path / "run"), lambda item, _rec, outcome, _s, _d: reports.append((item, outcome)))
        for _ in range(300):
            if "policy-v1" not in policy.adapters:
                break
            await asyncio.sleep(0.1)
        return state, result, kept, errors

    try:
        state, result, kept, errors = asyncio.run(scenario())
    finally:
        q.executor.close()
    assert state == "SUCCESS", result
    assert kept and not errors
    assert [c[1] for c in policy.calls()] == ["policy-v1"] * 2
    assert [s["model"]["policy_version"] for s in result["record"]["steps"]] == [1, 1]
    assert [item for item, _o in reports] == ["kept"]
    assert ("unload", "policy-v1") in policy.events and "policy-v1" not in policy.adapters
    assert set(sync.adapters[policy.url]) == {2}


def test_max_adapters_evicts_the_oldest_kept_adapter_and_aborts_its_job(broker: RedisServer,
                                                                       tmp_path: Path) -> None:
    """Two adapters at most: loading version 3 while jobs keep versions 1 and 2 unloads policy-v1
    and aborts the job that keeps it (the controller retries it); the job on version 2 goes on."""
    url = broker.url.rsplit("/", 1)[0] + "/6"  # no worker listens on this database: the jobs stay queued
    policy = SwapServer(load_s=0.05)
    q: QueuedRollouts[str] = QueuedRollouts(url, "test:evict", "run-evict", time_limit_s=TIME_LIMIT_S)
    sync = WeightSync([PolicyServer(url=policy.url, kind="vllm_lora", lora_name="policy")], max_adapters=2)
    q.attach(sync)
    base = {"suite": str(SUITE), "index": None, "agent": "noop", "agent_options": {},
            "episode": {"max_steps": 1, "time_limit_s": TIME_LIMIT_S, "infra_retries": 0}, "out": str(tmp_path),
            "cache": None, "offline": True}

    async def scenario() -> list[bool]:
        oks = [r.ok for r in await sync.sync(checkpoint(tmp_path, 1), 1)]
        await q.submit("on-v1", "t1", 1, {**base, "policy_version": 1})
        oks += [r.ok for r in await sync.sync(checkpoint(tmp_path, 2), 2)]
        await q.submit("on-v2", "t1", 2, {**base, "policy_version": 2})
        return oks + [r.ok for r in await sync.sync(checkpoint(tmp_path, 3), 3)]

    try:
        assert all(asyncio.run(scenario()))
    finally:
        q.executor.close()
        policy.close()
    assert set(policy.adapters) == {"policy-v2", "policy-v3"}
    assert sync.evicted == q.counts.evicted == 1
    aborted = redis.Redis.from_url(url, decode_responses=True).smembers(abort_key("run-evict"))
    assert aborted == {rollout_episode_id("run-evict", "t1", 1)}


def test_a_step_moves_to_a_server_that_serves_its_adapter_or_waits_for_the_mark(broker: RedisServer) -> None:
    """The worker's agent in this process (no episode): its server marked swapping, a
    non-interruptible step goes to the other server that holds its adapter; when no server holds
    it, the step waits until the mark is lifted, then goes to its own server."""
    from osfarm.agents import make_agent
    from osfarm.runner.executors.rollout_control import (
        ControlledAgent,
        RolloutControl,
        clear_swapping,
        mark_swapping,
        publish_routes,
    )

    a, b = SwapServer(), SwapServer()
    r = redis.Redis.from_url(broker.url)
    png = io.BytesIO()
    Image.new("RGB", (64, 48)).save(png, "PNG")

    async def step(run: str, held_by_b: list[str]) -> ControlledAgent:
        publish_routes(r, run, {a.url: ("policy-v2", 2), b.url: ("policy-v2", 2)},
                       {a.url: ["policy", "policy-v1", "policy-v2"], b.url: held_by_b})
        assert mark_swapping(r, run, a.url, 30) == 0
        agent = ControlledAgent(make_agent("vlm", base_url=a.url, model="policy-v1"),
                                RolloutControl(r, run, "ep-1", a.url), model="policy-v1", version=1,
                                interruptible=False)
        lift = asyncio.get_running_loop().call_later(
            0.5, clear_swapping, r, run, a.url, ("policy-v2", 2), ["policy", "policy-v1", "policy-v2"])
        try:
            await agent.apredict("Wait.", {"screenshot": png.getvalue()})
        finally:
            lift.cancel()
            await agent.aclose()
        return agent

    a.adapters = b.adapters = {"policy-v1": "x", "policy-v2": "y"}
    try:
        moved = asyncio.run(step("run-move", ["policy", "policy-v1", "policy-v2"]))
        waited = asyncio.run(step("run-wait-mark", ["policy", "policy-v2"]))
    finally:
        a.close()
        b.close()
    assert moved.moved == 1 and moved.swap_waits == 0 and moved.server_url == b.url
    assert waited.moved == 0 and waited.swap_waits >= 1 and waited.server_url == a.url
    assert [c[1] for c in b.calls()] == ["policy-v1"] and [c[1] for c in a.calls()] == ["policy-v1"]
    assert moved.step_versions == waited.step_versions == [1]
    assert not r.zcard(f"osfarm:train:run-move:calls:{b.url}")  # the call left the server's calls


def test_a_dead_workers_call_holds_a_swap_only_until_its_lease_lapses(broker: RedisServer) -> None:
    """A worker killed mid-call never leaves nor renews its call's entry: the trainer's swap waits
    for it only until the entry lapses, not for the server's whole timeout. While the mark is up
    no step enters; once it is lifted one does, and sees the server's new route."""
    from osfarm.runner.executors.rollout_control import RolloutControl
    from osfarm.trainer.swap_fence import QueueFence

    r = redis.Redis.from_url(broker.url)
    url = "http://127.0.0.1:9"  # never dialled: only its keys are used

    async def in_thread(fn: Any) -> Any:
        return await asyncio.to_thread(fn)

    assert RolloutControl(r, "run-dead", "ep-dead", url).enter(url, lease_s=1.0).entered  # then it dies
    fence = QueueFence(r, "run-dead", in_thread)
    live = RolloutControl(r, "run-dead", "ep-live", url)

    async def swap() -> tuple[float, bool]:
        t0 = time.monotonic()
        await fence.begin(url, 30)
        took = time.monotonic() - t0
        during = live.enter(url).entered
        await fence.end(url, ("policy-v2", 2), ["policy", "policy-v2"])
        return took, during

    took, entered_during = asyncio.run(swap())
    assert 0.5 < took < 5 and fence.drain_timeouts == 0
    assert not entered_during
    after = live.enter(url)
    assert after.entered and not after.swapping and after.routes[url].model == "policy-v2"
