"""``osfarm tasks audit``: does every task of a suite start clean and score honestly here?

Each task lands in one category, with a reason:

* ``unsupported``: it needs what no offline farm does (a Google account, a live page read at
  evaluation time), a setup type, getter or metric osfarm does not implement, an optional extra
  that is not installed, or an application this desktop lacks (a setup step cannot start it);
* ``needs-network``: a file it downloads is not in the cache (``osfarm tasks fetch`` fills it),
  it opens live web pages, or a setup command fetches from the internet (``wget``/``curl`` a URL,
  ``git clone``, ``snap install``): these are classified without a desktop, so the audit stays
  bounded. A setup command that installs apt or pip packages runs on a desktop, whose setup
  checks that it has them (:mod:`osfarm.tasks.offline_steps`): a missing one is needs-network;
* ``broken``: on a fresh desktop, its setup or evaluation fails (a step errors, a getter or
  metric crashes, the infeasible task's ``FAIL`` does not score 1, the episode runs out of time);
* ``free-points``: the ``noop`` agent (``DONE`` at once) scores above 0 on a feasible task: the
  desktop already is in the state the task asks for (a default OSWorld's VM does not have);
* ``ok``: neither agent scores what it should not, and nothing fails.

Every other task runs twice on fresh desktops of a farm: the ``noop`` agent and the ``fail``
agent (``FAIL`` at once: 1 on an infeasible task, 0 elsewhere, with the getters run either way).
The result is a table, a JSON report and an HTML report.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from osfarm.agents import make_agent
from osfarm.client import AsyncFarm
from osfarm.env import EpisodeTimeout, InfraError, TaskEnv
from osfarm.evaluators.errors import UnsupportedOption
from osfarm.tasks.coverage import NEEDS_EXTRA, UNSUPPORTED, Kind, implemented
from osfarm.tasks.fetch import task_assets
from osfarm.tasks.filecache import AssetMissing, FileCache
from osfarm.tasks.model import Task
from osfarm.tasks.network_steps import network_needs
from osfarm.tasks.offline_steps import NeedsNetwork
from osfarm.tasks.setup import SetupUnsupported
from osfarm.tasks.suite import RefusedTask, Suite

Category = Literal["ok", "free-points", "broken", "needs-network", "unsupported"]
CATEGORIES: tuple[Category, ...] = ("free-points", "broken", "unsupported", "needs-network", "ok")
AGENTS = ("noop", "fail")
SCHEMA = "osfarm.audit/1"

_LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0", "::1")
_MISSING_PROGRAM = re.compile(r"cannot (?:run|launch|start) '([^' ]+)[^']*': No such file or directory")
# VS Code is code-server behind the desktop's `code` wrapper (scripts/setup-vscode.sh,
# docs/osworld-compat.md "VS Code"); without that install the tasks that start it cannot run.
CODE_SERVER = Path(os.environ.get("OSFARM_CODE_SERVER", "/usr/lib/osfarm-code-server"))
NO_VSCODE = (f"VS Code is not installed: the desktop's `code` is code-server in {CODE_SERVER}, which "
             "scripts/setup-vscode.sh builds (npm's code-server 4.139.1 with Node 24); no registry reachable "
             "here serves the desktop (Electron) VS Code")
NO_MARKETPLACE = ("its evaluator lists VS Code's extensions: the agent installs one from the marketplace "
                  "(code-server's is Open VSX), which an offline farm cannot reach; only local .vsix files "
                  "install here")
_VSCODE_GETTERS = ("vscode_config",)


@dataclass
class AgentRun:
    agent: str
    score: float | None = None
    error: str | None = None
    phase: str | None = None
    seconds: float = 0.0


@dataclass
class TaskAudit:
    task_id: str
    domain: str
    file: str
    category: Category
    reason: str
    feasible: bool = True
    runs: dict[str, AgentRun] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["runs"] = {k: asdict(v) for k, v in self.runs.items()}
        return d


# ---------------------------------------------------------------------------- without a desktop


def _urls(value: Any) -> list[str]:
    if isinstance(value, str):
        return re.findall(r"https?://[^\s\"'<>)]+", value)
    if isinstance(value, list):
        return [u for v in value for u in _urls(v)]
    if isinstance(value, dict):
        return [u for v in value.values() for u in _urls(v)]
    return []


def _live_url(steps: list[Any]) -> str | None:
    """The first live web page a setup opens (download steps fetch files: those are assets)."""
    for step in steps:
        if step.type in ("download", "upload_file", "update_browse_history"):
            continue
        for url in _urls(step.parameters):
            if (urlsplit(url).hostname or "") not in _LOCAL_HOSTS:
                return url
    return None


def _network_fetch(steps: list[Any]) -> str | None:
    """What a setup command fetches that no installed package stands in for. The packages a
    command installs are the desktop's to check: its setup fails the step when one is missing."""
    for step in steps:
        if step.type in ("execute", "command", "launch", "execute_with_verification"):
            needs = network_needs(step.parameters.get("command"), bool(step.parameters.get("shell", False)))
            if needs.fetches:
                return f"its setup runs {', '.join(f'`{p}`' for p in needs.parts)}, which fetches " \
                       f"{', '.join(needs.fetches)} from the internet"
    return None


def _argv0(command: Any) -> str:
    if isinstance(command, list):
        return str(command[0]) if command else ""
    return str(command).split(maxsplit=1)[0] if isinstance(command, str) and command.strip() else ""


def needs_vscode(task: Task) -> bool:
    """The task starts VS Code (``code`` in a setup step) or a getter asks it something."""
    ev = task.evaluator
    for step in [*task.config, *ev.postconfig]:
        if step.type in ("launch", "execute", "command", "execute_with_verification") and \
                _argv0(step.parameters.get("command")) == "code":
            return True
    for g in ev.getters():
        command = (g.model_extra or {}).get("command")
        if g.type in _VSCODE_GETTERS or (g.type == "vm_command_line" and _argv0(command) == "code"):
            return True
    return False


def _has_vscode() -> bool:
    wrapper = Path(__file__).resolve().parents[1] / "desktop" / "assets" / "bin" / "code"
    return wrapper.is_file() and (CODE_SERVER / ".installed").is_file()


def needs_marketplace(task: Task) -> bool:
    """A getter lists VS Code's installed extensions while the task ships no .vsix: the agent must
    install one from the marketplace. (A setup step that installs one by id is a network step:
    :mod:`osfarm.tasks.network_steps`.)"""
    ships_vsix = ".vsix" in json.dumps([s.parameters for s in task.config])
    for g in task.evaluator.getters():
        command = (g.model_extra or {}).get("command")
        if g.type == "vm_command_line" and "--list-extensions" in str(command) and not ships_vsix:
            return True
    return False


def _unsupported_reason(task: Task) -> str | None:
    ev = task.evaluator
    if needs_vscode(task):
        if not _has_vscode():
            return NO_VSCODE
    needs: list[tuple[Kind, str]] = [("setup", s.type) for s in [*task.config, *ev.postconfig]]
    needs += [("getter", g.type) for g in ev.getters()]
    needs += [("metric", f) for f in ev.funcs]
    for kind, name in needs:
        if name in UNSUPPORTED:
            return f"{kind} {name}: {UNSUPPORTED[name]}"
        if name in NEEDS_EXTRA and not NEEDS_EXTRA[name][0]():
            return f"{kind} {name}: {NEEDS_EXTRA[name][1]}"
        if name not in implemented(kind):
            return f"{kind} {name}: not implemented in osfarm"
    return None


def static_verdict(task: Task, cache: FileCache) -> tuple[Category, str] | None:
    """A category decided from the task file and the cache alone, or None: run it."""
    reason = _unsupported_reason(task)
    if reason is not None:
        return "unsupported", reason
    missing = []
    for a in task_assets(task):
        try:
            cache.fetch(a.url, task.id, name=a.name, offline=True)
        except AssetMissing:
            missing.append(a)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return "needs-network", f"{len(missing)} file(s) not in the cache: {missing[0].url} at {missing[0].where}{more}"
    steps = [*task.config, *task.evaluator.postconfig]
    fetch = _network_fetch(steps)  # before the live pages: a URL in a command is a download
    if fetch is not None:
        return "needs-network", fetch
    if needs_vscode(task) and needs_marketplace(task):
        return "needs-network", NO_MARKETPLACE
    url = _live_url(steps)
    if url is not None:
        return "needs-network", f"opens the live web page {url}"
    return None


# ---------------------------------------------------------------------------- on desktops


def _causes(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


async def run_agent(farm: AsyncFarm, task: Task, agent_name: str, cache: FileCache, work: Path,
                    time_limit_s: float) -> tuple[AgentRun, BaseException | None]:
    """One episode of ``agent_name`` on a fresh desktop: its score, or the harness error."""
    run = AgentRun(agent_name)
    t0 = time.monotonic()
    agent = make_agent(agent_name)
    err: BaseException | None = None
    try:
        async with TaskEnv(farm, max_steps=1, time_limit_s=time_limit_s, cache=cache, work_dir=work,
                           offline=True) as env:
            obs, _ = await env.reset(task)
            await asyncio.to_thread(agent.reset, task)
            _, actions = await agent.apredict(task.instruction, obs.as_dict())
            _, _, _, _, info = await env.step(list(actions) or ["DONE"])
            if info.get("time_limit"):
                raise EpisodeTimeout(f"the episode ran out of its {time_limit_s:g} s")
            run.score = env.score
    except InfraError as e:
        err, run.error, run.phase = e, str(e), e.phase
    except EpisodeTimeout as e:
        err, run.error, run.phase = e, str(e) or f"timed out after {time_limit_s:g} s", "timeout"
    finally:
        run.seconds = round(time.monotonic() - t0, 2)
    return run, err


def classify_runs(task: Task, runs: dict[str, tuple[AgentRun, BaseException | None]]) -> tuple[Category, str]:
    feasible = not task.evaluator.is_infeasible
    for name, (run, err) in runs.items():
        if err is None:
            continue
        chain = _causes(err)
        for c in chain:
            if isinstance(c, (SetupUnsupported, UnsupportedOption)):
                return "unsupported", f"{name}: {c}"
            if isinstance(c, AssetMissing):
                return "needs-network", f"{name}: {c}"
            if isinstance(c, NeedsNetwork):  # a package its setup installs is not on the desktop
                return "needs-network", f"{name}: {run.error}"
        m = _MISSING_PROGRAM.search(run.error or "")
        if m:
            return "unsupported", f"the desktop has no '{m.group(1)}' ({name}: {run.error})"
    for name, (run, err) in runs.items():
        if err is not None:
            return "broken", f"{name}: {run.phase}: {run.error}"
    noop, fail = runs["noop"][0].score, runs["fail"][0].score
    if feasible and noop is not None and noop > 0:
        return "free-points", f"noop (DONE at once) scores {noop:g} on a feasible task"
    if not feasible and fail != 1.0:
        return "broken", f"FAIL scores {fail} on an infeasible task (expected 1)"
    if feasible and fail not in (0.0, None):
        return "broken", f"FAIL scores {fail} on a feasible task (expected 0)"
    return "ok", "noop 0" + (", fail 1 (infeasible)" if not feasible else ", fail 0")


# ---------------------------------------------------------------------------- the suite


@dataclass
class AuditReport:
    suite: str
    tasks: list[TaskAudit]
    started_at: float
    finished_at: float = 0.0
    envs: int = 1

    def counts(self) -> dict[str, int]:
        c = Counter(t.category for t in self.tasks)
        return {k: c.get(k, 0) for k in CATEGORIES}

    def by_domain(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for t in self.tasks:
            out.setdefault(t.domain, {k: 0 for k in CATEGORIES})[t.category] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "suite": self.suite, "n_tasks": len(self.tasks), "envs": self.envs,
                "seconds": round(self.finished_at - self.started_at, 1), "counts": self.counts(),
                "by_domain": self.by_domain(), "tasks": [t.to_json() for t in self.tasks]}


Progress = Callable[[TaskAudit], None]


async def audit_suite(suite: Suite, farm: AsyncFarm | None, cache: FileCache, work: Path, *, envs: int = 1,
                      time_limit_s: float = 300.0, progress: Progress | None = None,
                      source: str | None = None) -> AuditReport:
    """Classify every task of ``suite``; the ones that can run here run on ``farm`` (at most
    ``envs`` tasks at once). ``farm`` may be None when nothing needs a desktop."""
    report = AuditReport(source or str(suite.root), [], time.time(), envs=envs)
    results: dict[str, TaskAudit] = {}

    def done(t: TaskAudit) -> None:
        results[t.task_id] = t
        if progress is not None:
            progress(t)

    for r in suite.refused:
        done(_refused(r))
    to_run: list[Task] = []
    for task in suite:
        verdict = static_verdict(task, cache)
        if verdict is None:
            to_run.append(task)
        else:
            done(TaskAudit(task.id, task.domain, str(task.path), verdict[0], verdict[1],
                           feasible=not task.evaluator.is_infeasible))
    if to_run and farm is None:
        raise ValueError(f"{len(to_run)} task(s) need a desktop, and no farm was given")
    sem = asyncio.Semaphore(max(1, envs))

    async def one(task: Task) -> None:
        async with sem:
            runs: dict[str, tuple[AgentRun, BaseException | None]] = {}
            for name in AGENTS:
                assert farm is not None
                runs[name] = await run_agent(farm, task, name, cache, work / task.id / name, time_limit_s)
            category, reason = classify_runs(task, runs)
            done(TaskAudit(task.id, task.domain, str(task.path), category, reason,
                           feasible=not task.evaluator.is_infeasible, runs={k: v[0] for k, v in runs.items()}))

    await asyncio.gather(*(one(t) for t in to_run))
    order = [t.id for t in suite] + [r.task_id for r in suite.refused]
    report.tasks = [results[tid] for tid in order if tid in results]
    report.finished_at = time.time()
    return report


def _refused(r: RefusedTask) -> TaskAudit:
    return TaskAudit(r.task_id, r.domain, str(r.file), "broken", r.error)


def needs_desktop(suite: Suite, cache: FileCache) -> int:
    """How many tasks of ``suite`` will run on a desktop (the others are classified from files)."""
    return sum(1 for t in suite if static_verdict(t, cache) is None)


# ---------------------------------------------------------------------------- reports

_CSS = """body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 8px;vertical-align:top}td.n{text-align:right}
.free-points{background:#fdd}.broken{background:#fec}.unsupported{background:#eef}
.needs-network{background:#eee}.ok{background:#dfd}code{font-size:12px;white-space:pre-wrap}"""


def write_reports(report: AuditReport, out: Path) -> tuple[Path, Path]:
    """``<out>/audit.json`` and ``<out>/audit.html``."""
    out.mkdir(parents=True, exist_ok=True)
    j, h = out / "audit.json", out / "audit.html"
    data = report.to_json()
    j.write_text(json.dumps(data, indent=1, ensure_ascii=False))
    e = html.escape
    parts = [f"<!doctype html><meta charset=utf-8><title>osfarm tasks audit</title><style>{_CSS}</style>",
             f"<h1>osfarm tasks audit: {e(report.suite)}</h1>",
             f"<p>{len(report.tasks)} tasks, {data['seconds']} s, {report.envs} desktop(s) at once</p>",
             "<table><tr><th>domain</th>" + "".join(f"<th class='{c}'>{c}</th>" for c in CATEGORIES) + "</tr>"]
    for dom, counts in sorted(report.by_domain().items()):
        parts.append(f"<tr><td>{e(dom)}</td>" + "".join(f"<td class=n>{counts[c]}</td>" for c in CATEGORIES) + "</tr>")
    total = report.counts()
    parts.append("<tr><th>total</th>" + "".join(f"<th class=n>{total[c]}</th>" for c in CATEGORIES) + "</tr></table>")
    parts.append("<table><tr><th>category</th><th>domain</th><th>task</th><th>reason</th><th>noop</th><th>fail</th></tr>")
    rank = {c: i for i, c in enumerate(CATEGORIES)}
    for t in sorted(report.tasks, key=lambda t: (rank[t.category], t.domain, t.task_id)):
        cells = []
        for name in AGENTS:
            r = t.runs.get(name)
            cells.append("" if r is None else e(f"{r.score:g}" if r.score is not None else f"error ({r.phase})"))
        parts.append(f"<tr class='{t.category}'><td>{t.category}</td><td>{e(t.domain)}</td>"
                     f"<td><code>{e(t.task_id)}</code></td><td><code>{e(t.reason)}</code></td>"
                     f"<td>{cells[0]}</td><td>{cells[1]}</td></tr>")
    parts.append("</table>")
    h.write_text("\n".join(parts))
    return j, h


__all__ = ["AGENTS", "CATEGORIES", "AgentRun", "AuditReport", "TaskAudit", "audit_suite", "classify_runs",
           "needs_desktop", "run_agent", "static_verdict", "write_reports"]
