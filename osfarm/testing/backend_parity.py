"""Backend parity: the same agent on the same tasks must score the same on sandbox, Docker and
libvirt desktops. One ``osfarm eval`` run per (backend, agent, task set) gives each task's
(status, score); :func:`agreement` compares every backend's scores with the reference backend's.

tests/test_provider_conformance.py asserts the agreement on its farms; bench/backend_parity.py
prints the whole table. A run is cached for the session under its key, so a run one test made
(test_offline_suite's noop run, the conformance module's sandbox replay) is not repeated by the
next that needs the same scores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from osfarm.providers.libvirt import kvm_usable
from osfarm.testing.provider_options import provider_options

ROOT = Path(__file__).resolve().parent.parent.parent
OFFLINE_SUITE = ROOT / "suites" / "osfarm-offline"
OSWORLD_TASKS = ROOT.parent / "shared" / "osworld" / "tasks"  # OSWorld's own task files, read in place
OSWORLD_COMPAT = ROOT / "tests" / "osworld_compat"  # their generated input files and scripted solutions

# Where KVM cannot boot our VMs (no /dev/kvm, or a nested PVM host), libvirt runs under TCG
# emulation: a desktop VM then boots in minutes, not seconds, so its farm keeps one VM, reverts
# its memory snapshot on every reset (libvirt_reset=snapshot: it boots once) and waits for
# desktops as long as a boot takes.
TCG = kvm_usable()  # None where KVM works, else why not
SLOW_BOOT = {"libvirt": TCG is not None}


def desktop_wait_s(name: str) -> float:
    """How long a lease (or a farm's warm-up) may wait for a desktop of provider ``name``."""
    return 1500.0 if SLOW_BOOT.get(name) else 120.0


def farm_options(name: str) -> dict[str, Any]:
    """provider_options for a farm whose desktops run evals: where a boot is slow, one desktop
    that resets by reverting its snapshot (the provider itself allows a boot its time under TCG)."""
    if SLOW_BOOT.get(name):
        return {**provider_options(name), "pool_min": 1, "pool_max": 1, "libvirt_reset": "snapshot",
                "lease_ttl_s": desktop_wait_s(name)}
    return {**provider_options(name), "pool_min": 1, "pool_max": 2}


Score = tuple[str, float]  # (status, score) of one task's episode


@dataclass(frozen=True)
class TaskSet:
    """Tasks an eval runs: a suite folder, an index {domain: [task id]}, and where their files
    and (for OSWorld's tasks, which carry none) reference solutions are."""

    name: str
    suite: Path
    index: dict[str, list[str]] = field(hash=False)
    cache: Path | None = None
    solutions: Path | None = None

    @property
    def task_ids(self) -> list[str]:
        return [t for ids in self.index.values() for t in ids]


def offline_tasks(index: dict[str, list[str]]) -> TaskSet:
    """Tasks of osfarm's offline suite (each carries its reference solution)."""
    return TaskSet("offline", OFFLINE_SUITE, index)


def osworld_tasks(workdir: Path) -> TaskSet:
    """OSWorld's own task files that a desktop here can host (all of them: none needs a Google
    account or a live web page), with their generated input files written under ``workdir``."""
    cache = workdir / "cache"
    if not (cache / "url_map.json").is_file():
        r = subprocess.run([sys.executable, str(OSWORLD_COMPAT / "generate.py"), str(workdir)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"generating OSWorld's task files failed: {r.stderr[-2000:]}")
    index: dict[str, list[str]] = {}
    for path in sorted(OSWORLD_TASKS.glob("*/*.json")):
        index.setdefault(path.parent.name, []).append(path.stem)
    return TaskSet("osworld", OSWORLD_TASKS, index, cache=cache, solutions=OSWORLD_COMPAT / "solutions")


RunKey = tuple[str, str, str, str, tuple[str, ...]]  # backend, desktop session, agent, task set, task ids
_runs: dict[RunKey, dict[str, Score]] = {}


def remember(backend: str, desktop: str, agent: str, tasks: TaskSet, scores: dict[str, Score]) -> None:
    """Keep a run another test made (its own way) on ``desktop`` sessions for the rest of the session."""
    _runs[(backend, desktop, agent, tasks.name, tuple(sorted(tasks.task_ids)))] = scores


def known(backend: str, desktop: str, agent: str, tasks: TaskSet) -> dict[str, Score] | None:
    """The scores of a run this session already made on exactly these tasks, or of a run over a
    superset of them (the offline suite's full noop run answers for any of its tasks)."""
    want = set(tasks.task_ids)
    for (b, d, a, name, ids), scores in _runs.items():
        if (b, d, a, name) == (backend, desktop, agent, tasks.name) and want <= set(ids):
            return {t: scores[t] for t in tasks.task_ids}
    return None


def scores_of(results: dict) -> dict[str, Score]:
    """(status, score) per task of an eval's results.json."""
    return {t["task_id"]: (t["status"], float(t["score"])) for t in results["tasks"]}


def eval_scores(backend: str, desktop: str, agent: str, tasks: TaskSet, out: Path, *, url: str | None = None,
                token: str | None = None, envs: int = 1, timeout_s: float = 3600.0) -> dict[str, Score]:
    """`osfarm eval --agent AGENT` on ``tasks`` in a process of its own: on the farm at ``url``
    when given (its desktops are ``backend``'s ``desktop`` sessions), else on a farm the eval
    starts with provider ``backend`` and that session. Cached for the session; raises with the
    eval's output when it fails or reports an infrastructure error (a parity table must not
    count a crash as a score)."""
    cached = known(backend, desktop, agent, tasks)
    if cached is not None:
        return cached
    out.mkdir(parents=True, exist_ok=True)
    index = out / "index.json"
    index.write_text(json.dumps(tasks.index))
    where = ["--url", url, "--token", token or ""] if url else ["--provider", backend]
    extra = [*(["--cache", str(tasks.cache)] if tasks.cache else []),
             *(["--solutions", str(tasks.solutions)] if tasks.solutions and agent == "replay" else [])]
    state = tempfile.mkdtemp(prefix=f"ofp{backend[:2]}", dir="/tmp")  # short: guest sockets live below it
    try:
        r = subprocess.run(
            [sys.executable, "-m", "osfarm.cli", "eval", "--suite", str(tasks.suite), "--index", str(index),
             "--agent", agent, *where, *extra, "--envs", str(envs), "--out", str(out / "run"), "--no-progress"],
            env=dict(os.environ, OSFARM_STATE_DIR=state, OSFARM_DESKTOP=desktop),
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
    finally:
        shutil.rmtree(state, ignore_errors=True)
    if r.returncode != 0:
        what = f"osfarm eval ({backend}, {agent}, {tasks.name})"
        raise RuntimeError(f"{what} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    # nothing stray on stderr, e.g. an event loop's "Exception in callback ... InvalidStateError"
    if "InvalidStateError" in r.stderr or "Traceback" in r.stderr:
        raise RuntimeError(f"osfarm eval ({backend}, {agent}, {tasks.name}) logged an error:\n{r.stderr[-3000:]}")
    results = json.loads((out / "run" / "results.json").read_text())
    if results["infra_errors"]:
        raise RuntimeError(f"osfarm eval ({backend}, {agent}, {tasks.name}): {results['infra_errors']} infra errors")
    scores = scores_of(results)
    remember(backend, desktop, agent, tasks, scores)
    return scores


def agreement(by_backend: dict[str, dict[str, Score]], reference: str = "sandbox") -> dict[str, tuple[int, int]]:
    """Per backend: (tasks on which it gives the reference's status and score, tasks both ran)."""
    ref = by_backend[reference]
    out: dict[str, tuple[int, int]] = {}
    for backend, scores in by_backend.items():
        ran = [t for t in ref if t in scores]
        out[backend] = (sum(scores[t] == ref[t] for t in ran), len(ran))
    return out
