"""The runs under a runs root, as the dashboard reads them.

An *eval run* is a directory holding ``results.json`` (``osfarm eval``'s summary, see
:mod:`osfarm.runner.results` for the layout) or, while it is still running, only its
``episodes.jsonl``; a *training run* holds ``metrics.jsonl`` (``osfarm train``). Runs are found
down to :data:`MAX_DEPTH` levels under the root and named by their path relative to it (the
*key*, ``.`` for the root itself).

Everything here is read through :class:`~osfarm.dashboard.confined.ConfinedDir` and parsed
leniently: a run dir is someone else's output, so a missing field, a wrong type or a truncated
line makes that run show an error, never a failed page. Aggregates are computed here from the
task rows rather than trusted from the file.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from osfarm.dashboard.confined import ConfinedDir, Refused, clean_parts
from osfarm.dashboard.stats import Rate
from osfarm.runner.results import GROUPS
from osfarm.runner.variance import Outcome, RepeatStats, repeat_stats
from osfarm.schema.episode import SchemaError, check_record

MAX_DEPTH = 4
MAX_RESULTS_BYTES = 64 << 20
MAX_RECORD_LINE = 16 << 20
MAX_METRICS_LINE = 1 << 20
MAX_TEXT_BYTES = 8 << 20
DISCOVERY_TTL_S = 2.0
# Folders of a run that never hold another run: walking them would only cost time.
NOT_RUNS = frozenset({"blobs", "tensorboard", "checkpoints", "wandb", "pool", "__pycache__", "node_modules"})
STATUSES = ("success", "failure", "infra_error", "timeout")


class TaskRow(BaseModel):
    """One task of a run (a row of results.json, or made from an episode record)."""

    model_config = ConfigDict(extra="allow")
    task_id: str
    domain: str = ""
    status: str = "failure"
    score: float | None = None
    error: str | None = None
    steps: int | None = None
    attempts: int | None = None
    seconds: float | None = None
    episode_id: str | None = None
    repeat: int | None = Field(default=None, ge=1)  # which of the run's --repeats; None without repeats

    @property
    def ok(self) -> bool:
        return self.status == "success"

    @property
    def status_class(self) -> str:
        return self.status if self.status in STATUSES else "unknown"


class ResultsFile(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    schema_: str | None = Field(default=None, alias="schema")
    run_id: str = ""
    agent: str = "?"
    model: str | None = None
    suite: str | None = None
    index: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    seconds: float | None = None
    action_timing: str | None = None
    tasks: list[TaskRow] = Field(default_factory=list)


@dataclass
class Summary:
    overall: Rate
    by_group: dict[str, Rate]
    by_domain: dict[str, Rate]
    infra_errors: int
    timeouts: int
    mean_steps: float | None
    mean_score: float | None

    @staticmethod
    def of(rows: list[TaskRow]) -> Summary:
        def rate(rs: Iterable[TaskRow]) -> Rate:
            rs = list(rs)
            return Rate(sum(r.ok for r in rs), len(rs))

        domains = sorted({r.domain for r in rows})
        by_group = {g: rate(r for r in rows if r.domain in doms) for g, doms in GROUPS.items()}
        steps = [r.steps for r in rows if r.steps is not None and r.status != "infra_error"]
        scores = [float(r.score) for r in rows if r.score is not None]
        return Summary(
            overall=rate(rows),
            by_group={g: v for g, v in by_group.items() if v.n},
            by_domain={d: rate(r for r in rows if r.domain == d) for d in domains},
            infra_errors=sum(r.status == "infra_error" for r in rows),
            timeouts=sum(r.status == "timeout" for r in rows),
            mean_steps=sum(steps) / len(steps) if steps else None,
            mean_score=sum(scores) / len(scores) if scores else None,
        )


@dataclass
class EvalRun:
    key: str
    rows: list[TaskRow]
    results: ResultsFile | None = None
    error: str | None = None
    model: str | None = None
    in_progress: bool = False
    mtime: float = 0.0
    summary: Summary = field(init=False)
    repeats: RepeatStats | None = field(init=False)  # mean ± s.e., pass@k, pass^k, flips; None without repeats

    def __post_init__(self) -> None:
        self.summary = Summary.of(self.rows)
        repeated = any(r.repeat is not None for r in self.rows)
        self.repeats = repeat_stats(outcomes(self.rows)) if repeated else None

    @property
    def agent(self) -> str:
        return self.results.agent if self.results else "?"

    @property
    def run_id(self) -> str:
        return (self.results.run_id if self.results else "") or self.key

    @property
    def suite(self) -> str:
        s = self.results.suite if self.results else None
        if not s:
            return "?"
        name = PurePosixPath(s.rstrip("/")).name or s
        idx = self.results.index if self.results else None
        if idx and PurePosixPath(idx).name not in ("test_all.json", ""):
            name += f" ({PurePosixPath(idx).name})"
        return name

    @property
    def started_at(self) -> float | None:
        return self.results.started_at if self.results and self.results.started_at else (self.mtime or None)

    @property
    def date(self) -> str:
        t = self.started_at
        return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%d %H:%M") if t else "?"

    def row(self, task_id: str) -> TaskRow | None:
        return next((r for r in self.rows if r.task_id == task_id), None)


def outcomes(rows: list[TaskRow]) -> list[Outcome]:
    """A run's rows as the variance module reads them (a row without a repeat is repeat 1)."""
    return [Outcome(r.task_id, r.repeat or 1, r.ok) for r in rows]


@dataclass
class TrainingRun:
    key: str
    rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    skipped_lines: int = 0
    mtime: float = 0.0

    @property
    def date(self) -> str:
        t = self.rows[0].get("time") if self.rows else None
        t = t if isinstance(t, (int, float)) else self.mtime
        return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%d %H:%M") if t else "?"

    @property
    def last(self) -> dict[str, Any]:
        return self.rows[-1] if self.rows else {}


def _key(parts: list[str]) -> str:
    return "/".join(parts) or "."


def key_parts(key: str) -> list[str]:
    """The path parts of a run key; Refused for a key that leaves the root."""
    return [] if key in (".", "") else clean_parts(key)


def _rel(key: str, *names: str) -> str:
    return "/".join([*key_parts(key), *names])


@dataclass
class _Cached:
    stamp: tuple[int, int]
    value: Any


class RunsRoot:
    """Discovery, parsing and caching of the runs under ``root`` (thread-safe)."""

    def __init__(self, root: Path):
        self.dir = ConfinedDir(root)
        self.root = self.dir.root
        self._lock = threading.Lock()
        self._found: tuple[float, list[str], list[str]] | None = None
        self._cache: dict[tuple[str, str], _Cached] = {}

    # -- discovery --------------------------------------------------------------------------

    def discover(self) -> tuple[list[str], list[str]]:
        """(eval run keys, training run keys), found at most MAX_DEPTH levels down."""
        with self._lock:
            if self._found and time.monotonic() - self._found[0] < DISCOVERY_TTL_S:
                return self._found[1], self._found[2]
        evals: list[str] = []
        trainings: list[str] = []

        def walk(parts: list[str], depth: int) -> None:
            try:
                entries = self.dir.entries("/".join(parts))
            except Refused:
                return
            names = {e.name: e for e in entries}
            files = {n for n, e in names.items() if not e.is_dir}
            if "metrics.jsonl" in files:
                trainings.append(_key(parts))
                return
            if "results.json" in files or "episodes.jsonl" in files:
                evals.append(_key(parts))
                return
            if depth >= MAX_DEPTH:
                return
            for e in entries:
                if e.is_dir and not e.name.startswith(".") and e.name not in NOT_RUNS:
                    walk([*parts, e.name], depth + 1)

        walk([], 0)
        with self._lock:
            self._found = (time.monotonic(), evals, trainings)
        return evals, trainings

    def eval_runs(self) -> list[EvalRun]:
        runs = [self.eval_run(k) for k in self.discover()[0]]
        return sorted(runs, key=lambda r: r.started_at or 0.0, reverse=True)

    def training_runs(self) -> list[TrainingRun]:
        runs = [self.training_run(k) for k in self.discover()[1]]
        return sorted(runs, key=lambda r: r.mtime, reverse=True)

    # -- one run ----------------------------------------------------------------------------

    def _cached(self, kind: str, rel: str, build: Any) -> Any:
        st = self.dir.stat(rel)
        stamp = (st.st_mtime_ns, st.st_size) if st else (0, 0)
        with self._lock:
            c = self._cache.get((kind, rel))
            if c is not None and c.stamp == stamp:
                return c.value
        value = build(st)
        with self._lock:
            self._cache[(kind, rel)] = _Cached(stamp, value)
        return value

    def eval_run(self, key: str) -> EvalRun:
        """The run at ``key`` (Refused if there is none)."""
        has_results = self.dir.is_file(_rel(key, "results.json"))
        if not has_results and not self.dir.is_file(_rel(key, "episodes.jsonl")):
            raise Refused(f"no eval run at {key!r}")
        if has_results:
            run: EvalRun = self._cached("results", _rel(key, "results.json"), lambda st: self._read_results(key, st))
        else:
            run = self._cached("partial", _rel(key, "episodes.jsonl"), lambda st: self._read_partial(key, st))
        return run

    def _read_results(self, key: str, st: Any) -> EvalRun:
        mtime = st.st_mtime if st else 0.0
        try:
            raw = json.loads(self.dir.read_bytes(_rel(key, "results.json"), MAX_RESULTS_BYTES))
            res = ResultsFile.model_validate(raw)
        except (Refused, ValueError, ValidationError) as e:
            return EvalRun(key, [], None, error=f"results.json unreadable: {_short(e)}", mtime=mtime)
        model = res.model or self._model_from_records(key, res.agent)
        return EvalRun(key, res.tasks, res, model=model, mtime=mtime)

    def _read_partial(self, key: str, st: Any) -> EvalRun:
        """A run still going (no results.json yet): its rows from the records written so far."""
        rows: dict[tuple[str, int | None], TaskRow] = {}
        agent = model = None
        errors = 0
        for _off, rec in self._records(key):
            if rec is None:
                errors += 1
                continue
            agent = agent or rec.get("agent")
            name = (rec.get("policy") or {}).get("name")
            model = model or (name if name and name != rec.get("agent") else None)
            row = row_of_record(rec)
            rows[row.task_id, row.repeat] = row
        res = ResultsFile(run_id=key, agent=agent or "?", tasks=list(rows.values()))
        err = f"{errors} unreadable episode record(s)" if errors else None
        return EvalRun(key, res.tasks, res, error=err, model=model, in_progress=True, mtime=st.st_mtime if st else 0.0)

    def _model_from_records(self, key: str, agent: str) -> str | None:
        for _off, rec in self._records(key, limit=1):
            name = (rec or {}).get("policy", {}).get("name") if rec else None
            return name if name and name != agent else None
        return None

    def _records(self, key: str, limit: int | None = None) -> Iterable[tuple[int, dict[str, Any] | None]]:
        rel = _rel(key, "episodes.jsonl")
        n = 0
        try:
            for off, line in self.dir.lines(rel, MAX_RECORD_LINE):
                if not line.strip():
                    continue
                try:
                    yield off, check_record(json.loads(line))
                except (ValueError, SchemaError):
                    yield off, None
                n += 1
                if limit is not None and n >= limit:
                    return
        except Refused:
            return

    def _episode_index(self, key: str) -> dict[str, int]:
        def build(_st: Any) -> dict[str, int]:
            index: dict[str, int] = {}
            for off, rec in self._records(key):
                if rec is not None:
                    index[rec["episode_id"]] = off  # the last record of an id wins (a resumed run)
            return index

        return self._cached("index", _rel(key, "episodes.jsonl"), build)

    def episode(self, key: str, episode_id: str) -> dict[str, Any]:
        """The episode record ``episode_id`` of run ``key``; Refused when absent or invalid."""
        off = self._episode_index(key).get(episode_id)
        if off is None:
            raise Refused(f"run {key!r} has no episode {episode_id!r}")
        line = self.dir.read_at(_rel(key, "episodes.jsonl"), off, MAX_RECORD_LINE)
        try:
            return check_record(json.loads(line))
        except (ValueError, SchemaError) as e:
            raise Refused(f"episode {episode_id!r}: {_short(e)}") from None

    def task_files(self, key: str, domain: str, task_id: str, repeat: int | None = None) -> dict[str, Any]:
        """What OSWorld's per-task folder holds for the episode page: the screenshot file after
        each step (from traj.jsonl) and whether a recording exists. Paths are relative to the run;
        a repeat's folder is under ``repeat-<r>/``."""
        d = "/".join([*([f"repeat-{int(repeat)}"] if repeat is not None else []), domain or "_", task_id])
        after: dict[int, str] = {}
        try:
            clean_parts(d)
            for _off, line in self.dir.lines(_rel(key, d, "traj.jsonl"), MAX_METRICS_LINE):
                try:
                    s = json.loads(line)
                    if isinstance(s, dict) and isinstance(s.get("screenshot_file"), str):
                        step = s.get("step_num")
                        if step is None:  # no step number: the screenshot belongs to no step
                            continue
                        after[int(step)] = f"{d}/{s['screenshot_file']}"
                except (ValueError, TypeError):
                    continue
        except Refused:
            pass
        rec = f"{d}/recording.mp4"
        return {"after": after, "recording": rec if self.dir.is_file(_rel(key, rec)) else None}

    def training_run(self, key: str) -> TrainingRun:
        rel = _rel(key, "metrics.jsonl")
        if not self.dir.is_file(rel):
            raise Refused(f"no training run at {key!r}")

        def build(st: Any) -> TrainingRun:
            rows, bad = _json_lines(self.dir, rel)
            evals, bad2 = _json_lines(self.dir, _rel(key, "eval.jsonl"))
            return TrainingRun(key, rows, evals, bad + bad2, st.st_mtime if st else 0.0)

        return self._cached("training", rel, build)

    def run_file(self, key: str, rel: str) -> str:
        """``rel`` (relative to the run) as a path relative to the root, checked."""
        return "/".join([*key_parts(key), *clean_parts(rel)])


def _json_lines(d: ConfinedDir, rel: str) -> tuple[list[dict[str, Any]], int]:
    rows, bad = [], 0
    try:
        for _off, line in d.lines(rel, MAX_METRICS_LINE):
            if not line.strip():
                continue
            try:
                v = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(v, dict):
                rows.append(v)
            else:
                bad += 1
    except Refused:
        pass
    return rows, bad


def row_of_record(rec: dict[str, Any]) -> TaskRow:
    seconds = None
    try:
        finished, started = datetime.fromisoformat(rec["finished_at"]), datetime.fromisoformat(rec["started_at"])
        seconds = (finished - started).total_seconds()
    except (KeyError, ValueError, TypeError):
        pass
    return TaskRow(task_id=rec["task_id"], domain=rec.get("domain", ""), status=rec["status"], score=rec.get("score"),
                   error=rec.get("error"), steps=len(rec.get("steps") or []), attempts=rec.get("attempt"),
                   seconds=seconds, episode_id=rec.get("episode_id"), agent=rec.get("agent"), repeat=rec.get("repeat"))


def _short(e: BaseException) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        return f"field {'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
    text = str(e)
    return text if len(text) < 300 else text[:300] + "..."
