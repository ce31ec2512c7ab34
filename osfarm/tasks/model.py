"""OSWorld task JSON as typed pydantic views that keep every byte of meaning.

A task file is loaded unchanged: unknown keys are kept (``extra="allow"``), values are not
coerced (``strict=True``, so ``"false"`` never silently becomes ``False``), and the original key
order is remembered so ``Task.to_json()`` gives back the same JSON document, key for key.

Problems are reported as :class:`Issue` values naming the file and a JSON path
(``tasks/calc/abc.json: $.evaluator.result[1]: ...``) or, for text that is not JSON at all, the
file, line and column (``tasks/calc/abc.json:3:7: invalid JSON: ...``).

What is refused follows OSWorld's runner (``DesktopEnv``): a task loads wherever OSWorld's runner
can run it. Keys OSWorld never reads (``source``, ``trajectory``, ``related_apps``, ``snapshot``,
``fixed_ip``, ``possibility_of_env_change``, ...) may hold any JSON value (``source`` is a list in
one published task); ``proxy`` is read by truthiness, as OSWorld does, with a warning when it is
not a boolean. A ``func`` list shorter than its ``result``/``expected``/``options`` lists runs as
OSWorld's ``evaluate`` indexes it (metric ``i`` gets entry ``i``; the extra entries are never
evaluated), with a warning: OSWorld's ``_set_evaluator_info`` asserts equal lengths, so OSWorld
itself errors on such a task at reset. Shapes OSWorld's runner cannot evaluate (a list shorter
than ``func``, a list beside a single ``func``) are refused. Warnings are :class:`Issue` values
too, in ``Task.warnings``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    model_serializer,
    model_validator,
)

from osfarm.errors import OsfarmError
from osfarm.tasks.task_paths import task_path_problems

# ---- errors -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Issue:
    """One problem in one file: either at a JSON path, or at a text position (bad JSON)."""

    file: str
    message: str
    path: str = "$"
    line: int | None = None
    col: int | None = None

    def __str__(self) -> str:
        if self.line is not None:
            return f"{self.file}:{self.line}:{self.col}: {self.message}"
        return f"{self.file}: {self.path}: {self.message}"


class TaskError(OsfarmError):
    """Raised when one or more task (or index) files are invalid; ``issues`` lists them all."""

    def __init__(self, issues: list[Issue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


def json_path(loc: tuple[int | str, ...]) -> str:
    """``("evaluator", "result", 1)`` -> ``$.evaluator.result[1]``; union branch labels dropped."""
    out = "$"
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith("="):  # our discriminator tags (see _one_or_many), not JSON keys
            continue
        else:
            out += f".{part}"
    return out


# ---- base model -------------------------------------------------------------------------------


class OpenModel(BaseModel):
    """Keeps unknown keys, refuses type coercion, and dumps keys in the order they were read."""

    model_config = ConfigDict(extra="allow", strict=True, validate_assignment=False)
    _key_order: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_order(cls, data: Any, handler: Any) -> Any:
        inst = handler(data)
        if isinstance(data, dict):
            inst._key_order = list(data)
        return inst

    @model_serializer(mode="wrap")
    def _dump_in_order(self, handler: Any) -> dict[str, Any]:
        d = handler(self)
        order = [k for k in self._key_order if k in d] + [k for k in d if k not in self._key_order]
        return {k: d[k] for k in order}

    def to_json(self) -> dict[str, Any]:
        """The JSON object this model was read from (plus any fields set since)."""
        return self.model_dump(exclude_unset=True)


def _one_or_many(one: Any, many: Any) -> Any:
    """``one | list[...]`` told apart by shape, so errors carry no union noise in their path."""
    return Annotated[
        Annotated[one, Tag("=one")] | Annotated[many, Tag("=many")],
        Discriminator(lambda v: "=many" if isinstance(v, list) else "=one"),
    ]


# ---- typed views ------------------------------------------------------------------------------


class ConfigStep(OpenModel):
    """A setup step in ``config`` or ``evaluator.postconfig``: ``{"type": T, "parameters": {...}}``."""

    type: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class Getter(OpenModel):
    """A getter spec (``evaluator.result`` / ``expected`` entry); ``type`` picks ``get_<type>``."""

    type: str


class Evaluator(OpenModel):
    """``func`` may be a list; then result/expected/options are index-aligned lists."""

    func: _one_or_many(str, list[str])  # type: ignore[valid-type]
    result: _one_or_many(Getter, list[Getter]) | None = None  # type: ignore[valid-type]
    expected: _one_or_many(Getter, list[Getter | None]) | None = None  # type: ignore[valid-type]
    options: _one_or_many(dict[str, Any], list[dict[str, Any] | None]) | None = None  # type: ignore[valid-type]
    postconfig: list[ConfigStep] = Field(default_factory=list)
    conj: Literal["and", "or"] = "and"

    @property
    def funcs(self) -> list[str]:
        return self.func if isinstance(self.func, list) else [self.func]

    @property
    def is_infeasible(self) -> bool:
        return self.func == "infeasible"

    def getters(self) -> list[Getter]:
        """Every result and expected getter spec that is evaluated (nulls and entries past a
        ``func`` list skipped)."""
        out: list[Getter] = []
        for g in (self.aligned("result"), self.aligned("expected")):
            if isinstance(g, list):
                out.extend(x for x in g if x is not None)
            elif g is not None:
                out.append(g)
        return out

    def aligned(self, name: str) -> Any:
        """``result``/``expected``/``options`` as OSWorld's ``evaluate`` reads them: with a ``func``
        list, only the first ``len(func)`` entries (metric ``i`` gets entry ``i``)."""
        value = getattr(self, name)
        if isinstance(self.func, list) and isinstance(value, list):
            return value[: len(self.func)]
        return value

    def alignment_issues(self) -> list[tuple[str, str]]:
        """(json path, message) for breaches of OSWorld's index-aligned list rule that OSWorld's
        runner cannot evaluate (see :meth:`alignment_warnings` for the ones it can)."""
        found: list[tuple[str, str]] = []
        fields = self.model_fields_set
        if isinstance(self.func, list):
            n = len(self.func)
            if n == 0:
                found.append(("$.evaluator.func", "func list is empty"))
            for name, required in (("result", True), ("expected", False), ("options", False)):
                value = getattr(self, name)
                if name not in fields:
                    if required:
                        found.append((f"$.evaluator.{name}", f"missing; func is a list of {n}"))
                    continue
                if not isinstance(value, list):
                    found.append((f"$.evaluator.{name}", f"must be a list of {n} (func is a list), got {_kind(value)}"))
                elif len(value) < n:
                    found.append((f"$.evaluator.{name}", f"has {len(value)} entries but func has {n}"))
        else:
            for name in ("result", "expected", "options"):
                if isinstance(getattr(self, name), list):
                    found.append((f"$.evaluator.{name}", "is a list but func is a single name"))
            if not self.is_infeasible and self.result is None:
                found.append(("$.evaluator.result", f"missing; metric {self.func!r} needs a result getter"))
        return found

    def alignment_warnings(self) -> list[tuple[str, str]]:
        """(json path, message) for lists longer than a ``func`` list: OSWorld's ``evaluate``
        indexes them by metric, so their extra entries are never evaluated."""
        found: list[tuple[str, str]] = []
        if not isinstance(self.func, list):
            return found
        n = len(self.func)
        for name in ("result", "expected", "options"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) > n:
                extra = f"[{n}]" if len(value) == n + 1 else f"[{n}:{len(value)}]"
                found.append((f"$.evaluator.{name}{extra}",
                              f"has {len(value)} entries but func has {n}: entries past {n} are never evaluated "
                              f"(OSWorld's evaluate indexes by metric; its DesktopEnv asserts equal lengths and "
                              f"errors on this task at reset)"))
        return found


def _kind(v: Any) -> str:
    return "null" if v is None else "an object" if isinstance(v, (dict, BaseModel)) else type(v).__name__


class Task(OpenModel):
    """One OSWorld task (``evaluation_examples/examples/<domain>/<id>.json``)."""

    # What OSWorld's runner reads (task_config["id"], ["instruction"], ["evaluator"], .get("config"),
    # .get("proxy")) is typed; keys it never reads take any JSON value and are kept as read.
    id: str
    instruction: str
    evaluator: Evaluator
    config: list[ConfigStep] = Field(default_factory=list)
    proxy: Any = False
    snapshot: Any = ""
    source: Any = ""  # a list of URLs in one published task
    trajectory: Any = ""
    related_apps: Any = Field(default_factory=list)
    fixed_ip: Any = False
    possibility_of_env_change: Any = ""
    hint: Any = None
    env_may_change: Any = None

    _domain: str = PrivateAttr(default="")
    _path: Path | None = PrivateAttr(default=None)
    _warnings: list[Issue] = PrivateAttr(default_factory=list)

    @property
    def warnings(self) -> list[Issue]:
        """What loads but deserves a look (an uneven evaluator list, a non-boolean ``proxy``)."""
        return self._warnings

    @property
    def uses_proxy(self) -> bool:
        """OSWorld's reading of ``proxy``: truthiness (``"false"`` is true there too)."""
        return bool(self.proxy)

    @property
    def apps(self) -> list[str]:
        """``related_apps`` as a list of names, whatever shape the file gave it."""
        apps = self.related_apps
        if isinstance(apps, str):
            return [apps]
        return [str(a) for a in apps] if isinstance(apps, list) else []

    @property
    def domain(self) -> str:
        """Folder name the suite found this task in (``""`` when loaded on its own)."""
        return self._domain

    @property
    def path(self) -> Path | None:
        return self._path

    def config_types(self) -> list[str]:
        return [c.type for c in self.config]

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, ensure_ascii=False)


# ---- loading ----------------------------------------------------------------------------------


def parse_task(data: Any, file: str = "<task>") -> Task:
    """Validate a decoded JSON value as a task; raise :class:`TaskError` listing every problem."""
    if not isinstance(data, dict):
        raise TaskError([Issue(file, f"a task must be a JSON object, got {_kind(data)}")])
    try:
        task = Task.model_validate(data)
    except ValidationError as e:
        raise TaskError([_issue_from(file, err) for err in e.errors()]) from None
    # Names the task gives to host files (id, stdout, dest, ...) must stay in their folders.
    confined = task_path_problems(data)
    if confined:
        raise TaskError([Issue(file, msg, path) for path, msg in confined])
    problems = task.evaluator.alignment_issues()
    if problems:
        raise TaskError([Issue(file, msg, path) for path, msg in problems])
    task._warnings = [Issue(file, msg, path) for path, msg in task.evaluator.alignment_warnings()]
    if not isinstance(task.proxy, bool):
        task._warnings.append(Issue(file, f"proxy should be true or false, got {_kind(task.proxy)} "
                                          f"{json.dumps(task.proxy)[:40]}; read by truthiness as OSWorld does "
                                          f"({task.uses_proxy})", "$.proxy"))
    return task


def _issue_from(file: str, err: Any) -> Issue:
    msg = err["msg"]
    if err["type"] != "missing" and "input" in err:
        shown = json.dumps(err["input"], ensure_ascii=False, default=str)
        msg += f" (got {shown[:60] + '...' if len(shown) > 60 else shown})"
    return Issue(file, msg, json_path(tuple(err["loc"])))


def read_json(path: Path, label: str | None = None) -> Any:
    """Decode a JSON file; bad JSON becomes a TaskError naming file, line and column."""
    label = label or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError([Issue(label, f"cannot read: {e}")]) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskError([Issue(label, f"invalid JSON: {e.msg}", line=e.lineno, col=e.colno)]) from None


def load_task(path: str | Path, domain: str | None = None, label: str | None = None) -> Task:
    """Load one task file. ``domain`` defaults to the name of the folder holding it."""
    p = Path(path)
    label = label or str(path)
    task = parse_task(read_json(p, label), label)
    if task.id != p.stem:
        raise TaskError([Issue(label, f"id {task.id!r} does not match the file name {p.name!r}", "$.id")])
    task._domain = domain if domain is not None else p.parent.name
    task._path = p
    return task
