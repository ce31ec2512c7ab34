"""One episode of a benchmark run: an agent on a :class:`osfarm.env.TaskEnv`, to a final status.

Statuses (DESIGN.md): ``success`` (score == 1.0), ``failure`` (any lower score, or the agent
crashed), ``infra_error`` (the harness could not give the agent a fair try: no desktop, a setup
step failed, the desktop died, a getter or metric crashed, the policy server stayed unreachable;
the error text says which) and ``timeout`` (the episode's wall-clock limit ran out). Only infra
errors are retried, a bounded number of times; every attempt is counted in the result.

The lifecycle (lease, setup, steps, postconfig, evaluation) is the env's; this module adds what
a benchmark keeps of it: the agent's side of each step (its response, model call, parse error,
think time), the screenshots, the phase timings, the recording, the retries.
"""

from __future__ import annotations

import asyncio
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from osfarm.agents.base import Agent
from osfarm.client import AsyncFarm
from osfarm.env import DesktopUsage, EpisodeTimeout, InfraError, TaskEnv
from osfarm.http.retry import backoff_s
from osfarm.schema.actions import action_json
from osfarm.schema.episode import ModelCall
from osfarm.schema.guest import DEFAULT_ACTION_TIMING, ActionTiming
from osfarm.schema.lease import ControlInfo, LeaseInfo
from osfarm.tasks.filecache import FileCache
from osfarm.tasks.model import Task

SUCCESS, FAILURE, INFRA_ERROR, TIMEOUT = "success", "failure", "infra_error", "timeout"
STATUSES = (SUCCESS, FAILURE, INFRA_ERROR, TIMEOUT)


@dataclass
class EpisodeConfig:
    max_steps: int = 15
    time_limit_s: float = 600.0  # wall clock for one attempt (setup + agent + evaluation)
    infra_retries: int = 2  # extra attempts after an infra error
    # wait before retry n: backoff_s(n, retry_backoff_s) (exponential, jittered; 0 = at once), so a
    # farm or policy server that is restarting is not hit by every episode at the same instant
    retry_backoff_s: float = 2.0
    lease_wait_s: float = 120.0
    lease_ttl_s: float = 120.0
    offline: bool = True
    code_timeout_s: float = 30.0
    work_dir: Path = field(default_factory=lambda: Path("cache"))  # per-episode getter caches go below
    record: bool = False  # an mp4 of the agent's part of the episode (OSWorld's recording.mp4)
    action_timing: ActionTiming = DEFAULT_ACTION_TIMING  # how actions are paced (osfarm.env.TaskEnv)


@dataclass
class StepRecord:
    index: int  # 1-based, as OSWorld's step_num
    screenshot: bytes  # the observation the agent acted on
    a11y: str | None
    response: str
    actions: list[str | dict[str, Any]]  # as JSON carries them (typed ones dumped): the record stores them
    action_error: str | None
    t_model_ms: float
    t_env_ms: float
    timestamp: str  # OSWorld's %Y%m%d@%H%M%S%f, when the actions were sent
    after_screenshot: bytes | None = None  # the observation after the actions (OSWorld saves this one)
    # the model call behind this step (agents with ``last_model_call``, e.g. vlm): request messages
    # (images as data URLs), response_text, response_token_ids, response_logprobs, policy_version
    model: ModelCall | None = None


@dataclass
class EpisodeResult:
    task: Task
    status: str
    score: float
    error: str | None
    episode_id: str
    attempt: int  # the attempt this result comes from (1-based)
    infra_retries: int  # attempts that ended in an infra error and were retried
    steps: list[StepRecord]
    started_at: float
    finished_at: float
    agent: str
    desktop: LeaseInfo | None = None  # the lease the final attempt's desktop was granted on (TaskEnv.desktop)
    last_action: Any = None
    errors: list[str] = field(default_factory=list)  # the errors of retried attempts
    recording: bytes | None = None
    # seconds per phase of the final attempt: lease, setup, agent (model + actions), evaluate
    timings: dict[str, float] = field(default_factory=dict)
    recording_error: str | None = None  # a failed recording is noted, never the episode's failure
    action_timing: ActionTiming = DEFAULT_ACTION_TIMING  # how the actions were paced (EpisodeConfig.action_timing)
    controlled_by: list[ControlInfo] = field(default_factory=list)  # dashboard take-overs (TaskEnv.controlled_by)
    desktop_usage: DesktopUsage = field(default_factory=DesktopUsage)  # CPU-seconds, reset (TaskEnv.desktop_usage)
    repeat: int | None = None  # which of a run's --repeats (1-based); None in a run without repeats


def episode_id(run_id: str, task_id: str, repeat: int | None = None) -> str:
    """Idempotent: a task of a run (a repeat of it, with --repeats) always names the same episode,
    whichever attempt, retry or redelivery (another worker running it again) produced its one record."""
    suffix = f"#{repeat}" if repeat is not None else ""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"osfarm:{run_id}:{task_id}{suffix}"))


def _ts() -> str:
    return datetime.now().strftime("%Y%m%d@%H%M%S%f")


def _timed_out(cfg: EpisodeConfig) -> str:
    return f"episode exceeded its {cfg.time_limit_s:g} s limit"


async def _attempt(farm: AsyncFarm, task: Task, agent: Agent, cache: FileCache, cfg: EpisodeConfig,
                   res: EpisodeResult) -> None:
    """Fill ``res`` (status, score, error, steps, timings); raises InfraError for harness failures
    and EpisodeTimeout when the time limit runs out."""
    env = TaskEnv(farm, max_steps=cfg.max_steps, time_limit_s=cfg.time_limit_s, cache=cache,
                  work_dir=cfg.work_dir / res.episode_id, offline=cfg.offline, a11y=agent.wants_a11y,
                  settle_s=agent.settle_s, record=cfg.record, lease_ttl_s=cfg.lease_ttl_s,
                  lease_wait_s=cfg.lease_wait_s, code_timeout_s=cfg.code_timeout_s, action_timing=cfg.action_timing)
    res.controlled_by = env.controlled_by  # the same list: the env fills it when it releases the desktop
    res.desktop_usage = env.desktop_usage  # the same object, filled on release too
    async with env:
        try:
            obs, _ = await env.reset(task)
        finally:
            res.desktop, res.timings = env.desktop, env.timings
        try:
            await asyncio.to_thread(agent.reset, task)
        except Exception as e:  # noqa: BLE001 - the agent's failure, not retried
            res.status, res.error = FAILURE, f"agent reset: {type(e).__name__}: {e}"
            return
        res.recording_error = env.recording_error
        i = 0
        while True:
            i += 1
            t0 = time.perf_counter()
            try:
                response, predicted = await agent.apredict(task.instruction, obs.as_dict())
            except Exception as e:  # noqa: BLE001
                if isinstance(e, InfraError):  # e.g. the policy server stayed unreachable through its retries
                    raise InfraError(f"step {i}: {e}", phase="agent") from e
                res.status, res.error = FAILURE, f"agent predict (step {i}): {type(e).__name__}: {e}"
                return
            t_model = (time.perf_counter() - t0) * 1000
            actions = [action_json(a) for a in predicted or []]  # typed ones as JSON carries them
            call = agent.last_model_call
            parse_error = call.parse_error if call is not None else None
            rec = StepRecord(index=i, screenshot=obs.screenshot, a11y=obs.accessibility_tree, response=str(response),
                             actions=actions, action_error=f"parse error: {parse_error}" if parse_error else None,
                             t_model_ms=round(t_model, 1), t_env_ms=0.0, timestamp=_ts(), model=call)
            res.steps.append(rec)
            try:
                obs, _reward, terminated, truncated, info = await env.step(actions)
            finally:
                # what the desktop made of the step, even when the evaluation that ends the episode fails
                out = env.last_step
                if out is not None and out.index == i:
                    if out.action_error:
                        rec.action_error = out.action_error
                    if out.t_env_ms is not None:
                        rec.t_env_ms = out.t_env_ms
                    if out.observation is not None:
                        rec.after_screenshot = out.observation.screenshot
                res.last_action = env.last_action
                res.recording, res.recording_error = env.recording, env.recording_error
            if info["time_limit"]:
                raise EpisodeTimeout(_timed_out(cfg))
            if terminated or truncated:
                break
        assert env.score is not None
        res.score = env.score
        res.status = SUCCESS if res.score == 1.0 else FAILURE


async def run_episode(farm: AsyncFarm, task: Task, agent: Agent, cache: FileCache, cfg: EpisodeConfig,
                      run_id: str, repeat: int | None = None) -> EpisodeResult:
    """Run ``task`` to a final status, retrying infra errors up to ``cfg.infra_retries`` times;
    ``repeat`` names which of the run's repeats this episode is (each leases its own desktop)."""
    try:
        return await _run_attempts(farm, task, agent, cache, cfg, run_id, repeat)
    finally:
        await agent.aclose()  # agents holding connections (vlm) release them


async def _run_attempts(farm: AsyncFarm, task: Task, agent: Agent, cache: FileCache, cfg: EpisodeConfig,
                        run_id: str, repeat: int | None) -> EpisodeResult:
    errors: list[str] = []
    attempt = 0
    while True:
        attempt += 1
        res = EpisodeResult(task=task, status=FAILURE, score=0.0, error=None,
                            episode_id=episode_id(run_id, task.id, repeat), attempt=attempt, repeat=repeat,
                            infra_retries=len(errors), steps=[], started_at=time.time(), finished_at=0.0,
                            agent=agent.name, errors=list(errors), action_timing=cfg.action_timing)
        try:
            # the env keeps the limit too; this one also cuts an agent that hangs in predict
            await asyncio.wait_for(_attempt(farm, task, agent, cache, cfg, res), cfg.time_limit_s)
        except TimeoutError:  # EpisodeTimeout included
            if res.steps:
                res.status, res.score, res.error = TIMEOUT, 0.0, _timed_out(cfg)
            else:  # the time ran out in the harness (lease, setup: a farm restarting), not in the agent's turn
                res.status, res.score = INFRA_ERROR, 0.0
                res.error = f"{_timed_out(cfg)} before the agent's first step (lease or setup did not finish)"
        except InfraError as e:
            res.status, res.score, res.error = INFRA_ERROR, 0.0, str(e)
        except Exception as e:  # noqa: BLE001 - a harness bug: still a listed infra error, never a crash
            res.status, res.score = INFRA_ERROR, 0.0
            res.error = f"harness error: {type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"
        res.finished_at = time.time()
        if res.status != INFRA_ERROR or attempt > cfg.infra_retries:
            return res
        errors.append(f"attempt {attempt}: {res.error}")
        if cfg.retry_backoff_s > 0:
            await asyncio.sleep(backoff_s(attempt, cfg.retry_backoff_s, cap_s=60.0))
