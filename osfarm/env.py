"""``TaskEnv``: the one lifecycle of an OSWorld task on a farm desktop, shaped like a Gymnasium env.

::

    async with TaskEnv("http://127.0.0.1:8765", token, max_steps=15) as env:
        obs, info = await env.reset(task)                  # lease a fresh desktop, run the task's setup
        while True:
            actions = my_policy(obs.screenshot, obs.instruction)
            obs, reward, terminated, truncated, info = await env.step(actions)
            if terminated or truncated:
                break                                      # reward is the OSWorld score now

The lifecycle is lease → setup → step* → postconfig → evaluate:

* :meth:`TaskEnv.reset` leases a fresh desktop (releasing the previous one, which the farm's pool
  resets in the background), runs the task's ``config`` steps and returns the first
  :class:`~osfarm.schema.observation.AgentObservation`;
* :meth:`TaskEnv.step` sends one step's actions (a list, or one action: typed
  actions (:mod:`osfarm.schema.actions`), pyautogui code strings or computer_13 dicts;
  ``WAIT``/``DONE``/``FAIL`` as OSWorld) and returns
  ``(observation, reward, terminated, truncated, info)``. The reward is 0.0 until the episode
  ends, then the task's score in [0, 1]. ``DONE`` or ``FAIL`` *terminates* the episode;
  ``max_steps`` steps *truncate* it; both run the evaluation (postconfig, getters, metric) before
  ``step`` returns. Running out of ``time_limit_s`` also truncates, without a score
  (``info["time_limit"]`` is True, the reward 0.0);
* :meth:`TaskEnv.evaluate` ends the episode now and returns the score (the score again once ended);
* :meth:`TaskEnv.close` releases the desktop; ``async with`` does it for you.

Failures are sorted, as the benchmark needs them: anything the harness did not get right (no
desktop, a setup step failed, the desktop died, a getter or metric crashed) raises
:class:`InfraError`; an action the desktop rejects (400/422: the agent's fault) or one that fails
while running is no exception but ``info["action_error"]``, and the episode goes on.
:class:`SyncTaskEnv` is the same env for code without an event loop.

The setup, postconfig and evaluation steps are :mod:`osfarm.tasks.lifecycle`, the same functions
the farm's task routes call. They talk to the desktop's guest through the farm's passthrough
(``/v1/desktops/{lease}/guest``) with the blocking :class:`GuestController`, in worker threads,
so episodes on other desktops go on meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import tempfile
import threading
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, Literal, Self, TypeVar, get_args

from pydantic import BaseModel, Field

from osfarm.client import AsyncFarm, AsyncRemoteDesktop, FarmAPIError
from osfarm.errors import EpisodeTimeout, InfraError
from osfarm.schema.actions import ENDINGS, AgentAction, action_json, special_action
from osfarm.schema.guest import DEFAULT_ACTION_TIMING, ActionResult, ActionTiming
from osfarm.schema.lease import ControlInfo, LeaseInfo
from osfarm.schema.observation import AgentObservation
from osfarm.tasks.controller import GuestController, GuestError
from osfarm.tasks.filecache import FileCache
from osfarm.tasks.lifecycle import EvaluationError, TaskRun, evaluate, run_postconfig, run_setup
from osfarm.tasks.model import Task, parse_task
from osfarm.tasks.setup import SetupFailed, StepReport

# The observation should show the screen after the apps have drawn the effect of the input: wait
# for the screen to stop changing and the apps to go idle (at most this long) instead of OSWorld's
# fixed 2 s pause. Agents say how long they want (``Agent.settle_s``).
SETTLE_S = 1.0

# The action vocabulary is osfarm.schema.actions': a step takes AgentActions (typed Actions, or
# OSWorld's code strings and computer_13 dicts).


# ---- errors ----------------------------------------------------------------------------------


# InfraError (the harness failed: infra_error) and EpisodeTimeout (the time limit ran out: timeout)
# are osfarm's, in osfarm.errors; exported here, where the env raises them.


# ---- what a step did -------------------------------------------------------------------------


class StepOutcome(BaseModel):
    """What the desktop made of one step (also ``step``'s ``info``, as a dict).

    Kept on :attr:`TaskEnv.last_step` as soon as the desktop has answered, so a caller still has
    it when the evaluation that ends the episode then fails.
    """

    index: int = Field(description="1-based step number (OSWorld's step_num)")
    actions: list[str | dict[str, Any]] = Field(description="what was sent, as JSON carries it (WAIT for an "
                                                "empty step)")
    results: list[ActionResult] = Field(default_factory=list)
    action_error: str | None = Field(default=None, description="the desktop rejected the actions (400/422) "
                                     "or one failed while running: the agent's fault")
    rejected: bool = Field(default=False, description="the desktop refused the request; nothing ran")
    done: Literal["DONE", "FAIL"] | None = None
    observation: AgentObservation | None = Field(default=None,
                                                 description="the screen after the step (None if rejected)")
    t_env_ms: float | None = Field(default=None, description="the step's round trip (None if rejected)")
    time_limit: bool = False


class DesktopUsage(BaseModel):
    """What an episode's desktop cost, as its lease said when it was released."""

    cpu_s: float | None = Field(default=None, description="CPU-seconds since the lease was granted (its processes, "
                                "resets in place excluded); None where the provider cannot tell")
    reset: str | None = Field(default=None, description="how the desktop was made ready: warm, cold or start")
    reset_fallback: str | None = Field(default=None, description="a cold reset where a warm one was meant: why")

    def clear(self) -> None:
        self.cpu_s = self.reset = self.reset_fallback = None


def _desktop_info(lease: LeaseInfo) -> dict[str, Any]:
    """The desktop as ``reset``'s info names it (Gymnasium's info is a dict)."""
    return {"provider": lease.provider, "image": lease.image, "session": lease.desktop,
            "desktop_id": lease.desktop_id, "lease_id": lease.id}


# (observation, reward, terminated, truncated, info), as Gymnasium's step answers
StepAnswer = tuple[AgentObservation, float, bool, bool, dict[str, Any]]


# ---- the env ---------------------------------------------------------------------------------


class _PhaseClock:
    """Writes the seconds since the previous lap into ``into[name]``."""

    def __init__(self, into: dict[str, float]):
        self.into = into
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = round(now - self.t, 3)
        self.t = now


class TaskEnv:
    """One OSWorld task at a time on a leased farm desktop (async; see the module docstring).

    Args:
        farm: an :class:`osfarm.client.AsyncFarm` (not closed by the env) or the farm's URL.
        token: the farm's token, when ``farm`` is a URL (default ``OSFARM_TOKEN``).
        max_steps: steps after which the episode is truncated (and evaluated).
        time_limit_s: wall clock from ``reset`` to the score; None for none.
        cache: where the task's files come from (downloads, ``cloud_file`` getters); default an
            empty offline cache in a temporary folder.
        work_dir: the episode's folder for the files getters fetch and ``execute`` steps write;
            default a fresh temporary folder per episode, removed by ``close``.
        offline: never download a task file that is not in ``cache``.
        a11y: observations carry the accessibility tree.
        settle_s: how long an observation may wait for the screen to settle.
        record: record the screen from the first observation to the end of the agent's part
            (an mp4 in :attr:`recording`; a failure to record is :attr:`recording_error`, never
            the episode's).
        lease_ttl_s, lease_wait_s: the lease's time-to-live (kept alive by heartbeats) and how
            long ``reset`` waits for a free desktop.
        code_timeout_s: the limit of each pyautogui code action.
        action_timing: ``"settle"`` (default): OSWorld's semantics (nothing kept between code
            actions, pyautogui's defaults), each of pyautogui's 0.1 s pauses cut short once the
            screen answered the input; ``"osworld"``: paced exactly as OSWorld paces them (each code
            action in a new interpreter, the whole pause after every call); ``"fast"``: one kept
            interpreter, no pause, the observation waits for the screen to settle instead.

    After ``reset``: :attr:`task`, :attr:`desktop` (the :class:`~osfarm.schema.lease.LeaseInfo`:
    provider, image, session, desktop and lease ids), :attr:`observation`, :attr:`steps`,
    :attr:`last_action`, :attr:`timings` (seconds per phase: ``lease``, ``setup``, then ``agent``
    and ``evaluate`` once the episode ended); once the desktop is released, :attr:`controlled_by`
    and :attr:`desktop_usage`.
    """

    def __init__(self, farm: AsyncFarm | str, token: str | None = None, *, max_steps: int = 15,
                 time_limit_s: float | None = None, cache: FileCache | None = None, work_dir: Path | None = None,
                 offline: bool = True, a11y: bool = False, settle_s: float = SETTLE_S, record: bool = False,
                 lease_ttl_s: float = 120.0, lease_wait_s: float = 120.0, code_timeout_s: float = 30.0,
                 action_timing: ActionTiming = DEFAULT_ACTION_TIMING):
        if max_steps < 1:
            raise ValueError(f"max_steps: expected >= 1, got {max_steps}")
        if action_timing not in get_args(ActionTiming):
            raise ValueError(f"action_timing: expected one of {get_args(ActionTiming)}, got {action_timing!r}")
        self.action_timing: ActionTiming = action_timing
        if isinstance(farm, AsyncFarm):
            self.farm, self._own_farm = farm, False
        else:
            self.farm, self._own_farm = AsyncFarm(farm, token), True
        self.max_steps = max_steps
        self.time_limit_s = time_limit_s
        self.offline = offline
        self.a11y = a11y
        self.settle_s = settle_s
        self.record = record
        self.lease_ttl_s = lease_ttl_s
        self.lease_wait_s = lease_wait_s
        self.code_timeout_s = code_timeout_s
        self._tmp: Path | None = None  # our temporary folder (default cache and work dirs), removed on close
        self.cache = cache if cache is not None else FileCache(self._scratch() / "cache", offline=offline)
        self._work_dir = work_dir
        self._desk: AsyncRemoteDesktop | None = None
        self._controller: GuestController | None = None
        self._run: TaskRun | None = None
        self._deadline: float | None = None
        self._clock: _PhaseClock | None = None
        self._closed = False
        self._ended = False
        self._timed_out = False
        self.task: Task | None = None
        self.desktop: LeaseInfo | None = None  # the lease the episode's desktop was granted on
        self.observation: AgentObservation | None = None
        self.steps = 0
        self.last_action: Any = None
        self.last_step: StepOutcome | None = None
        self.score: float | None = None
        self.timings: dict[str, float] = {}
        self.recording: bytes | None = None
        self.recording_error: str | None = None
        # people who took control of the desktop from the dashboard during this episode (the
        # lease's control spans, read when the desktop is released): the score had human help
        self.controlled_by: list[ControlInfo] = []
        # what the episode's desktop cost, read when it is released (one object, filled in place)
        self.desktop_usage = DesktopUsage()

    # -- gymnasium surface ---------------------------------------------------------------------

    async def reset(self, task: Task | dict[str, Any]) -> tuple[AgentObservation, dict[str, Any]]:
        """Start ``task`` on a fresh desktop; the first observation and ``info``
        (``task_id``, ``desktop``, ``setup``: the setup steps' reports, ``timings``).

        Raises InfraError (no desktop, a failed setup step, no observation) or EpisodeTimeout.
        """
        if self._closed:
            raise RuntimeError("this TaskEnv is closed")
        task = task if isinstance(task, Task) else parse_task(task, file="task")
        await self._release()
        self.controlled_by.clear()
        self.desktop_usage.clear()
        self.task, self.steps, self.last_action, self.last_step = task, 0, None, None
        self.score, self._ended, self._timed_out = None, False, False
        self.timings = {}
        self.recording = self.recording_error = None
        self.desktop = None
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + self.time_limit_s if self.time_limit_s is not None else None
        self._clock = _PhaseClock(self.timings)
        try:
            async with asyncio.timeout_at(self._deadline):
                reports = await self._start(task)
        except TimeoutError:
            raise EpisodeTimeout(f"episode exceeded its {self.time_limit_s:g} s limit") from None
        assert self.observation is not None
        assert self.desktop is not None
        return self.observation, {"task_id": task.id, "desktop": _desktop_info(self.desktop),
                                  "action_timing": self.action_timing,
                                  "setup": [dataclasses.asdict(r) for r in reports], "timings": dict(self.timings)}

    async def step(self, actions: AgentAction | Sequence[AgentAction]) -> StepAnswer:
        """Run one step's actions in order; ``(observation, reward, terminated, truncated, info)``.

        ``info`` is :class:`StepOutcome` as a dict, plus ``score`` once the episode ended.
        Raises InfraError when the harness fails (the farm, the desktop, the evaluation).
        """
        desk, obs = self._desk, self.observation
        if desk is None or obs is None:
            raise RuntimeError("call reset(task) before step()")
        if self._ended:
            raise RuntimeError("the episode has ended: call reset(task) to start another")
        batch = [action_json(a) for a in ([actions] if isinstance(actions, (str, dict, BaseModel)) else actions)]
        self.steps += 1
        i = self.steps
        out = StepOutcome(index=i, actions=batch or ["WAIT"])
        self.last_step = out
        t1 = time.perf_counter()
        try:
            async with asyncio.timeout_at(self._deadline):
                sr = await desk.step(out.actions, code_timeout=self.code_timeout_s, timing=self.action_timing, observe={
                    "a11y": self.a11y, "windows": False, "settle_s": self.settle_s, "cursor": False})
        except TimeoutError:
            return self._out_of_time(out)
        except FarmAPIError as e:
            if e.status not in (400, 422):
                raise InfraError(f"step {i}: {e}", phase="step") from e
            # the agent sent something the desktop rejects: its failure, and the episode goes on
            out.rejected, out.action_error = True, f"{e.status}: {e.detail}"
            if batch:
                self.last_action = batch[-1]
            truncated = self.steps >= self.max_steps
            reward = await self._finish(out) if truncated else 0.0
            return self._answer(out, obs, reward, False, truncated)
        out.t_env_ms = round((time.perf_counter() - t1) * 1000, 1)
        out.results = sr.results
        bad = [r for r in sr.results if not r.ok]
        if bad:
            out.action_error = f"action {bad[0].index}: {bad[0].error}"
        if sr.observation is not None:
            obs = self.observation = out.observation = AgentObservation.from_wire(sr.observation, obs.instruction)
        if batch:
            self.last_action = batch[-1]
        # the guest stops at the first failing action, so a DONE after it is looked for here too
        done = sr.done or next((s for s in map(special_action, batch) if s in ENDINGS), None)
        if done:
            out.done = done
            self.last_action = {"action_type": done} if isinstance(self.last_action, dict) else done
        terminated = done is not None
        truncated = not terminated and self.steps >= self.max_steps
        reward = await self._finish(out) if terminated or truncated else 0.0
        if out.time_limit:
            terminated, truncated = False, True
        return self._answer(out, obs, reward, terminated, truncated)

    async def evaluate(self) -> float:
        """End the episode (if still running) and score it: postconfig, getters, metric.

        Raises InfraError if the evaluation fails, EpisodeTimeout if the time limit ran out.
        """
        if self._run is None:
            raise RuntimeError("call reset(task) before evaluate()")
        if self._timed_out:
            raise EpisodeTimeout(f"episode exceeded its {self.time_limit_s:g} s limit")
        if self.score is None:
            await self._finish(None)
            if self._timed_out:
                raise EpisodeTimeout(f"episode exceeded its {self.time_limit_s:g} s limit")
        assert self.score is not None
        return self.score

    async def close(self) -> None:
        """Release the desktop and what the env holds (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._release()
        finally:
            if self._own_farm:
                await self.farm.close()
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the lifecycle -------------------------------------------------------------------------

    async def _start(self, task: Task) -> list[StepReport]:
        assert self._clock is not None
        try:
            desk = await self.farm.lease(ttl_s=self.lease_ttl_s, wait_s=self.lease_wait_s, heartbeat=True,
                                         task_id=task.id)
        except FarmAPIError as e:
            raise InfraError(f"lease: {e}", phase="lease") from e
        self._desk = desk
        self.desktop = desk.info
        self._clock.lap("lease")
        self._controller = GuestController(base_url=f"{self.farm.url}/v1/desktops/{desk.id}/guest",
                                           token=self.farm.token)
        work = self._work_dir if self._work_dir is not None else Path(tempfile.mkdtemp(dir=self._scratch()))
        self._run = TaskRun(task, self._controller, self.cache, desk.screen, offline=self.offline, work_dir=work)
        try:
            reports = await asyncio.to_thread(run_setup, self._run)
        except SetupFailed as e:
            raise InfraError(str(e), phase="setup") from e
        self._clock.lap("setup")
        if self.record:
            try:
                await asyncio.to_thread(self._controller.start_recording)
            except GuestError as e:
                self.recording_error = f"start_recording: {e}"
        try:
            raw = await desk.observe(a11y=self.a11y, windows=False, cursor=False, settle_s=self.settle_s)
        except FarmAPIError as e:
            raise InfraError(f"observe: {e}", phase="observe") from e
        self.observation = AgentObservation.from_wire(raw, task.instruction)
        return reports

    async def _finish(self, out: StepOutcome | None) -> float:
        """The end of the episode: stop recording, postconfig, evaluation; the score (0.0 and
        ``time_limit`` on ``out`` when the time runs out meanwhile)."""
        assert self._run is not None and self._controller is not None and self._clock is not None
        self._ended = True
        if "agent" not in self.timings:  # (a retried evaluation keeps the agent's time)
            self._clock.lap("agent")
        try:
            async with asyncio.timeout_at(self._deadline):
                score = await self._evaluate(self._run, self._controller)
        except TimeoutError:
            self._timed_out = True
            if out is not None:
                out.time_limit = True
            return 0.0
        self.score = score
        self._clock.lap("evaluate")
        return score

    async def _evaluate(self, run: TaskRun, controller: GuestController) -> float:
        if self.record and self.recording_error is None:
            try:
                self.recording = await asyncio.to_thread(controller.end_recording)
            except GuestError as e:
                self.recording_error = f"end_recording: {e}"
        try:
            await asyncio.to_thread(run_postconfig, run)
        except SetupFailed as e:
            raise InfraError(f"postconfig: {e}", phase="evaluate") from e
        try:
            return await asyncio.to_thread(evaluate, run, self.last_action)
        except EvaluationError as e:
            raise InfraError(str(e), phase="evaluate") from e
        except GuestError as e:
            raise InfraError(f"desktop unreachable: {e}", phase="evaluate") from e

    def _out_of_time(self, out: StepOutcome) -> StepAnswer:
        self._ended = self._timed_out = out.time_limit = True
        assert self.observation is not None
        return self._answer(out, self.observation, 0.0, False, True)

    def _answer(self, out: StepOutcome, obs: AgentObservation, reward: float, terminated: bool,
                truncated: bool) -> StepAnswer:
        info = out.model_dump(exclude={"observation"})
        if self.score is not None:
            info["score"] = self.score
        return obs, reward, terminated, truncated, info

    async def _release(self) -> None:
        controller, desk = self._controller, self._desk
        self._controller = self._desk = None
        self._run = None
        if controller is not None:
            controller.close()
        if desk is not None:
            with contextlib.suppress(FarmAPIError):
                info = await desk.heartbeat()  # the lease's latest info: who took control, if anyone
                self.controlled_by[:] = info.control
                usage = self.desktop_usage
                usage.cpu_s, usage.reset, usage.reset_fallback = info.cpu_s, info.reset_mode, info.reset_fallback
            with contextlib.suppress(FarmAPIError):
                await desk.close()

    def _scratch(self) -> Path:
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="osfarm-env-"))
        return self._tmp


# ---- the blocking twin -----------------------------------------------------------------------

T = TypeVar("T")


class SyncTaskEnv:
    """:class:`TaskEnv` for code without an event loop: the same methods, blocking.

    The async env lives on a private event loop in a daemon thread (its heartbeats keep running
    between calls); every method hands its coroutine to that loop and waits. ``close()`` (or the
    ``with`` block) stops the thread. Arguments are :class:`TaskEnv`'s; ``farm`` is the URL.
    """

    def __init__(self, farm: str | None = None, token: str | None = None, **options: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="osfarm-taskenv", daemon=True)
        self._thread.start()

        async def make() -> TaskEnv:  # made on its loop: its HTTP client belongs there
            return TaskEnv(AsyncFarm(farm, token), **options)

        try:
            self.env = self._call(make())
        except BaseException:
            self._stop()
            raise
        self.env._own_farm = True

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this SyncTaskEnv is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the env's loop and wait for it (for wrappers that add calls of their own:
        the OSWorld drop-in, ``osfarm.osworld``)."""
        return self._call(coro)

    def reset(self, task: Task | dict[str, Any]) -> tuple[AgentObservation, dict[str, Any]]:
        return self._call(self.env.reset(task))

    def step(self, actions: AgentAction | Sequence[AgentAction]) -> StepAnswer:
        return self._call(self.env.step(actions))

    def evaluate(self) -> float:
        return self._call(self.env.evaluate())

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self._call(self.env.close())
            finally:
                self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __getattr__(self, name: str) -> Any:
        # task, desktop, observation, steps, score, timings, ...: the async env's state
        env = self.__dict__.get("env")
        if env is None:
            raise AttributeError(name)
        return getattr(env, name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "SETTLE_S", "EpisodeTimeout", "InfraError", "StepAnswer", "StepOutcome", "SyncTaskEnv", "TaskEnv",
]  # fmt: skip
