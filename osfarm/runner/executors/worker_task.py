"""What ``osfarm.run_episode`` does on a worker: one episode, run at most once per episode id.

The job (JSON, from the runner): run_id, suite, index, task_id, repeat (one of an eval's
--repeats; absent without), agent, agent_options, episode settings, out (the run dir), cache,
offline. The worker's own settings come from the environment ``osfarm worker`` sets:
OSFARM_FARM_URL, OSFARM_TOKEN, OSFARM_BROKER, OSFARM_STREAM (the stream key; empty = no stream),
OSFARM_WORKER_OUT (write task files there instead of the job's run dir, for workers that do not
share the runner's filesystem), OSFARM_SOURCE_ADDRESS (--bind-address: the farm, policy and Redis
clients connect from it), OSFARM_MAX_DELIVERIES
(how many times a job may start running before it is dead-lettered, default 3).

Exactly one result and one record per job, whatever dies:

* the episode id is the job's (``episode_id(run, task)``): the same on every redelivery;
* the result and the record's stream entry are written by one Lua script
  (:func:`osfarm.stream.redis_stream.store_result`): a worker killed before it has both, has
  neither, and the job's next delivery runs it again; one killed after, leaves a result that the
  next delivery returns without running;
* every start of a run is counted; a job that started ``OSFARM_MAX_DELIVERIES`` times without
  finishing (it kills its worker: out of memory, a crash in native code) is not run again: it ends
  as an ``infra_error`` episode whose error says so, and its job goes to the dead-letter stream
  ``osfarm:jobs:dead`` with the reason.
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

from osfarm.agents import Agent, make_agent
from osfarm.client import AsyncFarm
from osfarm.http.retry import backoff_s
from osfarm.http.source_address import source_address
from osfarm.runner.episode import INFRA_ERROR, EpisodeConfig, EpisodeResult, episode_id, run_episode
from osfarm.runner.executors.rollout_control import ControlledAgent, RolloutAborted, RolloutControl
from osfarm.runner.results import BlobStore, episode_record, write_task
from osfarm.schema.guest import DEFAULT_ACTION_TIMING
from osfarm.stream.jsonl import JsonlSink
from osfarm.stream.redis_stream import DEFAULT_STREAM, RedisStreamSink, connect, store_result
from osfarm.tasks.filecache import suite_cache
from osfarm.tasks.model import Task
from osfarm.tasks.suite import Suite, load_suite

CLAIM_TTL_S = 20.0  # a crashed worker's claim is gone this long after its last renewal
RESULT_TTL_S = 7 * 24 * 3600
DEAD_JOBS = "osfarm:jobs:dead"
log = get_task_logger("osfarm.worker")
_DEL_IF_MINE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def job_key(run_id: str, task_id: str) -> str:
    return f"osfarm:job:{run_id}:{task_id}"


def rollout_name(job: dict[str, Any]) -> str:
    """What names the job's one episode within its run: the task, or for a training rollout (the
    trainer runs a task many times per run) the task and the rollout's number, or for one of an
    eval's --repeats the task and the repeat's (as :func:`episode_id` names it in process)."""
    if job.get("rollout") is not None:
        return f"{job['task_id']}#{job['rollout']}"
    repeat = job_repeat(job)
    return f"{job['task_id']}#{repeat}" if repeat is not None else job["task_id"]


def job_repeat(job: dict[str, Any]) -> int | None:
    """The job's repeat, a positive int or None: it names a directory (repeat-<r>/) on the worker,
    and a job comes from whoever can write to the broker."""
    r = job.get("repeat")
    if r is None:
        return None
    if type(r) is not int or r < 1:
        raise ValueError(f"repeat: must be a positive integer, got {r!r}")
    return r


@lru_cache(maxsize=1)
def _redis() -> redis.Redis:
    return connect(os.environ.get("OSFARM_BROKER", "redis://127.0.0.1:6379/0"), source_address=source_address())


@lru_cache(maxsize=8)
def _suite(suite: str, index: str | None) -> Suite:
    return load_suite(suite, index, strict=False)  # the runner records refused tasks; they are never queued


def claim_ttl_s() -> int:
    """Seconds a dead worker's claim outlives it (OSFARM_CLAIM_TTL_S, default 20): a redelivery
    waits this long at most before it runs the job again."""
    return max(2, int(float(os.environ.get("OSFARM_CLAIM_TTL_S", CLAIM_TTL_S))))


def max_deliveries() -> int:
    """Starts of a job before it is dead-lettered (OSFARM_MAX_DELIVERIES, default 3)."""
    return max(1, int(os.environ.get("OSFARM_MAX_DELIVERIES", "3")))


def _retrying(fn: Any, what: str, deadline_s: float = 300.0) -> Any:
    """Run a Redis call, waiting out an outage (a restart) for up to ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    attempt = 0
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: Redis unreachable for {deadline_s:.0f} s") from None
            attempt += 1
            time.sleep(backoff_s(attempt, base_s=0.2, cap_s=3.0))


class Claim:
    """SET NX claim on a job, renewed in a thread while the episode runs."""

    def __init__(self, r: redis.Redis, key: str, me: str):
        self.r, self.key, self.me = r, key, me
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> bool:
        return bool(_retrying(lambda: self.r.set(self.key, self.me, nx=True, ex=claim_ttl_s()), "claim"))

    def _renew(self) -> None:
        while not self._stop.wait(claim_ttl_s() / 4):
            try:
                self.r.set(self.key, self.me, xx=True, ex=claim_ttl_s())
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
    key = job_key(job["run_id"], rollout_name(job))
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
        starts = int(_retrying(lambda: _count_start(r, key), "count the job's starts"))
        if starts > max_deliveries():
            reason = (f"the job started {starts - 1} times and never finished: each time its worker died "
                      f"(killed, out of memory, or crashed); not run again (OSFARM_MAX_DELIVERIES="
                      f"{max_deliveries()})")
            log.error("task %s (run %s): dead-lettered: %s", job["task_id"], job["run_id"], reason)
            _retrying(lambda: r.xadd(DEAD_JOBS, {"run_id": job["run_id"], "task_id": job["task_id"],
                                                 "reason": reason, "job": json.dumps(job)}), "dead-letter the job")
            return _store(r, key, _with_origin(_dead_result(job, reason), job, worker_name), _out_dir(job), job)
        log.info("task %s (run %s): running the episode (start %d)", job["task_id"], job["run_id"], starts)
        out = _with_origin(_run(job), job, worker_name)
        log.info("task %s (run %s): %s, score %s", job["task_id"], job["run_id"], out["row"]["status"],
                 out["row"]["score"])
        return _store(r, key, out, _out_dir(job), job)


def _with_origin(out: dict[str, Any], job: dict[str, Any], worker_name: str) -> dict[str, Any]:
    """The record names the worker and farm that ran it (a cluster's episodes come from many
    hosts) and carries what the job asked to be added (a training rollout's group id)."""
    rec = out["record"]
    rec["worker"] = {"name": worker_name, "farm": os.environ.get("OSFARM_FARM_URL", "")}
    rec.update(job.get("record_fields") or {})
    return out


def _count_start(r: redis.Redis, key: str) -> int:
    pipe = r.pipeline(transaction=True)
    pipe.incr(key + ":starts")
    pipe.expire(key + ":starts", RESULT_TTL_S)
    return int(pipe.execute()[0])


def _store(r: redis.Redis, key: str, out: dict[str, Any], spill_dir: Path, job: dict[str, Any]) -> dict[str, Any]:
    """Store the result and publish the record in one step (see the module doc); returns the result
    Redis holds, which is an earlier run's when one got there first. The job may name the stream
    (a trainer reads its own); else the worker's."""
    rec = out["record"]
    stream = job["stream"] if job.get("stream") is not None else os.environ.get("OSFARM_STREAM", DEFAULT_STREAM)
    result = json.dumps(out, ensure_ascii=False)
    if stream:
        sink = RedisStreamSink(stream=stream, client=r)
        if not _retrying(sink.wait_for_room, "wait for room on the stream", deadline_s=sink.wait_s + 300):
            # the stream stays full: the record goes to the spill file (republished later, once per
            # episode id), the result alone to Redis; a crash between the two spills it twice, which
            # the republish's dedupe absorbs
            spill = Path(os.environ.get("OSFARM_STATE_DIR") or spill_dir) / "stream-spill.jsonl"
            JsonlSink(spill, fsync=True).publish(rec)
            log.warning("stream %s is full: episode %s spilled to %s (osfarm stream republish %s)", stream,
                        rec["episode_id"], spill, spill)
            stream = ""
    stored = _retrying(lambda: store_result(r, key + ":result", result, RESULT_TTL_S, stream=stream or None,
                                            record=rec if stream else None), "store the result")
    if stored.status == "existing":
        log.info("episode %s: an earlier run stored the result first; returning that one", rec["episode_id"])
    return json.loads(stored.result)


def _dead_result(job: dict[str, Any], reason: str) -> dict[str, Any]:
    """The infra_error row and record of a dead-lettered job (no steps; the error is the reason)."""
    out = _out_dir(job)
    task = _task(job)
    now = time.time()
    res = EpisodeResult(task=task, status=INFRA_ERROR, score=0.0, error=reason,
                        episode_id=episode_id(job["run_id"], rollout_name(job)), attempt=1, infra_retries=0, steps=[],
                        started_at=now, finished_at=now, agent=job["agent"], repeat=job_repeat(job),
                        action_timing=job.get("episode", {}).get("action_timing", DEFAULT_ACTION_TIMING))
    records: list[dict[str, Any]] = []
    row = write_task(out, res, job["run_id"], BlobStore(out), emit=records.append)
    return {"row": row, "record": records[0]}


def _out_dir(job: dict[str, Any]) -> Path:
    override = os.environ.get("OSFARM_WORKER_OUT")
    out = Path(override) / job["run_id"] if override else Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    return out


def _task(job: dict[str, Any]) -> Task:
    suite = _suite(job["suite"], job.get("index"))
    task = next((t for t in suite if t.id == job["task_id"]), None)
    if task is None:
        raise RuntimeError(f"task {job['task_id']} is not in the suite {job['suite']} as this worker sees it")
    return task


def _run(job: dict[str, Any]) -> dict[str, Any]:
    farm_url = os.environ.get("OSFARM_FARM_URL", "")
    token = os.environ.get("OSFARM_TOKEN", "")
    if not farm_url or not token:
        raise RuntimeError("this worker has no farm: start it with --farm URL --token T "
                           "(or OSFARM_FARM_URL/OSFARM_TOKEN)")
    out = _out_dir(job)
    suite = _suite(job["suite"], job.get("index"))
    task = _task(job)
    cache = suite_cache(suite, Path(job["suite"]), Path(job["cache"]) if job.get("cache") else None, out,
                       bool(job.get("offline", True)))
    e = job["episode"]
    cfg = EpisodeConfig(max_steps=int(e["max_steps"]), time_limit_s=float(e["time_limit_s"]),
                        infra_retries=int(e["infra_retries"]), offline=bool(job.get("offline", True)),
                        work_dir=out / ".work", record=bool(e.get("record", False)),
                        action_timing=e.get("action_timing", DEFAULT_ACTION_TIMING))
    if job.get("instruction_suffix"):  # XRPO's exemplar, seeded by the trainer
        task = task.model_copy(update={"instruction": task.instruction + job["instruction_suffix"]})
    agent: Agent = make_agent(job["agent"], **job.get("agent_options", {}))
    eid = episode_id(job["run_id"], rollout_name(job))  # a rollout of a task: its own episode
    controlled: ControlledAgent | None = None
    if job.get("rollout") is not None:  # a training rollout: the trainer may abort it or move its adapter
        options = job.get("agent_options") or {}
        control = RolloutControl(_redis(), job["run_id"], eid, options.get("base_url"))
        if _retrying(control.poll, "read the rollout's abort flag")[0]:  # aborted while it was queued
            raise RolloutAborted(f"episode {eid}: aborted by the trainer before it started")
        agent = controlled = ControlledAgent(agent, control, model=str(options.get("model", "")),
                                             version=job.get("policy_version"),
                                             interruptible=bool(job.get("interruptible", False)))

    async def go() -> EpisodeResult:
        # the worker's farm: ride out its restarts; connect from the worker's --bind-address
        async with AsyncFarm(farm_url, token, expect_up=True, local_address=source_address()) as farm:
            episode = asyncio.ensure_future(
                run_episode(farm, task, agent, cache, cfg, job["run_id"], job_repeat(job)))
            if controlled is not None:
                controlled.on_abort = episode.cancel
            try:
                return await episode
            except asyncio.CancelledError:
                if controlled is not None and controlled.aborted:  # its desktop was released on the way out
                    raise RolloutAborted(f"episode {eid}: aborted by the trainer at a step") from None
                raise

    res = asyncio.run(go())
    res.episode_id = eid
    version = job.get("policy_version")
    if version is not None:  # a server whose answers do not say which weights made them (vLLM)
        for s in res.steps:
            if s.model is not None and s.model.policy_version is None:
                s.model.policy_version = version
    if job.get("rollout") is not None:  # a training rollout: the record is all (no per-task files,
        # which the task's other rollouts, running at the same time, would overwrite)
        rec = episode_record(res, job["run_id"], BlobStore(out))
        return {"row": {"task_id": task.id, "status": res.status, "score": res.score, "episode_id": res.episode_id,
                        "steps": len(res.steps)}, "record": rec}
    records: list[dict[str, Any]] = []
    row = write_task(out, res, job["run_id"], BlobStore(out), emit=records.append)
    return {"row": row, "record": records[0]}
