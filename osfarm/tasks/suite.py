"""A suite: task files ``<domain>/<id>.json`` plus an index ``{domain: [ids]}`` (OSWorld's
``test_all.json`` form) that fixes which tasks run and in what order.

Also reads OSWorld's own tree (``evaluation_examples/``: ``examples/<domain>/<id>.json`` with
``test_all.json`` beside it). Every problem in every file is collected before raising, so
``osfarm tasks validate`` can show them all at once.

``strict=False`` loads what can be loaded and lists the rest as :class:`RefusedTask` values (file,
id, every issue), so one bad task file costs that task, not the suite: ``osfarm eval`` records a
refused task as an ``infra_error`` naming the file and JSON path and runs the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from osfarm.tasks.model import Issue, Task, TaskError, load_task, read_json
from osfarm.tasks.task_paths import plain_name_problem

OSWORLD_INDEX = "test_all.json"


@dataclass(frozen=True)
class RefusedTask:
    """A task of the suite that cannot be run: its file is missing, unreadable or invalid."""

    domain: str
    task_id: str  # the index's id, else the file name's stem
    file: Path
    issues: tuple[Issue, ...]

    @property
    def error(self) -> str:
        """One line per issue, each naming the file and the JSON path (or line:col)."""
        return "refused task file:\n" + "\n".join(str(i) for i in self.issues)


@dataclass
class Suite:
    root: Path  # the folder holding <domain>/<id>.json
    tasks: list[Task]
    index_file: Path | None = None
    refused: list[RefusedTask] = field(default_factory=list)  # strict=False: what did not load
    _by_id: dict[str, Task] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_id = {t.id: t for t in self.tasks}

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, task_id: str) -> Task:
        return self._by_id[task_id]

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._by_id

    def domains(self) -> list[str]:
        """Domains in first-seen (index) order."""
        return list(dict.fromkeys(t.domain for t in self.tasks))

    def in_domain(self, domain: str) -> list[Task]:
        return [t for t in self.tasks if t.domain == domain]

    @property
    def warnings(self) -> list[Issue]:
        """Every loaded task's warnings (see :attr:`osfarm.tasks.model.Task.warnings`)."""
        return [w for t in self.tasks for w in t.warnings]

    def index(self) -> dict[str, list[str]]:
        """This suite as an OSWorld-style index."""
        out: dict[str, list[str]] = {}
        for t in self.tasks:
            out.setdefault(t.domain, []).append(t.id)
        return out


def read_index(path: Path) -> dict[str, list[str]]:
    """Read ``{domain: [ids]}``; shape errors name the index file and the JSON path."""
    data = read_json(path)
    label = str(path)
    if not isinstance(data, dict):
        raise TaskError([Issue(label, "an index must be a JSON object {domain: [task ids]}")])
    issues: list[Issue] = []
    seen: dict[str, str] = {}
    for domain, ids in data.items():
        if (why := plain_name_problem(domain)) is not None:  # it names a folder of the suite
            issues.append(Issue(label, f"domain {why}", f"$.{domain}"))
            continue
        if not isinstance(ids, list):
            issues.append(Issue(label, "must be a list of task ids", f"$.{domain}"))
            continue
        for i, tid in enumerate(ids):
            where = f"$.{domain}[{i}]"
            if not isinstance(tid, str) or not tid:
                issues.append(Issue(label, f"task id must be a non-empty string, got {tid!r}", where))
            elif (why := plain_name_problem(tid)) is not None:
                issues.append(Issue(label, f"task id {why}", where))
            elif tid in seen:
                issues.append(Issue(label, f"task id {tid} is listed twice (also in {seen[tid]})", where))
            else:
                seen[tid] = domain
    if issues:
        raise TaskError(issues)
    return data


def resolve_layout(directory: str | Path, index: str | Path | None) -> tuple[Path, Path | None]:
    """(tasks root, index file) for our layout or OSWorld's ``examples/`` + ``test_all.json``."""
    d = Path(directory)
    if (d / "examples").is_dir():
        root = d / "examples"
        if index is None and (d / OSWORLD_INDEX).is_file():
            return root, d / OSWORLD_INDEX
        return root, Path(index) if index is not None else None
    return d, Path(index) if index is not None else None


def load_suite(directory: str | Path, index: str | Path | None = None, *, strict: bool = True) -> Suite:
    """Load every task of the index, in index order (or every file, sorted, when no index).

    ``strict`` (the default) raises :class:`TaskError` with all issues found: bad task files,
    index entries without a file (naming the index file and the id). ``strict=False`` returns
    the tasks that load and lists the others in ``Suite.refused``. Either way an unreadable index
    or a missing folder raises.
    """
    root, index_file = resolve_layout(directory, index)
    if not root.is_dir():
        raise TaskError([Issue(str(root), "not a folder of <domain>/<id>.json task files")])
    refused: list[RefusedTask] = []
    wanted: list[tuple[str, Path]] = []
    if index_file is not None:
        for domain, ids in read_index(index_file).items():
            for i, tid in enumerate(ids):
                p = root / domain / f"{tid}.json"
                if p.is_file():
                    wanted.append((domain, p))
                else:
                    issue = Issue(str(index_file), f"task {tid} has no file {p}", f"$.{domain}[{i}]")
                    refused.append(RefusedTask(domain, tid, p, (issue,)))
    else:
        wanted = [(p.parent.name, p) for p in sorted(root.glob("*/*.json"))]
    tasks: list[Task] = []
    seen: dict[str, Path] = {}
    for domain, p in wanted:
        try:
            task = load_task(p, domain=domain)
        except TaskError as e:
            refused.append(RefusedTask(domain, p.stem, p, tuple(e.issues)))
            continue
        if task.id in seen:  # without an index the same id may sit in two domains
            issue = Issue(str(p), f"duplicate task id (also {seen[task.id]})", "$.id")
            refused.append(RefusedTask(domain, task.id, p, (issue,)))
            continue
        seen[task.id] = p
        tasks.append(task)
    if strict and refused:
        raise TaskError([i for r in refused for i in r.issues])
    return Suite(root=root, tasks=tasks, index_file=index_file, refused=refused)
