"""Harness overhead per task and episodes/hour of the replay agent, in one run.

For a slice of an OSWorld-format suite (the first K tasks of every domain, infeasible ones
excluded), runs ``osfarm eval --agent replay`` on an in-process farm at --envs 1, 2 and 4 and
reads the phase timings of every episode record:

* overhead = lease (a reset desktop from the pool) + setup (the task's config: downloads, app
  start, window waits) + evaluate (postconfig, getters, metric): everything but the agent;
* agent = the replay agent's steps (actions and the settled observation after each).

The comparison row is OSWorld's harness floor (its run scripts' fixed sleeps): 60 s fixed
sleep after reset + 20 s before evaluating + 2 s after every step — waits alone, before its
VM snapshot revert; not measured here.

CPU-seconds per episode: the harness process's own (os.times), and the desktops' from their
cgroups through the farm's ``osfarm_desktop_cpu_seconds_total`` (box starts, resets and
episodes; "of which resets" is the reset phase).

Every --envs run is made once per reset mode of ``--reset-modes`` (the farm's ``reset_mode``;
default cold,warm), and the throughput table compares them side by side (issue 15: warm vs cold).
``--timings`` adds the action timing as a third axis (issue 26 item 4: episodes/hour with
``osworld``, ``settle`` and ``fast`` side by side; ``all`` = every timing the wire layer knows).

Usage: python bench/task_overhead.py [--suite DIR] [--per-domain K] [--envs 1,2,4] [--reset-modes cold,warm]
       [--timings osworld,settle,fast]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from datetime import datetime
from pathlib import Path
from typing import cast, get_args

from rich.console import Console
from rich.table import Table

from osfarm.farm import metrics
from osfarm.runner.results import read_episodes
from osfarm.runner.run import RunOptions, run_eval
from osfarm.schema.guest import DEFAULT_ACTION_TIMING, ActionTiming
from osfarm.tasks.suite import load_suite

ROOT = Path(__file__).resolve().parent.parent
OSWORLD_FIXED_S = 60.0 + 20.0
OSWORLD_PER_STEP_S = 2.0
OFFICE = ("libreoffice_calc", "libreoffice_writer", "libreoffice_impress")


def slice_index(suite_dir: Path, per_domain: int) -> dict[str, list[str]]:
    index: dict[str, list[str]] = {}
    for t in load_suite(suite_dir):
        if t.evaluator.func == "infeasible":
            continue
        ids = index.setdefault(t.domain, [])
        if len(ids) < per_domain:
            ids.append(t.id)
    return index


def _ts(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()


# (timing, mode, envs) -> CPU-s of the run: the harness, the desktops (starts, resets, episodes), their resets
CPU: dict[tuple[str, str, int], tuple[float, float, float]] = {}
PHASES = ("start", "reset", "episode")


def desktop_cpu() -> dict[str, float]:
    """The in-process farm's osfarm_desktop_cpu_seconds_total by phase: read from each desktop's
    cgroup, so it counts what a killed box's processes used too. This process's os.times did not
    (one cold run: 3.3 CPU-s per episode there, 5.5 by the cgroups; why was not traced)."""
    return {ph: metrics.REGISTRY.get_sample_value("osfarm_desktop_cpu_seconds_total", {"phase": ph}) or 0.0
            for ph in PHASES}


def run_once(suite: Path, index_file: Path, envs: int, out: Path, reset_mode: str = "cold",
             timing: ActionTiming = "osworld") -> list[dict]:
    os.environ["OSFARM_STATE_DIR"] = tempfile.mkdtemp(prefix="oto", dir="/tmp")
    opts = RunOptions(suite=suite, agent="replay", out=out, index=index_file, envs=envs, progress=False,
                      farm_overrides={"reset_mode": reset_mode}, action_timing=timing)
    t0, d0 = os.times(), desktop_cpu()
    res = run_eval(opts)
    t1, d1 = os.times(), desktop_cpu()
    # This process is the farm, the runner and the agent (its own CPU); the desktops' is their cgroups'.
    CPU[timing, reset_mode, envs] = (t1.user - t0.user + t1.system - t0.system,
                             sum(d1[ph] - d0[ph] for ph in PHASES), d1["reset"] - d0["reset"])
    if res["success_rate"] != 1.0:
        bad = [t["task_id"] for t in res["tasks"] if t["status"] != "success"]
        Console(stderr=True).print(f"[yellow]{timing} {reset_mode} envs={envs}: replay did not solve {bad} "
                                   "(still timed)")
    return read_episodes(out / "episodes.jsonl")


def overhead(rec: dict) -> float:
    t = rec["timings"]
    return t.get("lease", 0.0) + t.get("setup", 0.0) + t.get("evaluate", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", type=Path, default=ROOT / "suites" / "osfarm-offline")
    ap.add_argument("--per-domain", type=int, default=2)
    ap.add_argument("--envs", default="1,2,4")
    ap.add_argument("--reset-modes", default="cold,warm",
                    help="comma-separated farm reset modes to compare side by side (cold,warm; warm is the farm's "
                         "default, with its cold_every)")
    ap.add_argument("--timings", default=DEFAULT_ACTION_TIMING,
                    help="comma-separated action timings to compare side by side (settle, osworld, fast: "
                         "osfarm.schema.guest.ActionTiming); 'all' = every one (default: %(default)s, osfarm's)")
    args = ap.parse_args()
    envs_list = [int(x) for x in args.envs.split(",")]
    modes = [m.strip() for m in args.reset_modes.split(",") if m.strip()]
    if not modes or not set(modes) <= {"cold", "warm"}:
        ap.error(f"--reset-modes: expected cold and/or warm, got {args.reset_modes!r}")
    known = get_args(ActionTiming)
    timings = list(known) if args.timings == "all" else [t.strip() for t in args.timings.split(",") if t.strip()]
    if not timings or not set(timings) <= set(known):
        ap.error(f"--timings: expected some of {', '.join(known)} (or all), got {args.timings!r}")
    console = Console(width=150)
    work = Path(tempfile.mkdtemp(prefix="osfarm-bench-overhead-"))
    index = slice_index(args.suite, args.per_domain)
    (work / "index.json").write_text(json.dumps(index))
    n_tasks = sum(len(v) for v in index.values())
    console.print(f"{n_tasks} tasks ({args.per_domain} per domain), replay agent, envs {envs_list}, "
                  f"reset modes {modes}, action timings {timings}; work dir {work}")

    # timing-major order within each envs value and mode: the timings of one setting run next to each other
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for n in envs_list:
        for mode in modes:
            for timing in timings:
                runs[timing, mode, n] = run_once(args.suite, work / "index.json", n,
                                                 work / f"{timing}-{mode}-envs{n}", mode, cast(ActionTiming, timing))

    # per-domain overhead: the least contended run (fewest envs) is the harness's own cost
    for timing in timings:
        for mode in modes:
            overhead_table(console, runs[timing, mode, min(envs_list)],
                           f"{timing} timing, {mode} reset, envs={min(envs_list)}")

    thr = Table(title="replay throughput")
    for c in ("timing", "reset", "envs", "episodes", "solved", "wall s", "agent s/ep", "episodes/hour",
              "vs osworld", "vs envs=1", "vs cold", "CPU-s/ep harness", "CPU-s/ep desktops", "of which resets",
              "CPU-s/ep total"):
        thr.add_column(c, justify="right")
    eph: dict[tuple[str, str, int], float] = {}
    for key, recs in runs.items():
        span = max(_ts(r["finished_at"]) for r in recs) - min(_ts(r["started_at"]) for r in recs)
        eph[key] = len(recs) / span * 3600
    for timing in timings:
        for mode in modes:
            for n in envs_list:
                key = (timing, mode, n)
                vs_cold = f"{eph[key] / eph[timing, 'cold', n]:.2f}x" if (timing, "cold", n) in eph else "-"
                vs_osworld = f"{eph[key] / eph['osworld', mode, n]:.2f}x" if ("osworld", mode, n) in eph else "-"
                recs = runs[key]
                span = len(recs) / eph[key] * 3600
                solved = sum(r.get("score") == 1.0 for r in recs)
                agent = statistics.median(r["timings"].get("agent", 0.0) for r in recs)
                harness, desks, resets = (v / len(recs) for v in CPU[key])
                thr.add_row(timing, mode, str(n), str(len(recs)), f"{solved}/{len(recs)}", f"{span:.1f}",
                            f"{agent:.2f}", f"{eph[key]:.0f}", vs_osworld,
                            f"{eph[key] / eph[timing, mode, envs_list[0]]:.2f}x", vs_cold,
                            f"{harness:.2f}", f"{desks:.2f}", f"{resets:.2f}", f"{harness + desks:.2f}")
    console.print(thr)
    console.print(f"(this machine: {os.cpu_count()} cores; desktops and the harness share them)")


def overhead_table(console: Console, base: list[dict], label: str) -> None:
    tab = Table(title=f"harness overhead per task (replay, {label}), median seconds")
    for c in ("domain", "tasks", "lease", "setup", "evaluate", "overhead", "agent", "OSWorld waits", "ratio"):
        tab.add_column(c, justify="left" if c == "domain" else "right")
    domains = sorted({r["domain"] for r in base})
    for dom in domains + ["office docs", "all"]:
        recs = [r for r in base if r["status"] != "infra_error" and (
            dom == "all" or r["domain"] == dom or (dom == "office docs" and r["domain"] in OFFICE))]
        if not recs:
            continue
        med = {k: statistics.median(r["timings"].get(k, 0.0) for r in recs)
               for k in ("lease", "setup", "evaluate", "agent")}
        ov = statistics.median(overhead(r) for r in recs)
        osw = statistics.median(OSWORLD_FIXED_S + OSWORLD_PER_STEP_S * len(r["steps"]) for r in recs)
        tab.add_row(dom, str(len(recs)), f"{med['lease']:.2f}", f"{med['setup']:.2f}", f"{med['evaluate']:.2f}",
                    f"{ov:.2f}", f"{med['agent']:.2f}", f"{osw:.0f}", f"{osw / ov:.1f}x")
    console.print(tab)


if __name__ == "__main__":
    main()
