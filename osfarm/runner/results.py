"""What a run leaves on disk.

Per task, OSWorld's layout ``<out>/<domain>/<task_id>/``: ``result.txt`` (the score; written
only for a finished episode, so ``--resume`` re-runs infra errors), ``traj.jsonl`` (one line per
step), ``step_N_<timestamp>.png`` (the screen after step N) and ``episode.json`` (status, score,
error: what ``--resume`` reads back). Per run: ``episodes.jsonl`` (one ``osfarm.episode/1``
record per finished episode, screenshots as content-addressed blobs under ``blobs/``),
``results.json`` (every task in the denominator), ``report.html``. The record schema and the
blob store live in ``osfarm.stream`` (imported here under their old names).

With ``--repeats K`` (K > 1) each repeat is a whole OSWorld layout of its own,
``<out>/repeat-<r>/<domain>/<task_id>/``; rows and records carry ``repeat`` (1..K), the episodes
and blobs stay one per run, and results.json adds ``repeats``, per-task success counts
(``task_counts``) and the numbers across repeats (``variance``, see :mod:`osfarm.runner.variance`).
A run without repeats has no ``repeat`` field and the layout it always had.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from osfarm.agents.prompts.messages import strip_images
from osfarm.runner.episode import INFRA_ERROR, SUCCESS, TIMEOUT, EpisodeResult, episode_id
from osfarm.runner.variance import Outcome, repeat_stats, task_counts
from osfarm.schema.episode import SCHEMA, ModelCall, SchemaError, check_record
from osfarm.schema.guest import DEFAULT_ACTION_TIMING
from osfarm.stream.blobs import BlobStore
from osfarm.stream.jsonl import JsonlSink
from osfarm.tasks.suite import RefusedTask

RESULTS_SCHEMA = "osfarm.results/1"
# OSWorld's groups of domains (its paper's OS / Office / Daily / Professional / Workflow). Its
# folders are named libreoffice_calc etc.; its paper calls them calc etc.: both count.
GROUPS: dict[str, tuple[str, ...]] = {
    "OS": ("os",),
    "Office": ("calc", "impress", "writer", "libreoffice_calc", "libreoffice_impress", "libreoffice_writer"),
    "Daily": ("vlc", "thunderbird", "chrome"),
    "Professional": ("gimp", "vs_code"),
    "Workflow": ("multi_apps",),
}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="milliseconds")


def task_dir(out: Path, domain: str, task_id: str, repeat: int | None = None) -> Path:
    base = out / f"repeat-{repeat}" if repeat is not None else out
    return base / (domain or "_") / task_id


def step_model(call: ModelCall | None, response: str, blobs: BlobStore) -> dict[str, Any]:
    """A step's ``model`` part: the request messages as a JSON blob whose image data URLs are
    themselves blob refs (the screenshot the step observed is the same blob), and the reply."""
    if call is None:
        return {"request": None, "response_text": response, "response_token_ids": None,
                "response_logprobs": None, "policy_version": None}
    request = None
    if isinstance(call.request, list):  # an agent's chat messages (a blob ref is a record's, already stored)
        msgs = strip_images(call.request, blobs.put)
        request = blobs.put(json.dumps(msgs, ensure_ascii=False).encode(), "json", "application/json")
    return {"request": request, "response_text": call.response_text, "response_token_ids": call.response_token_ids,
            "response_logprobs": call.response_logprobs, "policy_version": call.policy_version}


def _policy(res: EpisodeResult) -> dict[str, Any]:
    versions = [s.model.policy_version for s in res.steps if s.model]
    versions = [v for v in versions if v is not None]
    names = [s.model.model for s in res.steps if s.model and s.model.model]
    return {"name": names[0] if names else res.agent, "version_start": versions[0] if versions else None,
            "version_end": versions[-1] if versions else None}


def episode_record(res: EpisodeResult, run_id: str, blobs: BlobStore) -> dict[str, Any]:
    steps = []
    for s in res.steps:
        shot = blobs.put(s.screenshot, "png", "image/png") if s.screenshot else None
        a11y = blobs.put(s.a11y.encode(), "xml", "application/xml") if s.a11y else None
        steps.append({
            "index": s.index,
            "observation": {"screenshot": shot, "a11y": a11y},
            "model": step_model(s.model, s.response, blobs),
            "actions": s.actions,
            "action_error": s.action_error,
            "t_model_ms": s.t_model_ms,
            "t_env_ms": s.t_env_ms,
        })
    return {
        "schema": SCHEMA,
        "episode_id": res.episode_id,
        "run_id": run_id,
        "task_id": res.task.id,
        "domain": res.task.domain,
        "group_id": res.task.id,
        "attempt": res.attempt,
        "agent": res.agent,
        "policy": _policy(res),
        "desktop": {"provider": res.desktop.provider if res.desktop else "sandbox",
                    "image": res.desktop.image if res.desktop else None,
                    "session": res.desktop.desktop if res.desktop else None},
        **({"repeat": res.repeat} if res.repeat is not None else {}),
        "status": res.status,
        "score": res.score,
        "error": res.error,
        "infra_retries": res.infra_retries,
        "action_timing": res.action_timing,
        "timings": res.timings,
        "started_at": _iso(res.started_at),
        "finished_at": _iso(res.finished_at),
        "steps": steps,
        # someone took control of the desktop from the dashboard: the outcome had human help
        **({"controlled_by": [c.model_dump() for c in res.controlled_by]} if res.controlled_by else {}),
        # CPU-seconds the desktop used during the episode (its cgroup), where the farm tells
        # and how it was made ready (warm, cold, start) and, for a cold one meant warm, why
        **{f"desktop_{k}": v for k, v in res.desktop_usage.model_dump(exclude_none=True).items()},
    }


def read_episodes(path: Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(check_record(json.loads(line)))
            except SchemaError as e:
                raise SchemaError(f"{path}:{n}: {e}") from None
    return out


def write_task(out: Path, res: EpisodeResult, run_id: str, blobs: BlobStore,
               emit: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
    """Write one finished task's files; returns its row for results.json. The episode record is
    appended to ``episodes.jsonl``, or handed to ``emit`` instead (a Celery worker returns it)."""
    d = task_dir(out, res.task.domain, res.task.id, res.repeat)
    d.mkdir(parents=True, exist_ok=True)
    for old in list(d.glob("step_*.png")) + [d / "traj.jsonl", d / "result.txt", d / "recording.mp4"]:
        old.unlink(missing_ok=True)  # a re-run (resume after an infra error) starts clean
    with (d / "traj.jsonl").open("w") as f:
        for s in res.steps:
            shot = f"step_{s.index}_{s.timestamp}.png"
            png = s.after_screenshot or s.screenshot
            if png:
                (d / shot).write_bytes(png)
            f.write(json.dumps({"step_num": s.index, "action_timestamp": s.timestamp,
                                "action": s.actions[0] if len(s.actions) == 1 else s.actions,
                                "actions": s.actions, "response": s.response, "action_error": s.action_error,
                                "screenshot_file": shot if png else None}, ensure_ascii=False) + "\n")
    if res.recording:
        (d / "recording.mp4").write_bytes(res.recording)
    if res.status != INFRA_ERROR:  # infra errors get no result.txt: --resume runs them again
        (d / "result.txt").write_text(f"{res.score}\n")
    if res.error:
        (d / "error.txt").write_text(res.error + "\n")
    else:
        (d / "error.txt").unlink(missing_ok=True)
    row = {"task_id": res.task.id, "domain": res.task.domain, "status": res.status, "score": res.score,
           "error": res.error, "steps": len(res.steps), "attempts": res.attempt,
           "seconds": round(res.finished_at - res.started_at, 2), "episode_id": res.episode_id,
           "action_timing": res.action_timing, "desktop": res.desktop.desktop if res.desktop else None}
    if res.repeat is not None:
        row["repeat"] = res.repeat
    if res.timings:
        row["timings"] = res.timings
    if res.recording_error:
        row["recording_error"] = res.recording_error
    if res.controlled_by:
        row["controlled_by"] = [c.by for c in res.controlled_by]
    row.update({f"desktop_{k}": v for k, v in res.desktop_usage.model_dump(exclude_none=True).items()})
    (d / "episode.json").write_text(json.dumps(row, indent=2))
    rec = episode_record(res, run_id, blobs)
    if emit is not None:
        emit(rec)
    else:
        JsonlSink(out / "episodes.jsonl").publish(rec)
    return row


def write_refused(out: Path, refused: RefusedTask, run_id: str, agent: str, action_timing: str = DEFAULT_ACTION_TIMING,
                  emit: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
    """A task whose file did not load: an ``infra_error`` row and episode record (no steps) whose
    error names the file and the JSON path of every issue; it gets no result.txt, so ``--resume``
    tries it again once the file is fixed."""
    d = task_dir(out, refused.domain, refused.task_id)
    d.mkdir(parents=True, exist_ok=True)
    (d / "result.txt").unlink(missing_ok=True)
    (d / "error.txt").write_text(refused.error + "\n")
    now = datetime.now(tz=UTC).timestamp()
    eid = episode_id(run_id, refused.task_id)
    row = {"task_id": refused.task_id, "domain": refused.domain, "status": INFRA_ERROR, "score": 0.0,
           "error": refused.error, "steps": 0, "attempts": 1, "seconds": 0.0, "episode_id": eid,
           "action_timing": action_timing}
    (d / "episode.json").write_text(json.dumps(row, indent=2))
    rec = {"schema": SCHEMA, "episode_id": eid, "run_id": run_id, "task_id": refused.task_id,
           "domain": refused.domain, "group_id": refused.task_id, "attempt": 1, "agent": agent,
           "policy": {"name": agent, "version_start": None, "version_end": None},
           "desktop": {"provider": None, "image": None}, "status": INFRA_ERROR, "score": 0.0,
           "error": refused.error, "infra_retries": 0, "action_timing": action_timing, "timings": {},
           "started_at": _iso(now),
           "finished_at": _iso(now), "steps": []}
    if emit is not None:
        emit(rec)
    else:
        JsonlSink(out / "episodes.jsonl").publish(rec)
    return row


def finished_row(out: Path, domain: str, task_id: str, repeat: int | None = None) -> dict[str, Any] | None:
    """The row of a task (a repeat of it) finished by an earlier run (its result.txt exists), for --resume."""
    d = task_dir(out, domain, task_id, repeat)
    rt = d / "result.txt"
    if not rt.is_file():
        return None
    try:
        sc = float(rt.read_text().strip())
    except ValueError:
        return None
    row: dict[str, Any] = {}
    try:
        row = json.loads((d / "episode.json").read_text())
    except (OSError, ValueError):
        row = {"status": "success" if sc == 1.0 else "failure", "error": None}
    row.update(task_id=task_id, domain=domain, score=sc, resumed=True)
    if repeat is not None:
        row["repeat"] = repeat
    return row


def outcomes(rows: list[dict[str, Any]]) -> list[Outcome]:
    """The rows as the variance module reads them (a row without ``repeat`` is repeat 1)."""
    return [Outcome(str(r["task_id"]), int(r.get("repeat") or 1), r["status"] == SUCCESS) for r in rows]


def repeats_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """results.json's part for a run with repeats: per-task success counts and the numbers across repeats."""
    outs = outcomes(rows)
    counts = task_counts(outs)
    domains = {str(r["task_id"]): r["domain"] for r in rows}
    stats = repeat_stats(outs)
    return {
        "task_counts": {t: {"domain": domains[t], "episodes": tc.n, "successes": tc.c} for t, tc in counts.items()},
        "variance": None if stats is None else {
            "tasks": stats.tasks, "repeats": stats.repeats, "k": stats.k, "mean_success_rate": stats.mean,
            "standard_error": stats.se, "pass_at_k": stats.pass_at_k, "pass_hat_k": stats.pass_hat_k,
            "flip_rate": stats.flip_rate, "flipped_tasks": stats.flipped},
    }


def summarize(
    rows: list[dict[str, Any]], run_id: str, agent: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    n = len(rows)
    ok = sum(1 for r in rows if r["status"] == SUCCESS)
    by_domain: dict[str, dict[str, Any]] = {}
    for r in rows:
        d = by_domain.setdefault(r["domain"], {"n": 0, "success": 0, "score_sum": 0.0, "infra_errors": 0})
        d["n"] += 1
        d["success"] += r["status"] == SUCCESS
        d["score_sum"] += float(r["score"] or 0.0)
        d["infra_errors"] += r["status"] == INFRA_ERROR
    for d in by_domain.values():
        d["success_rate"] = d["success"] / d["n"]
        d["mean_score"] = d.pop("score_sum") / d["n"]
    by_group = {}
    for g, doms in GROUPS.items():
        members = [r for r in rows if r["domain"] in doms]
        if members:
            by_group[g] = {"n": len(members),
                           "success_rate": sum(r["status"] == SUCCESS for r in members) / len(members)}
    return {
        "schema": RESULTS_SCHEMA,
        "run_id": run_id,
        "agent": agent,
        "n_tasks": n,
        "n_success": ok,
        "success_rate": ok / n if n else 0.0,
        "mean_score": sum(float(r["score"] or 0.0) for r in rows) / n if n else 0.0,
        "infra_errors": sum(1 for r in rows if r["status"] == INFRA_ERROR),
        "timeouts": sum(1 for r in rows if r["status"] == TIMEOUT),
        "infra_retries": sum(max(0, int(r.get("attempts", 1)) - 1) for r in rows if not r.get("resumed")),
        # the desktop sessions the episodes ran on (gnome, light): scores on different screens differ
        "desktops": sorted({r["desktop"] for r in rows if r.get("desktop")}),
        "by_domain": by_domain,
        "by_group": by_group,
        "tasks": rows,
        **(extra or {}),
    }


def results_table(summary: dict[str, Any]) -> Table:
    t = Table(title=f"osfarm eval: {summary['agent']} ({summary['run_id']})")
    for c in ("group", "domain", "tasks", "success", "rate", "infra errors"):
        t.add_column(c, justify="right" if c not in ("group", "domain") else "left")
    bd = summary["by_domain"]
    placed: set[str] = set()
    for g, doms in GROUPS.items():
        for dom in doms:
            if dom in bd:
                d = bd[dom]
                t.add_row(g, dom, str(d["n"]), str(d["success"]), f"{d['success_rate']:.1%}", str(d["infra_errors"]))
                placed.add(dom)
        if g in summary["by_group"]:
            gg = summary["by_group"][g]
            t.add_row(f"[bold]{g}[/]", "[bold]all[/]", str(gg["n"]), "", f"[bold]{gg['success_rate']:.1%}[/]", "",
                      end_section=True)
    for dom, d in bd.items():
        if dom not in placed:
            t.add_row("", dom, str(d["n"]), str(d["success"]), f"{d['success_rate']:.1%}", str(d["infra_errors"]))
    t.add_section()
    t.add_row("[bold]total[/]", "", str(summary["n_tasks"]), str(summary["n_success"]),
              f"[bold]{summary['success_rate']:.1%}[/]", str(summary["infra_errors"]))
    var = summary.get("variance")
    if var:
        t.caption = repeats_caption(var)
    return t


def repeats_caption(var: dict[str, Any]) -> str:
    """One line of a results.json's ``variance`` part (the tasks column above counts episodes)."""
    se = f" ± {var['standard_error']:.1%} (s.e.)" if var.get("standard_error") is not None else ""
    flips = f"{var['flip_rate']:.1%}" if var.get("flip_rate") is not None else "–"
    k = var["k"]
    return (f"{var['repeats']} repeats of {var['tasks']} tasks: success {var['mean_success_rate']:.1%}{se}, "
            f"pass@{k} {var['pass_at_k']:.1%}, pass^{k} {var['pass_hat_k']:.1%}, flip rate {flips}")


def print_table(summary: dict[str, Any], console: Console | None = None) -> None:
    (console or Console()).print(results_table(summary))


def write_results(out: Path, summary: dict[str, Any]) -> Path:
    p = out / "results.json"
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    tmp.replace(p)
    return p


_CSS = """body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{border:1px solid #ccc;
padding:3px 8px}.success{color:#070}.failure{color:#a00}.infra_error,.timeout{color:#b60}details{margin:.6em 0}
.step{display:inline-block;vertical-align:top;margin:4px;max-width:340px}.step img{width:320px;border:1px solid #999}
pre{white-space:pre-wrap;font-size:12px;margin:2px 0}"""


def write_report(out: Path, summary: dict[str, Any]) -> Path:
    """A static page: every task with score, status, steps (screenshot + actions); links are relative."""
    e = html.escape
    parts = [f"<!doctype html><meta charset=utf-8><title>osfarm eval {e(summary['run_id'])}</title>"
             f"<style>{_CSS}</style>",
             f"<h1>osfarm eval: {e(summary['agent'])}</h1>",
             (f"<p>run {e(summary['run_id'])}: {summary['n_success']}/{summary['n_tasks']} tasks succeeded "
              f"({summary['success_rate']:.1%}), {summary['infra_errors']} infra errors.</p>"),
             (f"<p class=repeats>{e(repeats_caption(summary['variance']))}</p>" if summary.get("variance") else ""),
             "<table><tr><th>domain</th><th>tasks</th><th>success rate</th></tr>"]
    for dom, d in summary["by_domain"].items():
        parts.append(f"<tr><td>{e(dom)}</td><td>{d['n']}</td><td>{d['success_rate']:.1%}</td></tr>")
    parts.append("</table><h2>Tasks</h2>")
    for r in summary["tasks"]:
        d = task_dir(out, r["domain"], r["task_id"], r.get("repeat"))
        rel = d.relative_to(out).as_posix()
        which = f" (repeat {r['repeat']})" if r.get("repeat") else ""
        head = (f"<summary><b>{e(r['domain'])}/{e(r['task_id'])}</b>{which} — <span class='{e(r['status'])}'>"
                f"{e(r['status'])}</span>, score {float(r['score'] or 0):g}</summary>")
        body = []
        if r.get("error"):
            body.append(f"<pre class=infra_error>{e(str(r['error']))}</pre>")
        traj = d / "traj.jsonl"
        if traj.is_file():
            for line in traj.read_text().splitlines():
                try:
                    s = json.loads(line)
                except ValueError:
                    continue
                img = f"<img src='{e(rel)}/{e(s['screenshot_file'])}' loading=lazy>" if s.get("screenshot_file") else ""
                acts = e(json.dumps(s.get("actions", s.get("action")), ensure_ascii=False, indent=1))
                err = f"<pre class=failure>{e(s['action_error'])}</pre>" if s.get("action_error") else ""
                body.append(f"<div class=step><div>step {s['step_num']}</div>{img}<pre>{acts}</pre>{err}</div>")
        parts.append(f"<details>{head}{''.join(body) or '<p>no steps</p>'}</details>")
    p = out / "report.html"
    p.write_text("\n".join(parts))
    return p
