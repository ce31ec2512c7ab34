"""Wire models of the farm's task routes' answers: ``POST /v1/desktops/{id}/reset`` (the task's
setup steps, as run) and ``.../evaluate`` (the score). Their requests carry OSWorld's task JSON,
documented from the task registries in :mod:`osfarm.farm.task_schema`."""

from __future__ import annotations

from pydantic import BaseModel


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
