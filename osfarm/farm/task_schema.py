"""The OSWorld task the farm's ``reset`` and ``evaluate`` routes take, as their OpenAPI states it.

A task file may name any setup type, getter or metric (:class:`osfarm.tasks.model.Task` is the file
format: it loads what OSWorld's runner loads); a farm runs only the ones it has. :class:`FarmTask`
is that task narrowed to this farm: the models of :mod:`osfarm.tasks.model` with the setup types,
getter types and metric names taken from the registries that run them (``SETUP_TYPES``,
``GETTERS``, ``METRICS``), the id as a plain name, and the evaluator in the three shapes OSWorld's
runner can evaluate (infeasible, one metric, a list of metrics). It documents the request; the
route validates with :func:`osfarm.tasks.model.parse_task` plus :func:`unknown_names`, whose errors
name the JSON path. ``tests/test_contract.py`` holds the two to each other with schemathesis.

What JSON Schema cannot state is left to the description and answered 422 naming the field: a
``result``/``expected``/``options`` list shorter than the ``func`` list it is aligned with, an id
over 255 bytes of UTF-8, and paths the task gives to host files (``dest``, ``stdout``, ...) that
would leave their folder.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema

from osfarm.evaluators.getters import GETTERS
from osfarm.evaluators.metrics import METRICS
from osfarm.tasks.model import ConfigStep, Evaluator, Getter, Task
from osfarm.tasks.setup import SETUP_TYPES

INFEASIBLE = "infeasible"


def _one_of(kind: str, names: Iterable[str]) -> WithJsonSchema:
    return WithJsonSchema({"type": "string", "enum": sorted(names), "description": f"a {kind} this farm runs"})


# Getters whose spec names a host file to read (cache_file's path, in the episode's folder)
PATH_GETTERS = ("cache_file",)
SetupTypeName = Annotated[str, _one_of("setup step type", SETUP_TYPES)]
GetterName = Annotated[str, _one_of("getter", set(GETTERS) - set(PATH_GETTERS))]
MetricName = Annotated[str, _one_of("metric", METRICS)]
# plain_name_problem (osfarm.tasks.task_paths): no slash, backslash or NUL, not '.' or '..', at most
# 255 bytes of UTF-8 (the schema can count characters only)
TaskId = Annotated[str, WithJsonSchema({
    "type": "string", "minLength": 1, "maxLength": 255, "pattern": r"^(?!\.\.?$)[^/\\\u0000]+$",
    "description": "the task's id: a plain name (it names folders on the host), at most 255 bytes of UTF-8"})]


# relative_problem (osfarm.tasks.task_paths): a file inside the episode's folder: not absolute, not
# ~, no NUL, no '..' component, some component other than '.'; each at most 255 bytes of UTF-8
RelativePath = Annotated[str, WithJsonSchema({
    "type": "string", "minLength": 1,
    "pattern": r"^(?![/~])(?!(?:\.?/)*\.?$)(?!(?:[\s\S]*/)?\.\.(?:/|$))[^\u0000]+$",
    "description": "a file inside the episode's folder: a relative path without '..'"})]


def _absent(schema: dict[str, Any]) -> None:
    """A field that may be left out but is not null when given: no ``default`` in the schema."""
    schema.pop("default", None)


class FarmConfigStep(ConfigStep):
    type: SetupTypeName


class FarmGetter(Getter):
    type: GetterName
    dest: RelativePath | list[RelativePath] | None = Field(
        default=None, description="the name(s) a fetched file is saved under, in the episode's folder")


class CacheFileGetter(FarmGetter):
    """``cache_file``: a file the task's setup saved in the episode's folder."""

    type: Literal["cache_file"]
    path: RelativePath


AnyGetter = FarmGetter | CacheFileGetter


class _FarmEvaluator(Evaluator):
    postconfig: list[FarmConfigStep] = Field(default_factory=list)  # type: ignore[assignment]


class InfeasibleEvaluator(_FarmEvaluator):
    """``func: "infeasible"``: scored 1 when the agent's last action is FAIL."""

    func: Literal["infeasible"]
    result: AnyGetter | None = None
    expected: AnyGetter | None = None
    options: dict[str, Any] | None = None


class MetricEvaluator(_FarmEvaluator):
    """One metric over the ``result`` getter's state (and ``expected``'s, when given)."""

    func: MetricName
    result: AnyGetter
    expected: AnyGetter | None = None
    options: dict[str, Any] | None = None


class MetricsEvaluator(_FarmEvaluator):
    """A list of metrics combined by ``conj``; ``result``, ``expected`` and ``options`` are lists
    aligned with it (entry i for metric i), each at least as long as ``func``."""

    func: list[MetricName] = Field(min_length=1)
    result: list[AnyGetter]
    # None is "left out": an explicit null is refused and the schema shows no default (_absent),
    # which a `| None` annotation would undo; so the default does not match the annotation
    expected: list[AnyGetter | None] = Field(default=None, json_schema_extra=_absent)  # type: ignore[arg-type]
    options: list[dict[str, Any] | None] = Field(default=None, json_schema_extra=_absent)  # type: ignore[arg-type]


class FarmTask(Task):
    """An OSWorld task (``evaluation_examples/examples/<domain>/<id>.json``) this farm can run."""

    id: TaskId
    config: list[FarmConfigStep] = Field(default_factory=list)  # type: ignore[assignment]
    evaluator: InfeasibleEvaluator | MetricEvaluator | MetricsEvaluator


def unknown_names(task: Task) -> list[tuple[str, str]]:
    """``(JSON path, problem)`` for every setup type, getter or metric of a parsed task that this
    farm does not run (what :class:`FarmTask` narrows and :class:`Task` does not)."""
    out: list[tuple[str, str]] = []
    for where, steps in (("$.config", task.config), ("$.evaluator.postconfig", task.evaluator.postconfig)):
        for i, step in enumerate(steps):
            if step.type not in SETUP_TYPES:
                out.append((f"{where}[{i}].type", f"unknown setup type {step.type!r}; known: "
                                                  + ", ".join(sorted(SETUP_TYPES))))
    ev = task.evaluator
    if not ev.is_infeasible:
        funcs = ev.func if isinstance(ev.func, list) else [ev.func]
        for i, func in enumerate(funcs):
            if func not in METRICS:
                where = f"$.evaluator.func[{i}]" if isinstance(ev.func, list) else "$.evaluator.func"
                out.append((where, f"unknown metric {func!r}" + (" (infeasible is a func of its own, not one of "
                                                                 "a list)" if func == INFEASIBLE else "")))
    for name in ("result", "expected"):
        specs = getattr(ev, name)
        for i, spec in enumerate(specs if isinstance(specs, list) else [specs]):
            if spec is not None and spec.type not in GETTERS:
                where = f"$.evaluator.{name}" + (f"[{i}]" if isinstance(specs, list) else "")
                out.append((f"{where}.type", f"unknown getter {spec.type!r}"))
    return out
