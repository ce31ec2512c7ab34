"""``osfarm report export RUNS_DIR --out site/``: the dashboard's run pages as static files, for
publishing a leaderboard (any static web server, or opened from disk).

Layout of the site::

    index.html                         the leaderboard (eval and training runs)
    runs/<run>/index.html              a run
    runs/<run>/episodes/<episode>.html an episode
    runs/<run>/files/<file>            the screenshots, a11y trees and recordings those pages show
    compare/<a>--<b>.html              each run against the earlier runs of its suite
    training/<run>.html                a training run's charts
    static/                            the stylesheet and scripts

Files are read from the runs root through the same confinement as the server (a symlink in a run
dir is never followed) and written only under ``out``, with names made by
:func:`~osfarm.dashboard.links.slug`. Text files (a11y trees) become ``.txt``: nothing copied
from a run dir is ever HTML or script.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from osfarm.dashboard import pages
from osfarm.dashboard.assets import ASSETS
from osfarm.dashboard.confined import Refused
from osfarm.dashboard.links import SiteLinks, site_file_name, slug
from osfarm.dashboard.runs import EvalRun, RunsRoot


@dataclass
class ExportReport:
    out: Path
    pages: int = 0
    files: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # run files that could not be copied, and why


def _frame(root: RunsRoot, here: str) -> pages.Frame:
    return pages.Frame(links=SiteLinks(here), has_runs=True, has_farm=False, runs_root=root.root.name)


def _write(out: Path, rel: str, html: str, report: ExportReport) -> None:
    p = out / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(html, encoding="utf-8")
    report.pages += 1


def _copy(root: RunsRoot, run: EvalRun, rel: str, out: Path, report: ExportReport) -> None:
    dest = out / SiteLinks.run_dir(run.key) / "files" / site_file_name(rel)
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with root.dir.open(root.run_file(run.key, rel)) as (fd, st), open(dest, "wb") as f:
            pos = 0
            while pos < st.st_size:
                chunk = os.pread(fd, min(1 << 20, st.st_size - pos), pos)
                if not chunk:
                    break
                f.write(chunk)
                pos += len(chunk)
    except Refused as e:
        dest.unlink(missing_ok=True)
        report.skipped.append(f"{run.key}: {e}")
        return
    report.files += 1
    report.bytes += pos


def export_site(runs_dir: Path, out: Path) -> ExportReport:
    root = RunsRoot(runs_dir)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = ExportReport(out)
    for name, data in ASSETS.items():
        (out / "static").mkdir(exist_ok=True)
        (out / "static" / name).write_bytes(data)
    runs = root.eval_runs()
    pairs = pages.same_suite_pairs(runs)
    _write(out, "index.html", pages.leaderboard(root, _frame(root, "index.html"), compare_pairs=pairs), report)
    for run in runs:
        base = SiteLinks.run_dir(run.key)
        _write(out, f"{base}/index.html", pages.run_page(root, _frame(root, f"{base}/index.html"), run.key), report)
        for row in run.rows:
            if not row.episode_id:
                continue
            here = f"{base}/episodes/{slug(row.episode_id)}.html"
            frame = _frame(root, here)
            try:
                rec = root.episode(run.key, row.episode_id)
            except Refused as e:
                _write(out, here, pages.render("error.html", frame, status=404, message=str(e)), report)
                continue
            steps, recording, shown = pages.episode_steps(root, run.key, rec)
            _write(out, here, pages.render("episode.html", frame, run=run, rec=rec, steps=steps, recording=recording,
                                           takeovers=pages.takeovers(rec)), report)
            for rel in shown:
                _copy(root, run, rel, out, report)
    for a, b in pairs:
        here = f"compare/{slug(a)}--{slug(b)}.html"
        _write(out, here, pages.compare_page(root, _frame(root, here), a, b), report)
    for t in root.training_runs():
        here = f"training/{slug(t.key)}.html"
        _write(out, here, pages.training_page(root, _frame(root, here), t.key), report)
    return report
