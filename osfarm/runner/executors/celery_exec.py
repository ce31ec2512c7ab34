"""The runner's side of the Celery executor: send one episode job, wait for its row and record.

Waiting polls the result backend from a thread (never blocking the event loop) and rides out a
Redis outage: a restarted Redis (with its data) still holds the queued jobs and the results.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import redis
from kombu.exceptions import OperationalError

from osfarm.errors import EpisodeTimeout, InfraError, OsfarmError
from osfarm.http.retry import backoff_s
from osfarm.runner.executors.celery_app import (
    TASK_NAME,
    hard_limit_s,
    make_app,
    soft_limit_s,
    visibility_timeout_s,
)

_OUTAGE = (redis.ConnectionError, redis.TimeoutError, OperationalError, ConnectionError)


class CeleryExecutor:
    def __init__(self, broker: str, poll_s: float = 0.5, outage_s: float = 600.0):
        self.app = make_app(broker)
        self.poll_s = poll_s
        self.outage_s = outage_s

    @staticmethod
    def check_limits(time_limit_s: float, infra_retries: int) -> None:
        hard, vis = hard_limit_s(time_limit_s, infra_retries), visibility_timeout_s()
        if hard >= vis:
            raise ValueError(f"an episode may run {hard:.0f} s (time limit x attempts + retry backoff + 30 s) "
                             f"but the broker's "
                             f"visibility timeout is {vis:.0f} s: Redis would give it to a second worker while it "
                             f"runs. Set OSFARM_CELERY_VISIBILITY_S above {hard:.0f} (on workers too) or lower "
                             f"--time-limit/--retries")

    def _send(self, job: dict[str, Any], task_id: str) -> None:
        e = job["episode"]
        hard = hard_limit_s(float(e["time_limit_s"]), int(e["infra_retries"]))
        soft = soft_limit_s(float(e["time_limit_s"]), int(e["infra_retries"]))
        job = {**job, "soft_limit_s": soft}
        self.app.send_task(TASK_NAME, kwargs=job, task_id=task_id, soft_time_limit=soft, time_limit=hard)

    def _poll(self, task_id: str) -> tuple[bool, Any, str]:
        ar = self.app.AsyncResult(task_id)
        state = ar.state
        if state == "SUCCESS":
            return True, ar.result, state
        if state in ("FAILURE", "REVOKED"):
            return True, ar.result, state
        return False, None, state

    async def send(self, job: dict[str, Any], task_id: str) -> None:
        """Queue ``job`` as Celery task ``task_id``, riding out a broker outage up to ``outage_s``."""
        await self.broker_call(lambda: self._send(job, task_id))

    async def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """Queue ``job`` and wait for ``{"row": ..., "record": ...}``; a worker-side failure raises."""
        repeat = f"#{job['repeat']}" if job.get("repeat") is not None else ""  # each of --repeats is its own job
        task_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"osfarm-job:{job['run_id']}:{job['task_id']}{repeat}"))
        await self.send(job, task_id)
        while True:
            done, result, state = await self.broker_call(lambda: self._poll(task_id))
            if done:
                if state == "SUCCESS":
                    return result
                raise worker_failure(state, result)
            await asyncio.sleep(self.poll_s)

    async def broker_call(self, fn: Any) -> Any:
        """``fn()`` (a blocking broker call) in a thread, tried again while the broker is down, up to ``outage_s``."""
        down_since: float | None = None
        attempt = 0
        while True:
            try:
                return await asyncio.to_thread(fn)
            except _OUTAGE:
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > self.outage_s:
                    raise
                attempt += 1
                await asyncio.sleep(backoff_s(attempt, base_s=0.25, cap_s=5.0))

    def close(self) -> None:
        self.app.close()


class _WorkerFailure(OsfarmError):
    """What a failed episode job left: Celery's ``state`` (FAILURE, REVOKED) and its ``result``
    (the base of the two errors below, before their InfraError / EpisodeTimeout branch)."""

    def __init__(self, state: str, result: Any):
        self.state = state
        self.result = result
        name = type(result).__name__ if isinstance(result, BaseException) else "error"
        super().__init__(f"worker {state.lower()}: {name}: {result}")


class RemoteEpisodeError(_WorkerFailure, InfraError, RuntimeError):
    """A worker's episode job failed (the worker crashed in it, the job was revoked): an infra error."""


class RemoteEpisodeTimeout(_WorkerFailure, EpisodeTimeout, RuntimeError):
    """Celery's time limit stopped a worker's episode job: the episode timed out."""


def worker_failure(state: str, result: Any) -> RemoteEpisodeError | RemoteEpisodeTimeout:
    """The error a failed job raises: a timeout if Celery's time limit stopped it, else an infra error."""
    timed_out = isinstance(result, BaseException) and type(result).__name__ in ("TimeLimitExceeded",
                                                                               "SoftTimeLimitExceeded")
    return (RemoteEpisodeTimeout if timed_out else RemoteEpisodeError)(state, result)
