"""One episode: lease a fresh desktop, run the task's setup, let the agent act, evaluate.

Statuses (DESIGN.md): ``success`` (score == 1.0), ``failure`` (any lower score, or the agent
crashed), ``infra_error`` (the harness could not give the agent a fair try: no desktop, a setup
step failed, the desktop died, a getter or metric crashed; the error text says which) and
``timeout`` (the episode's wall-clock limit ran out). Only infra errors are retried, a bounded
number of times; every attempt is counted in the result.

The guest calls of setup and evaluation go through the farm's passthrough
(``/v1/desktops/{lease}/guest``) with the synchronous :class:`GuestController`, run in worker
threads so episodes on other desktops keep going.
"""

from __future__ import annotations

import asyncio
import base64
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from osfarm.agents.base import Action, Agent, special_action
from osfarm.client import AsyncFarm, FarmAPIError
from osfarm.evaluators.getters import GETTERS
from osfarm.evaluators.getters.env import EvalEnv
from osfarm.evaluators.metrics import METRICS
from osfarm.evaluators.scoring import score as score_fn
from osfarm.tasks.controller import GuestController, GuestError
from osfarm.tasks.filecache import AssetMissing, FileCache
from osfarm.tasks.model import Task
from osfarm.tasks.setup import POSTCONFIG_WINDOW_S, SetupExecutor, SetupFailed

SUCCESS, FAILURE, INFRA_ERROR, TIMEOUT = "success", "failure", "infra_error", "timeout"
STATUSES = (SUCCESS, FAILURE, INFRA_ERROR, TIMEOUT)
# The agent should see the screen after the app has drawn the effect of its input: wait for
# the screen to stop changing and the apps to go idle (at most this long; an agent's
# ``settle_s`` overrides it) instead of OSWorld's fixed 2 s pause.
SETTLE_S = 1.0


@dataclass
class EpisodeConfig:
    max_steps: int = 15
    time_limit_s: float = 600.0  # wall clock for one attempt (setup + agent + evaluation)
    infra_retries: int = 2  # extra attempts after an infra error
    lease_wait_s: float = 120.0
    lease_ttl_s: float = 120.0
    offline: bool = True
    code_timeout_s: float = 30.0
    work_dir: Path = field(default_factory=lambda: Path("cache"))  # per-episode getter caches go below
    record: bool = False  # an mp4 of the agent's part of the episode (OSWorld's recording.mp4)


@dataclass
class StepRecord:
    index: int  # 1-based, as OSWorld's step_num
    screenshot: bytes  # the observation the agent acted on
    a11y: str | None
    response: str
    actions: list[Action]
    action_error: str | None
    t_model_ms: float
    t_env_ms: float
    timestamp: str  # OSWorld's %Y%m%d@%H%M%S%f, when the actions were sent
    after_screenshot: bytes | None = None  # the observation after the actions (OSWorld saves this one)
    # the model call behind this step (agents with ``last_model_call``, e.g. vlm): request messages
    # (images as data URLs), response_text, response_token_ids, response_logprobs, policy_version
    model: dict[str, Any] | None = None


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
    desktop: dict[str, Any] = field(default_factory=dict)
    last_action: Any = None
    errors: list[str] = field(default_factory=list)  # the errors of retried attempts
    recording: bytes | None = None
    # seconds per phase of the final attempt: lease, setup, agent (model + actions), evaluate
    timings: dict[str, float] = field(default_factory=dict)
    recording_error: str | None = None  # a failed recording is noted, never the episode's failure


class HarnessError(Exception):
    """The harness failed (not the agent): becomes status infra_error with this message."""


class CacheLookup:
    """``EvalEnv.offline_cache`` over a FileCache: ``lookup(url) -> Path | None``."""

    def __init__(self, cache: FileCache, task_id: str, offline: bool):
        self.cache, self.task_id, self.offline = cache, task_id, offline

    def lookup(self, url: str) -> Path | None:
        try:
            return self.cache.fetch(url, self.task_id, offline=self.offline)
        except AssetMissing:
            return None


def episode_id(run_id: str, task_id: str, attempt: int) -> str:
    """Idempotent: the same (run, task, attempt) always names the same episode."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"osfarm:{run_id}:{task_id}:{attempt}"))


def _ts() -> str:
    from datetime import datetime

    return datetime.now().strftime("%Y%m%d@%H%M%S%f")


def _png(obs: Any) -> bytes:
    return base64.b64decode(obs.screenshot) if obs is not None and obs.screenshot else b""


def evaluate(task: Task, controller: Any, cache: FileCache, cache_dir: Path, screen: tuple[int, int],
             last_action: Any, offline: bool) -> float:
    """Run the evaluator's getters and score them (sync; raises HarnessError on a crash)."""
    ev = task.evaluator
    evaluator = ev.to_json()
    if ev.is_infeasible:
        return score_fn(evaluator, [], [], last_action, METRICS)
    env = EvalEnv(controller=controller, cache_dir=cache_dir, task_id=task.id,
                  offline_cache=CacheLookup(cache, task.id, offline), screen=screen)

    def get(spec: Any) -> Any:
        if spec is None:
            return None
        cfg = spec if isinstance(spec, dict) else spec.to_json()
        typ = cfg.get("type")
        fn = GETTERS.get(typ)
        if fn is None:
            raise HarnessError(f"evaluation: unknown getter {typ!r}")
        try:
            return fn(env, cfg)
        except Exception as e:
            raise HarnessError(f"evaluation: getter {typ!r} crashed: {type(e).__name__}: {e}") from e

    if isinstance(ev.func, list):
        results = [get(x) for x in (ev.result or [])] if isinstance(ev.result, list) else []
        expecteds = [get(x) for x in ev.expected] if isinstance(ev.expected, list) else []
    else:
        results = [get(ev.result)]
        expecteds = [get(ev.expected)] if ev.expected is not None else []
    try:
        return float(score_fn(evaluator, results, expecteds, last_action, METRICS))
    except Exception as e:
        raise HarnessError(f"evaluation: metric {ev.func!r} crashed: {type(e).__name__}: {e}") from e


class _PhaseClock:
    """Writes the seconds since the previous lap into ``into[name]`` (the harness overhead bench
    reads these from each episode record)."""

    def __init__(self, into: dict[str, float]):
        self.into = into
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = round(now - self.t, 3)
        self.t = now


async def _attempt(farm: AsyncFarm, token: str, task: Task, agent: Agent, cache: FileCache, cfg: EpisodeConfig,
                   res: EpisodeResult) -> None:
    """Fill ``res`` (status, score, error, steps); raises HarnessError for harness failures."""
    clock = _PhaseClock(res.timings)
    try:
        desk = await farm.lease(ttl_s=cfg.lease_ttl_s, wait_s=cfg.lease_wait_s, heartbeat=True)
    except FarmAPIError as e:
        raise HarnessError(f"lease: {e}") from e
    res.desktop = {"provider": desk.info.provider, "image": desk.info.image, "desktop_id": desk.info.desktop_id, "lease_id": desk.id}
    clock.lap("lease")
    controller = GuestController(base_url=f"{farm.url}/v1/desktops/{desk.id}/guest", token=token)
    try:
        screen = desk.screen
        cache_dir = cfg.work_dir / res.episode_id  # the getters' dir; execute steps' stdout files go there too
        setup = SetupExecutor(controller, cache, task.id, screen, offline=cfg.offline, output_dir=cache_dir)
        try:
            await asyncio.to_thread(setup.run, task.config)
        except SetupFailed as e:
            raise HarnessError(str(e)) from e
        clock.lap("setup")
        try:
            await asyncio.to_thread(agent.reset, task)
        except Exception as e:  # noqa: BLE001 - the agent's failure, not retried
            res.status, res.error = FAILURE, f"agent reset: {type(e).__name__}: {e}"
            return
        wants_a11y = bool(getattr(agent, "wants_a11y", False))
        settle_s = float(getattr(agent, "settle_s", SETTLE_S))
        if cfg.record:
            try:
                await asyncio.to_thread(controller.start_recording)
            except GuestError as e:
                res.recording_error = f"start_recording: {e}"
        try:
            obs = await desk.observe(a11y=wants_a11y, windows=False, cursor=False, settle_s=settle_s)
        except FarmAPIError as e:
            raise HarnessError(f"observe: {e}") from e
        instruction = task.instruction
        last: Any = None
        for i in range(1, cfg.max_steps + 1):
            png = _png(obs)
            o = {"screenshot": png, "accessibility_tree": obs.a11y, "terminal": None, "instruction": instruction}
            t0 = time.perf_counter()
            try:
                response, actions = await _predict(agent, instruction, o)
            except Exception as e:  # noqa: BLE001
                if getattr(e, "infra", False):  # e.g. the policy server stayed unreachable through its retries
                    raise HarnessError(f"step {i}: {e}") from e
                res.status, res.error = FAILURE, f"agent predict (step {i}): {type(e).__name__}: {e}"
                return
            t_model = (time.perf_counter() - t0) * 1000
            actions = list(actions or [])
            call = getattr(agent, "last_model_call", None)
            parse_error = call.get("parse_error") if isinstance(call, dict) else None
            rec = StepRecord(index=i, screenshot=png, a11y=obs.a11y, response=str(response), actions=actions,
                             action_error=f"parse error: {parse_error}" if parse_error else None,
                             t_model_ms=round(t_model, 1), t_env_ms=0.0, timestamp=_ts(),
                             model=call if isinstance(call, dict) else None)
            res.steps.append(rec)
            t1 = time.perf_counter()
            try:
                sr = await desk.step(actions or ["WAIT"], observe={"a11y": wants_a11y, "windows": False,
                                                                   "settle_s": settle_s,
                                                                   "cursor": False}, code_timeout=cfg.code_timeout_s)
            except FarmAPIError as e:
                if e.status in (400, 422):  # the agent sent something the desktop rejects: its failure
                    rec.action_error = f"{e.status}: {e.detail}"
                    if actions:
                        last = actions[-1]
                    continue
                raise HarnessError(f"step {i}: {e}") from e
            rec.t_env_ms = round((time.perf_counter() - t1) * 1000, 1)
            bad = [r for r in sr.results if not r.ok]
            if bad:
                rec.action_error = f"action {bad[0].index}: {bad[0].error}"
            if sr.observation is not None:
                obs = sr.observation
                rec.after_screenshot = _png(obs)
            if actions:
                last = actions[-1]
            done = sr.done or next((special_action(a) for a in actions
                                    if special_action(a) in ("DONE", "FAIL")), None)
            if done:
                last = {"action_type": done} if isinstance(last, dict) else done
                break
        res.last_action = last
        clock.lap("agent")
        if cfg.record and res.recording_error is None:
            try:
                res.recording = await asyncio.to_thread(controller.end_recording)
            except GuestError as e:
                res.recording_error = f"end_recording: {e}"
        try:
            setup.window_timeout = POSTCONFIG_WINDOW_S
            await asyncio.to_thread(setup.run, task.evaluator.postconfig)
        except SetupFailed as e:
            raise HarnessError(f"postconfig: {e}") from e
        res.score = await asyncio.to_thread(evaluate, task, controller, cache, cache_dir, screen, last, cfg.offline)
        res.status = SUCCESS if res.score == 1.0 else FAILURE
        clock.lap("evaluate")
    except GuestError as e:
        raise HarnessError(f"desktop unreachable: {e}") from e
    finally:
        controller.close()
        try:
            await desk.close()
        except FarmAPIError:
            pass


async def _predict(agent: Agent, instruction: str, obs: dict[str, Any]) -> tuple[str, list[Action]]:
    """An agent's ``apredict`` when it has one (awaited on this loop, no thread), else ``predict``
    in a worker thread."""
    apredict = getattr(agent, "apredict", None)
    if apredict is not None:
        return await apredict(instruction, obs)  # type: ignore[no-any-return]
    return await asyncio.to_thread(agent.predict, instruction, obs)


async def run_episode(farm: AsyncFarm, token: str, task: Task, agent: Agent, cache: FileCache,
                      cfg: EpisodeConfig, run_id: str) -> EpisodeResult:
    """Run ``task`` to a final status, retrying infra errors up to ``cfg.infra_retries`` times."""
    try:
        return await _run_attempts(farm, token, task, agent, cache, cfg, run_id)
    finally:
        aclose = getattr(agent, "aclose", None)  # agents holding connections (vlm) release them
        if aclose is not None:
            await aclose()


async def _run_attempts(farm: AsyncFarm, token: str, task: Task, agent: Agent, cache: FileCache,
                        cfg: EpisodeConfig, run_id: str) -> EpisodeResult:
    errors: list[str] = []
    attempt = 0
    while True:
        attempt += 1
        res = EpisodeResult(task=task, status=FAILURE, score=0.0, error=None,
                            episode_id=episode_id(run_id, task.id, attempt), attempt=attempt,
                            infra_retries=len(errors), steps=[], started_at=time.time(), finished_at=0.0,
                            agent=getattr(agent, "name", type(agent).__name__), errors=list(errors))
        try:
            await asyncio.wait_for(_attempt(farm, token, task, agent, cache, cfg, res), cfg.time_limit_s)
        except TimeoutError:
            res.status, res.score, res.error = TIMEOUT, 0.0, f"episode exceeded its {cfg.time_limit_s:g} s limit"
        except HarnessError as e:
            res.status, res.score, res.error = INFRA_ERROR, 0.0, str(e)
        except Exception as e:  # noqa: BLE001 - a harness bug: still a listed infra error, never a crash
            res.status, res.score = INFRA_ERROR, 0.0
            res.error = f"harness error: {type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"
        res.finished_at = time.time()
        if res.status != INFRA_ERROR or attempt > cfg.infra_retries:
            return res
        errors.append(f"attempt {attempt}: {res.error}")
