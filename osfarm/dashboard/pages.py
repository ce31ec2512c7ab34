"""The dashboard's pages as HTML: the data each page shows, gathered from the runs root, and its
Jinja template rendered with autoescaping (run dirs hold model output: text from an attacker).

The same functions serve ``/ui`` and write the exported site; only the :mod:`links` differ.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from osfarm.dashboard.compare import compare
from osfarm.dashboard.confined import Refused
from osfarm.dashboard.links import ServerLinks, SiteLinks
from osfarm.dashboard.marks import Mark, marks_of
from osfarm.dashboard.runs import EvalRun, RunsRoot
from osfarm.http.principals import Principal
from osfarm.runner.results import GROUPS

# The dashboard's own pages load scripts, styles and images from the dashboard only; nothing
# inline runs, nothing is fetched from elsewhere.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; media-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")

# Charts of a training run, in order: (title, [(line name, source, key)]); source "train" is
# metrics.jsonl, "eval" the held-out evaluations (eval.jsonl).
TRAINING_CHARTS: list[tuple[str, list[tuple[str, str, str]]]] = [
    ("reward", [("reward", "train", "reward"), ("batch reward", "train", "batch_reward")]),
    ("success", [("train success", "train", "success_rate"), ("held-out success", "eval", "success_rate")]),
    ("staleness", [("max", "train", "staleness_max"), ("mean", "train", "staleness_mean")]),
    ("loss", [("loss", "train", "loss")]),
    ("KL", [("kl", "train", "kl"), ("kl to behaviour", "train", "kl_behav")]),
    ("entropy", [("entropy", "train", "entropy")]),
    # a cluster run (rollout.executor celery): jobs out and the records not yet taken from the stream
    ("queue", [("queued", "train", "queue_queued"), ("running", "train", "queue_running"),
               ("stream lag", "train", "queue_stream_lag"), ("stream pending", "train", "queue_stream_pending")]),
]
WORKER_PREFIX = "rollouts_worker_"  # a cluster run's row: the episodes each worker ran (one chart, a line each)
_SHOWN_KEYS = {k for _t, lines in TRAINING_CHARTS for _n, src, k in lines if src == "train"} | {"version", "time"}


def fnum(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "–" if v is None else str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def script_json(value: Any) -> Markup:
    """JSON to put inside ``<script type="application/json">``: no ``<``, ``>`` or ``&`` can end
    the element or open a comment, whatever strings it holds."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, default=str)
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


_env = Environment(loader=PackageLoader("osfarm.dashboard", "templates"), autoescape=True,
                   undefined=StrictUndefined, trim_blocks=False, lstrip_blocks=False)
_env.globals.update(fnum=fnum)


@dataclass
class Frame:
    """What every page gets: how to link, who is looking, what this dashboard has."""

    links: ServerLinks | SiteLinks
    principal: Principal | None = None
    csrf: str = ""
    has_runs: bool = False
    has_farm: bool = False
    runs_root: str = ""


def render(name: str, frame: Frame, **ctx: Any) -> str:
    return _env.get_template(name).render(
        L=frame.links, principal=frame.principal, csrf=frame.csrf, has_runs=frame.has_runs,
        has_farm=frame.has_farm, runs_root=frame.runs_root, static_site=frame.links.static_site,
        csp_meta=CSP.replace(" frame-ancestors 'none';", ""),
        **ctx,
    )


# -- the run pages ------------------------------------------------------------------------------


def leaderboard(root: RunsRoot, frame: Frame, compare_pairs: list[tuple[str, str]] | None = None) -> str:
    runs = root.eval_runs()
    groups = [g for g in GROUPS if any(g in r.summary.by_group for r in runs)]
    domains = sorted({d for r in runs for d in r.summary.by_domain})
    return render("leaderboard.html", frame, runs=runs, groups=groups, domains=domains,
                  trainings=root.training_runs(), compare_pairs=compare_pairs,
                  repeated=any(r.repeats is not None for r in runs))


def run_page(root: RunsRoot, frame: Frame, key: str) -> str:
    run = root.eval_run(key)
    infra = [r for r in run.rows if r.status == "infra_error"]
    by_domain: dict[str, int] = {}
    for r in infra:
        by_domain[r.domain] = by_domain.get(r.domain, 0) + 1
    return render("run.html", frame, run=run, tasks=[r for r in run.rows if r.status != "infra_error"],
                  infra=infra, infra_by_domain=by_domain)


@dataclass
class StepView:
    index: int
    screenshot: str | None
    size: tuple[int, int] | None
    marks: list[Mark]
    response: str | None
    actions_text: str
    action_error: str | None
    a11y: str | None
    after: str | None
    t_model_ms: Any
    t_env_ms: Any


def _png_size(root: RunsRoot, key: str, rel: str) -> tuple[int, int] | None:
    try:
        with root.dir.open(root.run_file(key, rel)) as (fd, _st):
            head = os.pread(fd, 24, 0)
    except Refused:
        return None
    if len(head) == 24 and head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        w, h = struct.unpack(">II", head[16:24])
        return (w, h) if 0 < w < 100_000 and 0 < h < 100_000 else None
    return None


def _ref_path(ref: Any) -> str | None:
    return ref.get("path") if isinstance(ref, dict) and isinstance(ref.get("path"), str) else None


def episode_steps(root: RunsRoot, key: str, rec: dict[str, Any]) -> tuple[list[StepView], str | None, list[str]]:
    """The step views of an episode record, its recording and the run files the page shows."""
    files = root.task_files(key, rec.get("domain", ""), rec["task_id"], rec.get("repeat"))
    shown: list[str] = []
    steps = []
    for s in rec.get("steps") or []:
        obs = s.get("observation") or {}
        shot, a11y = _ref_path(obs.get("screenshot")), _ref_path(obs.get("a11y"))
        after = files["after"].get(s.get("index"))
        model = s.get("model") or {}
        actions = s.get("actions") or []
        text = "\n".join(a if isinstance(a, str) else json.dumps(a, ensure_ascii=False) for a in actions)
        steps.append(StepView(
            index=s.get("index"), screenshot=shot, size=_png_size(root, key, shot) if shot else None,
            marks=marks_of(actions), response=model.get("response_text"), actions_text=text or "–",
            action_error=s.get("action_error"), a11y=a11y, after=after, t_model_ms=s.get("t_model_ms"),
            t_env_ms=s.get("t_env_ms"),
        ))  # fmt: skip
        shown += [p for p in (shot, a11y, after) if p]
    if files["recording"]:
        shown.append(files["recording"])
    return steps, files["recording"], shown


def episode_page(root: RunsRoot, frame: Frame, key: str, episode_id: str) -> str:
    run = root.eval_run(key)
    rec = root.episode(key, episode_id)
    steps, recording, _ = episode_steps(root, key, rec)
    return render("episode.html", frame, run=run, rec=rec, steps=steps, recording=recording, takeovers=takeovers(rec))


def takeovers(rec: dict[str, Any]) -> list[tuple[str, str]]:
    """(who, for how long) of each dashboard take-over recorded in an episode."""
    out = []
    for c in rec.get("controlled_by") or []:
        if not isinstance(c, dict):
            continue
        start, end = c.get("started_at"), c.get("ended_at")
        if isinstance(start, (int, float)) and isinstance(end, (int, float)):
            took = f"{end - start:.0f} s"
        else:
            took = "until the end"
        out.append((str(c.get("by", "?")), took))
    return out


def compare_page(root: RunsRoot, frame: Frame, a: str, b: str) -> str:
    ra, rb = root.eval_run(a), root.eval_run(b)
    return render("compare.html", frame, a=ra, b=rb, cmp=compare(ra, rb))


def training_data(rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The charts of a training run: each line a list of [policy version, value]."""

    def points(src: list[dict[str, Any]], k: str) -> list[list[float]]:
        out = []
        for i, r in enumerate(src):
            v, x = r.get(k), r.get("version", i)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(x, (int, float)):
                if v == v and abs(v) != float("inf"):  # NaN/inf are not drawable
                    out.append([x, v])
        return out

    charts = []
    for title, lines in TRAINING_CHARTS:
        got = [{"name": n, "points": points(rows if src == "train" else eval_rows, k)} for n, src, k in lines]
        got = [g for g in got if g["points"]]
        if got:
            charts.append({"key": title, "title": title, "lines": got})
    workers = sorted({k for r in rows for k in r if k.startswith(WORKER_PREFIX)})
    if workers:
        charts.append({"key": "workers", "title": "rollouts per worker",
                       "lines": [{"name": k.removeprefix(WORKER_PREFIX), "points": points(rows, k)} for k in workers]})
    # the staleness histogram over the run: a line per staleness, the samples of each update at it
    stale = sorted({int(k) for r in rows for k in (r.get("staleness_hist") or {})})
    if stale:
        hist = [{**r, **{f"stale_{k}": n for k, n in (r.get("staleness_hist") or {}).items()}} for r in rows]
        charts.append({"key": "staleness_hist", "title": "samples by staleness",
                       "lines": [{"name": f"{k} behind", "points": points(hist, f"stale_{k}")} for k in stale]})
    others = sorted({k for r in rows for k, v in r.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _SHOWN_KEYS
                     and not k.startswith(WORKER_PREFIX)})
    for k in others:
        pts = points(rows, k)
        if pts:
            charts.append({"key": k, "title": k, "lines": [{"name": k, "points": pts}]})
    return {"charts": charts}


def training_page(root: RunsRoot, frame: Frame, key: str) -> str:
    run = root.training_run(key)
    return render("training.html", frame, run=run, data_json=script_json(training_data(run.rows, run.eval_rows)),
                  last_json=json.dumps(run.last, indent=1, default=str))


def same_suite_pairs(runs: list[EvalRun], limit: int = 200) -> list[tuple[str, str]]:
    """Pairs worth comparing in an exported site: each run against the earlier runs of its suite."""
    pairs: list[tuple[str, str]] = []
    ordered = sorted(runs, key=lambda r: r.started_at or 0.0)
    for i, b in enumerate(ordered):
        for a in reversed(ordered[:i]):
            if a.suite == b.suite and len(pairs) < limit:
                pairs.append((a.key, b.key))
    return pairs

