"""The trainer's hold on rollouts already running on workers: ROLL's abort and AReaL's
interruptible rollouts over the queue.

Two Redis keys per training run, written by the trainer and read by the workers between steps
(one pipelined round trip per step):

* ``osfarm:train:<run>:abort`` — a set of episode ids the trainer no longer wants (stale or
  redundant rollouts). A worker whose episode is in it stops at its next step, releases the
  desktop and ends the job as :class:`RolloutAborted` (no record); a job that reaches a worker
  after its abort (a revoke the worker never heard of) does not start.
* ``osfarm:train:<run>:route`` — a hash from policy server URL to ``{"model", "version"}``: the
  adapter a rollout on that server may use now. An interruptible rollout reads it before each
  model call and moves to the newest adapter; every step records the version that produced it.

Both keys expire a day after their last write: a crashed trainer leaves nothing behind for ever.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from typing import Any

import redis

from osfarm.agents import Agent
from osfarm.errors import OsfarmError
from osfarm.schema.actions import AgentAction

KEY_TTL_S = 24 * 3600


class RolloutAborted(OsfarmError):
    """The trainer aborted this rollout (ROLL: stale or redundant); the job ends without a record.
    The trainer tells it from a failure by this name (Celery carries the exception's type name)."""


def abort_key(run_id: str) -> str:
    return f"osfarm:train:{run_id}:abort"


def route_key(run_id: str) -> str:
    return f"osfarm:train:{run_id}:route"


def publish_abort(r: redis.Redis, run_id: str, episode_ids: Iterable[str]) -> int:
    """Mark ``episode_ids`` aborted (blocking: run in a thread); returns how many were marked."""
    ids = list(episode_ids)
    if ids:
        pipe = r.pipeline(transaction=True)
        pipe.sadd(abort_key(run_id), *ids)
        pipe.expire(abort_key(run_id), KEY_TTL_S)
        pipe.execute()
    return len(ids)


def publish_routes(r: redis.Redis, run_id: str, routes: dict[str, tuple[str, int | None]]) -> None:
    """The adapter each policy server's rollouts may use now (blocking: run in a thread)."""
    if not routes:
        return
    pipe = r.pipeline(transaction=True)
    entries = {url: json.dumps({"model": m, "version": v}) for url, (m, v) in routes.items()}
    pipe.hset(route_key(run_id), mapping=entries)  # type: ignore[arg-type]
    pipe.expire(route_key(run_id), KEY_TTL_S)
    pipe.execute()


def tag_version(agent: Agent, version: int | None, versions: list[int | None]) -> None:
    """After a model call: a call whose answer named no version (vLLM's) gets ``version``, the
    version of the adapter asked; the step's version is appended to ``versions``."""
    call = agent.last_model_call
    if call is not None:
        if call.policy_version is None and version is not None:
            call.policy_version = version
        versions.append(call.policy_version)


class RolloutControl:
    """A worker's view of its rollout's two keys."""

    def __init__(self, r: redis.Redis, run_id: str, episode_id: str, server_url: str | None):
        self.r, self.run_id, self.episode_id, self.server_url = r, run_id, episode_id, server_url

    def poll(self) -> tuple[bool, tuple[str, int | None] | None]:
        """(aborted?, the route published for this rollout's server or None) — blocking."""
        pipe = self.r.pipeline(transaction=False)
        pipe.sismember(abort_key(self.run_id), self.episode_id)
        pipe.hget(route_key(self.run_id), self.server_url or "")
        aborted, raw = pipe.execute()
        route = None
        if raw:
            try:
                d = json.loads(raw)
                route = (str(d["model"]), None if d.get("version") is None else int(d["version"]))
            except (ValueError, KeyError, TypeError):
                route = None  # a malformed entry: keep the adapter the job named
        return bool(aborted), route


class ControlledAgent:
    """The job's agent, checking its rollout's keys before each model call: aborted, it calls
    ``on_abort`` (which cancels the episode: the desktop is released on the way out); interruptible,
    it asks for the newest adapter. Each model call without a version of its own (vLLM's) is tagged
    with the version of the adapter that answered it."""

    def __init__(self, agent: Agent, control: RolloutControl, *, model: str, version: int | None,
                 interruptible: bool):
        self.agent, self.control, self.interruptible = agent, control, interruptible
        self.model, self.version = model, version
        self.aborted = False
        self.on_abort: Callable[[], Any] | None = None
        self.step_versions: list[int | None] = []

    def __getattr__(self, name: str) -> Any:  # name, wants_a11y, settle_s, last_model_call, ...
        return getattr(self.agent, name)

    def reset(self, task: Any = None) -> None:
        self.agent.reset(task)

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        return self.agent.predict(instruction, obs)

    async def apredict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        try:
            aborted, route = await asyncio.to_thread(self.control.poll)
        except redis.RedisError:  # Redis out for longer than the client's retries: go on as the job said
            aborted, route = False, None
        if aborted:
            self.aborted = True
            if self.on_abort is None:
                raise RolloutAborted(f"episode {self.control.episode_id}: aborted by the trainer")
            self.on_abort()
            await asyncio.Future()  # the cancellation on_abort sent ends the episode here
        if self.interruptible and route is not None:
            client = getattr(self.agent, "client", None)
            if route[0] != self.model and client is not None and hasattr(client, "model"):
                client.model = route[0]
            self.model, self.version = route
        out = await self.agent.apredict(instruction, obs)
        tag_version(self.agent, self.version, self.step_versions)
        return out

    async def aclose(self) -> None:
        await self.agent.aclose()
