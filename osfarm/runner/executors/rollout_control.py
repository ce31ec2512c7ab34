"""The trainer's hold on rollouts already running on workers: ROLL's abort and AReaL's
interruptible rollouts over the queue.

Two Redis keys per training run, written by the trainer and read by the workers between steps
(one pipelined round trip per step):

* ``osfarm:train:<run>:abort`` — a set of episode ids the trainer no longer wants (stale or
  redundant rollouts). A worker whose episode is in it stops at its next step, releases the
  desktop and ends the job as :class:`RolloutAborted` (no record); a job that reaches a worker
  after its abort (a revoke the worker never heard of) does not start.
* ``osfarm:train:<run>:route`` — a hash from policy server URL to ``{"model", "version", "held"}``:
  the adapter a rollout on that server may use now, and every model name the server serves. An
  interruptible rollout reads it before each model call and moves to the newest adapter; every
  step records the version that produced it.

No model call reaches a server while the trainer swaps its weights or adapters (a reload, an
adapter load or unload), though the workers are on other hosts:

* ``osfarm:train:<run>:swapping`` — a hash from server URL to the deadline of its mark (Redis's
  own clock, seconds): the trainer marks a server for as long as a swap runs and renews the mark;
  a trainer that dies mid-swap leaves a mark that lapses within :data:`MARK_TTL_S`.
* ``osfarm:train:<run>:calls:<url>`` — a sorted set of the episodes with a model call in flight to
  that server (score: when the entry lapses; the worker renews it while the call runs, so a worker
  that dies mid-call holds a swap for :data:`CALL_LEASE_S` at most).

A worker's step is one script (:func:`RolloutControl.enter`): it reads the abort flag, the routes
and the marks, and unless the server is marked adds the episode to the server's calls, all at once.
The trainer marks, then waits for the server's calls to drain (:func:`mark_swapping`, one script
too), so every call either entered before the mark (and the swap waits for it) or sees the mark
(and waits, or goes to another server that serves the adapter it needs).

The keys expire a day after their last write: a crashed trainer leaves nothing behind for ever.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from osfarm.agents import Agent
from osfarm.agents.chat_client import ChatClient
from osfarm.errors import OsfarmError
from osfarm.http.retry import backoff_s
from osfarm.schema.actions import AgentAction

KEY_TTL_S = 24 * 3600
MARK_TTL_S = 15.0  # a swap mark lapses this long after the trainer's last renewal (it renews every third of it)
CALL_LEASE_S = 10.0  # a call's entry lapses this long after its last renewal (the worker renews it every third)

# A worker's step: abort flag, routes, marks; enter the server's calls unless it is marked (or aborted).
_ENTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local aborted = redis.call('SISMEMBER', KEYS[1], ARGV[1])
local routes = redis.call('HGETALL', KEYS[2])
local marks = redis.call('HGETALL', KEYS[3])
local mark = tonumber(redis.call('HGET', KEYS[3], ARGV[2]) or '')
local entered = 0
if aborted == 0 and (not mark or mark <= now) then
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[1])
  redis.call('EXPIRE', KEYS[4], tonumber(ARGV[4]))
  entered = 1
end
return {aborted, routes, marks, tostring(now), entered}
"""
# A call still in flight: its entry lives on (only if it is there: a renewal never enters a call).
_RENEW = """
local t = redis.call('TIME')
return redis.call('ZADD', KEYS[1], 'XX', tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2]), ARGV[1])
"""
# The trainer's mark (set or renewed): returns the calls still in flight to the server.
_MARK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('HSET', KEYS[1], ARGV[1], tostring(now + tonumber(ARGV[2])))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
return redis.call('ZCARD', KEYS[2])
"""


class RolloutAborted(OsfarmError):
    """The trainer aborted this rollout (ROLL: stale or redundant); the job ends without a record.
    The trainer tells it from a failure by this name (Celery carries the exception's type name)."""


def abort_key(run_id: str) -> str:
    return f"osfarm:train:{run_id}:abort"


def route_key(run_id: str) -> str:
    return f"osfarm:train:{run_id}:route"


def swapping_key(run_id: str) -> str:
    return f"osfarm:train:{run_id}:swapping"


def calls_key(run_id: str, url: str) -> str:
    return f"osfarm:train:{run_id}:calls:{url}"


@dataclass(frozen=True)
class Route:
    """A server's entry in the route hash: the adapter to use now and every name it serves."""

    model: str
    version: int | None
    held: tuple[str, ...]

    @classmethod
    def parse(cls, raw: str | bytes | None) -> Route | None:
        """None for a missing or malformed entry (the worker then keeps what it has)."""
        if not raw:
            return None
        try:
            d = json.loads(raw)
            model = str(d["model"])
            return cls(model, None if d.get("version") is None else int(d["version"]),
                       tuple(str(m) for m in d.get("held") or [model]))
        except (ValueError, KeyError, TypeError):
            return None


def publish_abort(r: redis.Redis, run_id: str, episode_ids: Iterable[str]) -> int:
    """Mark ``episode_ids`` aborted (blocking: run in a thread); returns how many were marked."""
    ids = list(episode_ids)
    if ids:
        pipe = r.pipeline(transaction=True)
        pipe.sadd(abort_key(run_id), *ids)
        pipe.expire(abort_key(run_id), KEY_TTL_S)
        pipe.execute()
    return len(ids)


def _entries(routes: Mapping[str, tuple[str, int | None]],
             held: Mapping[str, Sequence[str]] | None) -> dict[str, str]:
    return {url: json.dumps({"model": m, "version": v, "held": list((held or {}).get(url) or [m])})
            for url, (m, v) in routes.items()}


def publish_routes(r: redis.Redis, run_id: str, routes: Mapping[str, tuple[str, int | None]],
                   held: Mapping[str, Sequence[str]] | None = None) -> None:
    """The adapter each policy server's rollouts may use now and, in ``held``, every model name each
    serves (default: that one) (blocking: run in a thread)."""
    if not routes:
        return
    pipe = r.pipeline(transaction=True)
    pipe.hset(route_key(run_id), mapping=_entries(routes, held))  # type: ignore[arg-type]
    pipe.expire(route_key(run_id), KEY_TTL_S)
    pipe.execute()


def mark_swapping(r: redis.Redis, run_id: str, url: str, ttl_s: float = MARK_TTL_S) -> int:
    """Mark ``url`` swapping for ``ttl_s`` from now (set or renew); returns the model calls still
    in flight to it (blocking: run in a thread)."""
    return int(r.eval(_MARK, 2, swapping_key(run_id), calls_key(run_id, url), url, ttl_s, KEY_TTL_S))


def clear_swapping(r: redis.Redis, run_id: str, url: str, route: tuple[str, int | None],
                   held: Sequence[str]) -> None:
    """The swap of ``url`` is over: its new route and the names it serves, and the mark gone, at
    once (a worker that waited sees both) (blocking: run in a thread)."""
    pipe = r.pipeline(transaction=True)
    pipe.hset(route_key(run_id), mapping=_entries({url: route}, {url: held}))  # type: ignore[arg-type]
    pipe.expire(route_key(run_id), KEY_TTL_S)
    pipe.hdel(swapping_key(run_id), url)
    pipe.execute()


def tag_version(agent: Agent, version: int | None, versions: list[int | None]) -> None:
    """After a model call: a call whose answer named no version (vLLM's) gets ``version``, the
    version of the adapter asked; the step's version is appended to ``versions``."""
    call = agent.last_model_call
    if call is not None:
        if call.policy_version is None and version is not None:
            call.policy_version = version
        versions.append(call.policy_version)


@dataclass(frozen=True)
class Step:
    """What a worker's step read: its abort flag, every server's route, the servers marked
    swapping now, and whether its call entered the server it asked for."""

    aborted: bool
    routes: dict[str, Route]
    swapping: frozenset[str]
    entered: bool


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _deadline(raw: str) -> float:
    """A mark's deadline; a malformed one holds nobody (as the script takes it)."""
    try:
        return float(raw)
    except ValueError:
        return 0.0


class RolloutControl:
    """A worker's view of its rollout's keys."""

    def __init__(self, r: redis.Redis, run_id: str, episode_id: str, server_url: str | None):
        self.r, self.run_id, self.episode_id, self.server_url = r, run_id, episode_id, server_url

    def poll(self) -> tuple[bool, tuple[str, int | None] | None]:
        """(aborted?, the route published for this rollout's server or None) — blocking."""
        pipe = self.r.pipeline(transaction=False)
        pipe.sismember(abort_key(self.run_id), self.episode_id)
        pipe.hget(route_key(self.run_id), self.server_url or "")
        aborted, raw = pipe.execute()
        route = Route.parse(raw)  # a malformed entry: keep the adapter the job named
        return bool(aborted), None if route is None else (route.model, route.version)

    def enter(self, url: str, lease_s: float = CALL_LEASE_S) -> Step:
        """Before a model call to ``url``: one script reads the flag, routes and marks and, unless
        the server is marked swapping (or the rollout aborted), enters the call in the server's
        calls in flight (:meth:`leave` after it) — blocking."""
        aborted, routes, marks, now, entered = self.r.eval(
            _ENTER, 4, abort_key(self.run_id), route_key(self.run_id), swapping_key(self.run_id),
            calls_key(self.run_id, url), self.episode_id, url, lease_s, KEY_TTL_S)
        flat = [_text(x) for x in routes]
        parsed = {flat[i]: Route.parse(flat[i + 1]) for i in range(0, len(flat), 2)}
        m = [_text(x) for x in marks]
        swapping = frozenset(m[i] for i in range(0, len(m), 2) if _deadline(m[i + 1]) > float(_text(now)))
        return Step(bool(aborted), {u: rt for u, rt in parsed.items() if rt is not None}, swapping, bool(entered))

    def renew(self, url: str, lease_s: float = CALL_LEASE_S) -> None:
        """The call to ``url`` is still running: its entry lives ``lease_s`` more (blocking)."""
        self.r.eval(_RENEW, 1, calls_key(self.run_id, url), self.episode_id, lease_s)

    def leave(self, url: str) -> None:
        """The call to ``url`` came back (blocking; an entry left behind lapses on its own)."""
        try:
            self.r.zrem(calls_key(self.run_id, url), self.episode_id)
        except redis.RedisError:
            pass


class ControlledAgent:
    """The job's agent, checking its rollout's keys before each model call: aborted, it calls
    ``on_abort`` (which cancels the episode: the desktop is released on the way out); interruptible,
    it asks for the newest adapter; its server swapping, it waits (backing off) for the swap to end
    or its mark to lapse, or moves to a server not swapping that serves what it needs (the adapter
    it keeps, or for an interruptible rollout one at least as new). Each model call without a
    version of its own (vLLM's) is tagged with the version of the adapter that answered it."""

    def __init__(self, agent: Agent, control: RolloutControl, *, model: str, version: int | None,
                 interruptible: bool):
        self.agent, self.control, self.interruptible = agent, control, interruptible
        self.model, self.version = model, version
        self.server_url = control.server_url or ""
        self.aborted = False
        self.on_abort: Callable[[], Any] | None = None
        self.step_versions: list[int | None] = []
        self.swap_waits = 0  # polls that found every usable server swapping
        self.moved = 0  # calls sent to another server than the job's because its own was swapping

    def __getattr__(self, name: str) -> Any:  # name, wants_a11y, settle_s, last_model_call, ...
        return getattr(self.agent, name)

    def reset(self, task: Any = None) -> None:
        self.agent.reset(task)

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        return self.agent.predict(instruction, obs)

    async def apredict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        url = await self._enter()
        renewing = asyncio.create_task(self._renew(url)) if url is not None else None
        try:
            out = await self.agent.apredict(instruction, obs)
        finally:
            if renewing is not None:
                renewing.cancel()
                await asyncio.gather(renewing, return_exceptions=True)
            if url is not None:
                await asyncio.to_thread(self.control.leave, url)
        tag_version(self.agent, self.version, self.step_versions)
        return out

    async def _enter(self) -> str | None:
        """Wait until the call may go, and to which server (None: Redis is out, the call goes as
        the job said, unrecorded)."""
        attempt = 0
        while True:
            try:
                step = await asyncio.to_thread(self.control.enter, self.server_url)
            except redis.RedisError:  # Redis out for longer than the client's retries: go on as the job said
                return None
            if step.aborted:
                await self._abort()
            if step.entered:
                self._follow(step.routes.get(self.server_url))
                return self.server_url
            for url in self._others(step):
                try:
                    alt = await asyncio.to_thread(self.control.enter, url)
                except redis.RedisError:
                    return None
                if alt.entered:
                    self._point(url)
                    self.moved += 1
                    self._follow(alt.routes.get(url))
                    return url
            attempt += 1
            self.swap_waits += 1
            await asyncio.sleep(backoff_s(attempt, base_s=0.05, cap_s=MARK_TTL_S / 15))

    async def _renew(self, url: str) -> None:
        while True:
            await asyncio.sleep(CALL_LEASE_S / 3)
            try:
                await asyncio.to_thread(self.control.renew, url)
            except redis.RedisError:  # the next renewal tries again; a lapsed entry only lets a swap start early
                pass

    async def _abort(self) -> None:
        self.aborted = True
        if self.on_abort is None:
            raise RolloutAborted(f"episode {self.control.episode_id}: aborted by the trainer")
        self.on_abort()
        await asyncio.Future()  # the cancellation on_abort sent ends the episode here

    def _others(self, step: Step) -> list[str]:
        """Servers not swapping that serve what this rollout needs: the adapter it keeps, or (an
        interruptible one) an adapter at least as new as its own; the job's own server first."""
        def usable(route: Route) -> bool:
            if not self.interruptible:
                return self.model in route.held
            return self.version is None or (route.version is not None and route.version >= self.version)

        return [u for u, rt in step.routes.items() if u != self.server_url and u not in step.swapping and usable(rt)
                and getattr(getattr(self.agent, "client", None), "url", None) is not None]

    def _follow(self, route: Route | None) -> None:
        """Interruptible: the newest adapter of the server the call goes to."""
        if not self.interruptible or route is None:
            return
        client = getattr(self.agent, "client", None)
        if route.model != self.model and client is not None and hasattr(client, "model"):
            client.model = route.model
        self.model, self.version = route.model, route.version

    def _point(self, url: str) -> None:
        """Send the calls to ``url`` from now on (the chat route under it, as the client builds one)."""
        client = getattr(self.agent, "client", None)
        if client is not None:
            client.url = ChatClient(url, self.model).url
        self.server_url = url

    async def aclose(self) -> None:
        await self.agent.aclose()
