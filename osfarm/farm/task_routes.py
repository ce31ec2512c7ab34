"""OSWorld task routes on a leased desktop: ``reset`` (fresh desktop + the task's ``config``) and
``evaluate`` (``evaluator.postconfig``, the getters, the score).

``router`` is included by :func:`osfarm.farm.api.create_app`; the routes get the farm state and
the lease through :mod:`osfarm.farm.state`'s dependencies. Setup, postconfig and evaluation are
:mod:`osfarm.tasks.lifecycle`, the functions every episode runs (:class:`osfarm.env.TaskEnv`).
The guest calls go straight to the desktop's guest server with the synchronous
:class:`GuestController`, run in a worker thread so other leases keep going.

Errors answer ``{"detail": ...}`` like every farm route: a task that does not validate is 422
naming the JSON path (``body.task: $.evaluator.func: ...``), a setup step that needs a Google
account is 422, an offline asset that is not in the cache is 424 naming the URL, a failing setup
step is 502 naming its index, type and reason, a crashing getter or metric is 502 naming it.

The desktop itself is reset by :meth:`LeasePool.reset_lease` (the lease keeps its id and points
at the fresh box).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from osfarm.farm.errors import ApiError
from osfarm.farm.schemas import ErrorBody
from osfarm.farm.state import LeaseOf, State
from osfarm.tasks.controller import GuestController, GuestError
from osfarm.tasks.filecache import AssetMissing, FileCache
from osfarm.tasks.lifecycle import EvaluationError, TaskRun, run_postconfig, run_setup
from osfarm.tasks.lifecycle import evaluate as evaluate_task
from osfarm.tasks.model import Task, TaskError, parse_task
from osfarm.tasks.setup import SETUP_TYPES, UNSUPPORTED_TYPES, StepReport, SetupFailed, SetupUnsupported

log = logging.getLogger("osfarm.farm.task_routes")

GOOGLE = "needs a Google account (Google Drive / Google login), which an offline farm does not have"


class ResetRequest(BaseModel):
    task: dict[str, Any] = Field(description="an OSWorld task JSON object")
    cache_dir: str | None = Field(default=None, description="FileCache root for the task's files "
                                  "(OSWorld layout: <cache_dir>/<task_id>/...); a temporary one if unset")
    offline: bool = Field(default=True, description="never download: a file not in the cache is a 424")


class EvaluateRequest(BaseModel):
    task: dict[str, Any] = Field(description="an OSWorld task JSON object")
    last_action: str | dict[str, Any] | None = Field(default=None, description="the agent's last action "
                                                     "(\"FAIL\" or {\"action_type\": \"FAIL\"} for infeasible tasks)")
    cache_dir: str | None = Field(default=None, description="FileCache root for cloud_file getters")
    offline: bool = True


class StepInfo(BaseModel):
    index: int
    type: str
    ok: bool
    detail: str


class ResetReply(BaseModel):
    task_id: str
    steps: list[StepInfo]
    t_ms: float


class EvaluateReply(BaseModel):
    task_id: str
    score: float
    metrics: list[str] | None = None
    t_ms: float


_ERRORS = {404: {"model": ErrorBody}, 409: {"model": ErrorBody}, 410: {"model": ErrorBody},
           422: {"model": ErrorBody}, 424: {"model": ErrorBody}, 502: {"model": ErrorBody}}


def validate_task(data: dict[str, Any]) -> Task:
    """The task, or a 422 naming every bad JSON path; unsupported or unknown setup types included."""
    try:
        task = parse_task(data, file="body.task")
    except TaskError as e:
        raise ApiError(422, "; ".join(str(i) for i in e.issues)) from None
    for where, steps in (("config", task.config), ("evaluator.postconfig", task.evaluator.postconfig)):
        for i, step in enumerate(steps):
            if step.type in UNSUPPORTED_TYPES:
                raise ApiError(422, f"body.task: $.{where}[{i}].type: {step.type!r} {GOOGLE}")
            if step.type not in SETUP_TYPES:
                raise ApiError(422, f"body.task: $.{where}[{i}].type: unknown setup type {step.type!r}; "
                                    f"known: {', '.join(sorted(SETUP_TYPES))}")
    return task


def setup_error(e: SetupFailed, what: str = "setup") -> ApiError:
    if isinstance(e, SetupUnsupported):
        return ApiError(422, f"{what} step {e.index} ({e.type}) {GOOGLE}")
    if isinstance(e.__cause__, AssetMissing):
        return ApiError(424, f"{what} step {e.index} ({e.type}): {e.__cause__}")
    return ApiError(502, f"{what} step {e.index} ({e.type}) failed: {e.reason}")


class _Cache:
    """The request's FileCache; a temporary root (removed on close) when none is given."""

    def __init__(self, cache_dir: str | None, offline: bool):
        self.tmp = None if cache_dir else tempfile.mkdtemp(prefix="osfarm-task-")
        root = Path(cache_dir) if cache_dir else Path(self.tmp)  # type: ignore[arg-type]
        self.cache = FileCache(root, offline=offline)

    def close(self) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


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
    cache = _Cache(req.cache_dir, req.offline)
    controller = GuestController.from_endpoint(lease.endpoint)
    try:
        run = TaskRun(task, controller, cache.cache, lease.screen, offline=req.offline)
        try:
            reports = await asyncio.to_thread(run_setup, run)
        except SetupFailed as e:
            raise setup_error(e) from None
    finally:
        await asyncio.to_thread(controller.close)
        cache.close()
    return ResetReply(task_id=task.id, steps=_step_infos(reports), t_ms=round((time.perf_counter() - t0) * 1000, 1))


@router.post("/v1/desktops/{lease_id}/evaluate", response_model=EvaluateReply, responses=_ERRORS,
             summary="Run an OSWorld task's postconfig, getters and metric; the score")
async def evaluate(req: EvaluateRequest, lease: LeaseOf) -> EvaluateReply:
    task = validate_task(req.task)
    t0 = time.perf_counter()
    cache = _Cache(req.cache_dir, req.offline)
    work = tempfile.mkdtemp(prefix="osfarm-eval-")  # the getters' cache_dir, per call
    controller = GuestController.from_endpoint(lease.endpoint)
    try:
        run = TaskRun(task, controller, cache.cache, lease.screen, offline=req.offline, work_dir=Path(work))
        if task.evaluator.postconfig:
            try:
                await asyncio.to_thread(run_postconfig, run)
            except SetupFailed as e:
                raise setup_error(e, "postconfig") from None
        try:
            score = await asyncio.to_thread(evaluate_task, run, req.last_action)
        except EvaluationError as e:
            raise ApiError(502, str(e)) from None
        except GuestError as e:
            raise ApiError(502, f"evaluation: {e}") from None
    finally:
        await asyncio.to_thread(controller.close)
        cache.close()
        shutil.rmtree(work, ignore_errors=True)
    return EvaluateReply(task_id=task.id, score=score, metrics=task.evaluator.funcs,
                         t_ms=round((time.perf_counter() - t0) * 1000, 1))
