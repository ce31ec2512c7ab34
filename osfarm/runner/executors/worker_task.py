"""What ``osfarm.run_episode`` does on a worker: one episode, run at most once per episode id.

The job (JSON, from the runner): run_id, suite, index, task_id, agent, agent_options, episode
settings, out (the run dir), cache, offline. The worker's own settings come from the
environment ``osfarm worker`` sets: OSFARM_FARM_URL, OSFARM_TOKEN, OSFARM_BROKER, OSFARM_STREAM
(the stream key; empty = no stream), OSFARM_WORKER_OUT (write task files there instead of the
job's run dir, for workers that do not share the runner's filesystem).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Self

import redis
from celery.utils.log import get_task_logger

from osfarm.agents import make_agent
from osfarm.client import AsyncFarm
from osfarm.runner.episode import EpisodeConfig, EpisodeResult, run_episode
from osfarm.runner.results import BlobStore, write_task
from osfarm.stream.redis_stream import DEFAULT_STREAM, RedisStreamSink, connect
from osfarm.tasks.filecache import suite_cache
from osfarm.tasks.suite import Suite, load_suite

CLAIM_TTL_S = 20.0  # a crashed worker's claim is gone this long after its last renewal
RESULT_TTL_S = 7 * 24 * 3600
log = get_task_logger("osfarm.worker")
_DEL_IF_MINE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def job_key(run_id: str, task_id: str) -> str:
    return f"osfarm:job:{run_id}:{task_id}"


@lru_cache(maxsize=1)
def _redis() -> redis.Redis:
    return connect(os.environ.get("OSFARM_BROKER", "redis://127.0.0.1:6379/0"))


@lru_cache(maxsize=8)
def _suite(suite: str, index: str | None) -> Suite:
    return load_suite(suite, index, strict=False)  # the runner records refused tasks; they are never queued


def _retrying(fn: Any, what: str, deadline_s: float = 300.0) -> Any:
    """Run a Redis call, waiting out an outage (a restart) for up to ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    delay = 0.2
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: Redis unreachable for {deadline_s:.0f} s") from None
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


class Claim:
    """SET NX claim on a job, renewed in a thread while the episode runs."""

    def __init__(self, r: redis.Redis, key: str, me: str):
        self.r, self.key, self.me = r, key, me
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> bool:
        return bool(_retrying(lambda: self.r.set(self.key, self.me, nx=True, ex=int(CLAIM_TTL_S)), "claim"))

    def _renew(self) -> None:
        while not self._stop.wait(CLAIM_TTL_S / 4):
            try:
                self.r.set(self.key, self.me, xx=True, ex=int(CLAIM_TTL_S))
            except (redis.ConnectionError, redis.TimeoutError):
                pass  # Redis down: the renewal after it is back keeps the claim

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._renew, daemon=True, name="osfarm-claim")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            self.r.eval(_DEL_IF_MINE, 1, self.key, self.me)
        except (redis.ConnectionError, redis.TimeoutError):
            pass  # it expires on its own


def run_job(job: dict[str, Any], worker_name: str) -> dict[str, Any]:
    r = _redis()
    key = job_key(job["run_id"], job["task_id"])
    me = f"{worker_name}:{os.getpid()}:{time.time():.3f}"
    claim = Claim(r, key + ":claim", me)
    give_up = time.monotonic() + float(job.get("soft_limit_s", 3600))
    while True:
        stored = _retrying(lambda: r.get(key + ":result"), "result lookup")
        if stored:  # a redelivery of an episode that finished: its one result, no second run
            log.info("task %s (run %s): already finished, returning its result", job["task_id"], job["run_id"])
            return json.loads(stored)
        if claim.take():
            break
        if time.monotonic() > give_up:
            raise RuntimeError(f"task {job['task_id']}: another worker held its claim for the whole time limit")
        time.sleep(1.0)  # another worker runs it right now (a redelivery while it was still running)
    with claim:
        stored = _retrying(lambda: r.get(key + ":result"), "result lookup")
        if stored:
            return json.loads(stored)
        log.info("task %s (run %s): running the episode", job["task_id"], job["run_id"])
        out = _run(job)
        log.info("task %s (run %s): %s, score %s", job["task_id"], job["run_id"], out["row"]["status"],
                 out["row"]["score"])
        _retrying(lambda: r.set(key + ":result", json.dumps(out, ensure_ascii=False), ex=RESULT_TTL_S), "store result")
        return out


def _run(job: dict[str, Any]) -> dict[str, Any]:
    farm_url = os.environ.get("OSFARM_FARM_URL", "")
    token = os.environ.get("OSFARM_TOKEN", "")
    if not farm_url or not token:
        raise RuntimeError("this worker has no farm: start it with --farm URL --token T (or OSFARM_FARM_URL/OSFARM_TOKEN)")
    override = os.environ.get("OSFARM_WORKER_OUT")
    out = Path(override) / job["run_id"] if override else Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    suite = _suite(job["suite"], job.get("index"))
    task = next((t for t in suite if t.id == job["task_id"]), None)
    if task is None:
        raise RuntimeError(f"task {job['task_id']} is not in the suite {job['suite']} as this worker sees it")
    cache = suite_cache(suite, Path(job["suite"]), Path(job["cache"]) if job.get("cache") else None, out,
                       bool(job.get("offline", True)))
    e = job["episode"]
    cfg = EpisodeConfig(max_steps=int(e["max_steps"]), time_limit_s=float(e["time_limit_s"]),
                        infra_retries=int(e["infra_retries"]), offline=bool(job.get("offline", True)),
                        work_dir=out / ".work", record=bool(e.get("record", False)),
                        action_timing=e.get("action_timing", "osworld"))
    agent = make_agent(job["agent"], **job.get("agent_options", {}))

    async def go() -> EpisodeResult:
        async with AsyncFarm(farm_url, token) as farm:
            return await run_episode(farm, task, agent, cache, cfg, job["run_id"])

    res = asyncio.run(go())
    records: list[dict[str, Any]] = []
    row = write_task(out, res, job["run_id"], BlobStore(out), emit=records.append)
    rec = records[0]
    stream = os.environ.get("OSFARM_STREAM", DEFAULT_STREAM)
    if stream:
        sink = RedisStreamSink(stream=stream, client=_redis(),
                               spill=Path(os.environ.get("OSFARM_STATE_DIR", str(out))) / "stream-spill.jsonl")
        _retrying(lambda: sink.publish(rec), "publish record")
    return {"row": row, "record": rec}
