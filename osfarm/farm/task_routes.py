"""OSWorld task routes on a leased desktop: ``reset`` (fresh desktop + the task's ``config``) and
``evaluate`` (``evaluator.postconfig``, the getters, the score).

``router`` is included by :func:`osfarm.farm.api.create_app`; the routes get the farm state and
the lease through :mod:`osfarm.farm.state`'s dependencies. Setup, postconfig and evaluation are
:mod:`osfarm.tasks.lifecycle`, the functions every episode runs (:class:`osfarm.env.TaskEnv`).
The guest calls go straight to the desktop's guest server with the synchronous
:class:`GuestController`, run in a worker thread so other leases keep going.

Errors answer ``{"detail": ...}`` like every farm route: a task that does not validate, or names a
setup type, getter or metric this farm does not run, is 422 naming the JSON path
(``body.task: $.evaluator.func: ...``; the OpenAPI documents the task as
:class:`osfarm.farm.task_schema.FarmTask`), a setup step that needs a Google account is 422, an
offline asset that is not in the cache is 424 naming the URL, a failing setup step is 502 naming
its index, type and reason, a crashing getter or metric is 502 naming it.

The desktop itself is reset by :meth:`LeasePool.reset_lease` (the lease keeps its id and points
at the fresh box).

The API takes no host path: the task's files come from the server's file cache
(``task_cache_dir``, ``task_suite_dir``, ``task_offline`` settings; a request that still sends
``cache_dir`` or ``offline`` is a 422 naming the field), and what a task writes on the host
(``execute`` output, fetched files) goes to the lease's own episode folder
(``<state_dir>/episodes/<lease id>``, emptied at each reset, removed with the lease). A task whose
paths would leave those folders is a 422 naming the JSON path (:mod:`osfarm.tasks.task_paths`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any

import yaml
from fastapi import APIRouter
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from osfarm.config import FarmSettings
from osfarm.evaluators.errors import RuleError
from osfarm.farm.errors import ApiError
from osfarm.farm.state import LeaseOf, State
from osfarm.farm.task_schema import FarmTask, unknown_names
from osfarm.schema.service import ErrorBody
from osfarm.schema.task_run import EvaluateReply, ResetReply, StepInfo
from osfarm.tasks.controller import GuestController, GuestError
from osfarm.tasks.filecache import URL_MAP_NAMES, AssetMissing, FileCache, load_url_map
from osfarm.tasks.lifecycle import EvaluationError, TaskRun, run_postconfig, run_setup
from osfarm.tasks.lifecycle import evaluate as evaluate_task
from osfarm.tasks.model import Task, TaskError, parse_task
from osfarm.tasks.setup import (
    UNSUPPORTED_TYPES,
    SetupFailed,
    SetupUnsupported,
    StepReport,
)
from osfarm.tasks.task_paths import TaskPathError

log = logging.getLogger("osfarm.farm.task_routes")

GOOGLE = "needs a Google account (Google Drive / Google login), which an offline farm does not have"


# Request keys that were host paths / host policy once and are server settings now.
_SERVER_SETTINGS = {
    "cache_dir": "the task file cache is the server's task_cache_dir setting (OSFARM_TASK_CACHE_DIR)",
    "offline": "downloads are the server's task_offline setting (OSFARM_TASK_OFFLINE)",
}


def _as_sent(value: Any) -> Any:
    return value


def _refused(why: str) -> Any:
    """A key that was accepted once: documented, and no value is valid (422 naming it)."""

    def schema(field: dict[str, Any]) -> None:
        field.clear()
        field.update({"not": {}, "deprecated": True, "description": "not accepted (422): " + why})

    return Field(default=None, json_schema_extra=schema)


class _TaskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Documented as FarmTask (the task this farm can run); validated by validate_task, whose
    # errors name the JSON path inside the task.
    task: Annotated[dict[str, Any], BeforeValidator(_as_sent, json_schema_input_type=FarmTask)] = Field(
        description="an OSWorld task JSON object")
    cache_dir: Any = _refused("the farm takes no host path; " + _SERVER_SETTINGS["cache_dir"])
    offline: Any = _refused(_SERVER_SETTINGS["offline"])

    @field_validator("cache_dir", "offline", mode="before")
    @classmethod
    def _server_setting(cls, value: Any, info: Any) -> Any:
        raise PydanticCustomError("server_setting", "the farm API takes no host path or download policy from a "
                                  "request any more: {why}", {"why": _SERVER_SETTINGS[info.field_name]})


class ResetRequest(_TaskRequest):
    pass


class EvaluateRequest(_TaskRequest):
    last_action: str | dict[str, Any] | None = Field(default=None, description="the agent's last action "
                                                     "(\"FAIL\" or {\"action_type\": \"FAIL\"} for infeasible tasks)")


_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody}, 409: {"model": ErrorBody}, 410: {"model": ErrorBody},
    422: {"model": ErrorBody}, 424: {"model": ErrorBody}, 502: {"model": ErrorBody},
}


def validate_task(data: dict[str, Any]) -> Task:
    """The task, or a 422 naming every bad JSON path: unsupported or unknown setup types, unknown
    getters and metrics included."""
    try:
        task = parse_task(data, file="body.task")
    except TaskError as e:
        raise ApiError(422, "; ".join(str(i) for i in e.issues)) from None
    for where, steps in (("config", task.config), ("evaluator.postconfig", task.evaluator.postconfig)):
        for i, step in enumerate(steps):
            if step.type in UNSUPPORTED_TYPES:
                raise ApiError(422, f"body.task: $.{where}[{i}].type: {step.type!r} {GOOGLE}")
    unknown = unknown_names(task)
    if unknown:
        raise ApiError(422, "; ".join(f"body.task: {where}: {why}" for where, why in unknown))
    return task


def setup_error(e: SetupFailed, what: str = "setup") -> ApiError:
    if isinstance(e, SetupUnsupported):
        return ApiError(422, f"{what} step {e.index} ({e.type}) {GOOGLE}")
    if isinstance(e.__cause__, TaskPathError):  # the task names a host path it may not
        return ApiError(422, f"{what} step {e.index} ({e.type}): {e.reason}")
    if isinstance(e.__cause__, AssetMissing):
        return ApiError(424, f"{what} step {e.index} ({e.type}): {e.__cause__}")
    return ApiError(502, f"{what} step {e.index} ({e.type}) failed: {e.reason}")


def farm_cache(settings: FarmSettings) -> FileCache:
    """The server's task file cache (OSWorld layout, optional url map), made on demand."""
    root = settings.resolved_task_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    url_map: dict[str, str] = {}
    for name in URL_MAP_NAMES:
        if (root / name).is_file():
            try:
                url_map = load_url_map(root / name)
            except (OSError, TypeError, ValueError, yaml.YAMLError) as e:
                raise ApiError(503, f"the farm's task cache url map {root / name} is broken: {e}") from None
            break
    return FileCache(root, url_map, suite_dir=settings.task_suite_dir, offline=settings.task_offline)


def _step_infos(reports: list[StepReport]) -> list[StepInfo]:
    return [StepInfo(index=r.index, type=r.type, ok=r.ok, detail=r.detail) for r in reports]


router = APIRouter(tags=["tasks"])


@router.post("/v1/desktops/{lease_id}/reset", response_model=ResetReply, responses=_ERRORS,
             summary="Reset to a fresh desktop and run an OSWorld task's config steps")
async def reset_task(req: ResetRequest, lease: LeaseOf, state: State) -> ResetReply:
    task = validate_task(req.task)
    t0 = time.perf_counter()
    await state.drop_guest(lease.desktop_id)  # its connections go to the old box
    lease = await state.require_pool().reset_lease(lease.id)
    lease.task_id = task.id  # shown on the dashboard's pool page
    cache = farm_cache(state.settings)
    work = await asyncio.to_thread(state.episode_dir, lease.id, True)  # a fresh episode: nothing kept
    controller = GuestController.from_endpoint(lease.endpoint)
    try:
        run = TaskRun(task, controller, cache, lease.screen, offline=cache.offline, work_dir=work)
        try:
            reports = await asyncio.to_thread(run_setup, run)
        except SetupFailed as e:
            raise setup_error(e) from None
    finally:
        await asyncio.to_thread(controller.close)
    return ResetReply(task_id=task.id, steps=_step_infos(reports), t_ms=round((time.perf_counter() - t0) * 1000, 1))


@router.post("/v1/desktops/{lease_id}/evaluate", response_model=EvaluateReply, responses=_ERRORS,
             summary="Run an OSWorld task's postconfig, getters and metric; the score")
async def evaluate(req: EvaluateRequest, lease: LeaseOf, state: State) -> EvaluateReply:
    task = validate_task(req.task)
    t0 = time.perf_counter()
    cache = farm_cache(state.settings)
    # The getters' cache_dir: the episode's folder, where the setup's execute steps saved output.
    work = await asyncio.to_thread(state.episode_dir, lease.id, False)
    controller = GuestController.from_endpoint(lease.endpoint)
    try:
        run = TaskRun(task, controller, cache, lease.screen, offline=cache.offline, work_dir=work)
        if task.evaluator.postconfig:
            try:
                await asyncio.to_thread(run_postconfig, run)
            except SetupFailed as e:
                raise setup_error(e, "postconfig") from None
        try:
            score = await asyncio.to_thread(evaluate_task, run, req.last_action)
        except EvaluationError as e:
            if isinstance(e.__cause__, RuleError):  # the task's evaluator is wrong (e.g. a path it may not use)
                raise ApiError(422, str(e)) from None
            raise ApiError(502, str(e)) from None
        except GuestError as e:
            raise ApiError(502, f"evaluation: {e}") from None
    finally:
        await asyncio.to_thread(controller.close)
    return EvaluateReply(task_id=task.id, score=score, metrics=task.evaluator.funcs,
                         t_ms=round((time.perf_counter() - t0) * 1000, 1))
