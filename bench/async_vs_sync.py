"""Asynchronous vs synchronous RL on the same budget: learner samples/s and environment utilisation.

Each setting runs ``osfarm train`` (in process) for the same number of policy updates with the
same farm (``--envs`` sandbox desktops), policy server, model and task suite; only η changes:

* η = 0: synchronous (a batch is generated, then trained on, then the next is generated; the
  desktops sit idle while the learner trains and while the slowest episode of a batch finishes);
* η = 1, 2, 4: asynchronous (rollouts keep running while the learner trains, bounded staleness).

By default the learner runs on CPU 0 and everything else (farm, desktops, policy server) on the
other CPUs, in every setting: the machine is split the way a cluster splits trainer and inference
devices, so a mode that leaves one side idle pays for it (``--learner-cpus none`` shares all
CPUs: on a 2-core machine rollouts and learner then slow each other down and async gains little).

A real learner's update takes as long as the rollouts or longer (a 7B VLM on 15-step episodes);
the tiny model's takes 0.5 s. ``--update-ratios`` models it the way ``--delay-ms`` models the
policy's latency: a first η = 0 run measures a batch's rollout time R (wall per update minus the
update) and its samples per update S, then every η runs with each update held r × R / S seconds
per sample it trains (``learner.simulated_sample_s``, a sleep on the learner's thread) for each
ratio r. The hold is per sample, not per update, because a real update's time grows with its
batch and the settings' batches differ: a synchronous batch is whole episodes (8 × 5 steps = 40
samples) while an asynchronous one is cut where the newest episodes end (28-32); a fixed hold per
update would charge the bigger batch nothing extra and flatter samples/s of η = 0. With the
update as long as the rollouts, synchronous training waits for both in turn and asynchronous
overlaps them: up to 2x the samples/s.

Where the overlap goes on a small machine: GNOME desktops' warm resets (8-12 s under load) run on
the rollouts' path in an asynchronous run and during the update in a synchronous one, and on 2 cores
4 GNOME desktops, their resets and the policy server share one CPU: η = 2 then fell below η = 0
(0.88x). ``--desktop light`` keeps that CPU off the rollout side (the choice task reads no screen):
at update = rollouts η = 2 reached 1.88x, at the ceiling (R + U) / max(R, U) for each ratio. A
cluster sizes the farm's spare desktops (``local_farm_settings(spares=)``) to its reset time instead.

Throughput is measured from the first update to the last (the start-up and the first batch,
identical in all settings, are left out): learner samples/s = samples trained / wall seconds;
environment utilisation = busy desktop-seconds / (desktops × wall seconds); learner utilisation
= seconds spent in updates / wall seconds (where the overlap is lost shows in the two together).

``--quick`` (about 10 minutes on a loaded 2-core machine): 4 updates, 4 desktops, batch 4, policy
latency 1 s σ 0.5, η 0, 1, 2, 4 at update ratios 1, 0.5, 2 (``--out`` is written as each setting ends).

    python bench/async_vs_sync.py [--updates 5 --envs 8 --batch-size 8 --delay-ms 4000 --delay-sigma 1]
        [--etas 0,1,2,4] [--update-ratios 0.5,1,2 [--update-s 20]]
        [--learner-cpus 0|none] [--suite DIR --max-steps N] [--out figures.json] [--quick]

Default workload: the 5-step choice task of ``bench/fixtures/multistep_suite`` (each step a policy
call with lognormal latency, median 4 s, σ 1, as a GPU server's generation time varies with the
length of what it writes), 8 desktops, GRPO batch 8.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osfarm.trainer.config import load_train_config
from osfarm.trainer.loop import train
from osfarm.trainer.metrics import read_rows


def measure(rows: list[dict[str, Any]], envs: int) -> dict[str, float]:
    """Throughput over the windows of rows 2..N (each row's window starts at the previous row)."""
    if len(rows) < 2:
        raise ValueError("need at least 2 updates to measure a steady state")
    steady = rows[1:]
    wall = steady[-1]["time"] - rows[0]["time"]
    samples = sum(r["samples"] for r in steady)
    busy = sum(r["env_utilisation"] * envs * (r["time"] - prev["time"]) for prev, r in zip(rows, steady, strict=False))
    episodes = sum(r["episodes"] for r in steady)
    return {"wall_s": wall, "samples": samples, "samples_per_s": samples / wall,
            "episodes_per_s": episodes / wall, "env_utilisation": busy / (envs * wall),
            "update_s_mean": sum(r["update_s"] for r in steady) / len(steady),
            "learner_utilisation": sum(r["update_s"] for r in steady) / wall,
            "samples_per_update": samples / len(steady),
            # the run's own rollout time per update, less the update (of η = 0: the batch's rollouts)
            "rollout_s": max(wall / len(steady) - sum(r["update_s"] for r in steady) / len(steady), 0.0),
            "staleness_max": max(r["staleness_max"] for r in steady)}


def rollout_seconds(res: dict[str, float], updates: int) -> float:
    """A batch's rollout time in a synchronous run: its wall per update less the update itself."""
    return max(res["wall_s"] / (updates - 1) - res["update_s_mean"], 0.0)


def lease_wait(episodes: Path) -> float:
    """Mean seconds an episode waited for its desktop (the farm's reset of a released one): the
    synchronous mode resets during the update, off the rollouts' path; an asynchronous one
    resets while the other desktops run, on it (where this machine's overlap went: 7-18 s per
    episode at η = 2, warm resets timing out at 10 s under load and falling back to cold)."""
    waits = [json.loads(line)["timings"].get("lease", 0.0) for line in episodes.read_text().splitlines() if line]
    return sum(waits) / len(waits) if waits else 0.0


def sample_seconds(res: dict[str, float], updates: int, ratio: float) -> float:
    """The hold per sample that makes a synchronous update ``ratio`` × its batch's rollout time."""
    return ratio * rollout_seconds(res, updates) / res["samples_per_update"]


def run_one(eta: int, args: argparse.Namespace, root: Path, console: Console, sample_s: float = 0.0,
            name: str = "") -> dict[str, float]:
    run_dir = root / (name or f"eta{eta}")
    cfg = load_train_config(args.config, run_dir=run_dir, updates=args.updates, resume=False)
    cfg = cfg.model_copy(update={
        # groups of exactly one batch: with DART's n (8 while a task is unsolved) over a smaller batch
        # the capacity gets a slack of the largest group less one, and η = 0 then keeps rolling out
        # during the update (its desktops were 100 % busy through a 54 s update): no synchronous
        # baseline. A fixed n that tiles the batch also gives every update the same work.
        "rollout": cfg.rollout.model_copy(update={"eta": eta, "envs": args.envs, "batch_size": args.batch_size,
                                                  "max_steps": args.max_steps,
                                                  "options": {**cfg.rollout.options, "allocator": "fixed",
                                                              "group_size": args.batch_size}}),
        "agent": cfg.agent.model_copy(update={"screenshot": args.screenshot}),
        "suite": args.suite,
        # a group whose rewards are all equal still trains (zero advantages): every setting does the
        # same learner work per update and none stalls on a solved or hopeless task
        "data": cfg.data.model_copy(update={"options": {**cfg.data.options, "drop_no_signal": False}}),
        "policy": cfg.policy.model_copy(update={"delay_ms": args.delay_ms, "delay_sigma": args.delay_sigma}),
        "metrics": cfg.metrics.model_copy(update={"plot": False}),
        # a small step keeps the choice task from saturating: an all-success group has no GRPO
        # signal and is dropped, which would stall the run (throughput is measured, not learning)
        "learner": cfg.learner.model_copy(update={"lr": args.lr, "simulated_sample_s": sample_s}),
        "farm": cfg.farm.model_copy(update={"overrides": {**cfg.farm.overrides, "reset_mode": args.reset_mode,
                                                           "desktop": args.desktop},
                                            "spares": args.spares}),
        "max_episodes": args.max_episodes,
        "learner_cpus": args.learner_cpus,
    })
    console.rule(f"η = {eta}, update held {sample_s:.2f} s per sample")
    t0 = time.time()
    train(cfg, console)
    res = measure(read_rows(run_dir / "metrics.jsonl"), args.envs)
    res["lease_wait_s"] = lease_wait(run_dir / "episodes.jsonl")
    res["total_s"] = time.time() - t0
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=None, help="train.yaml (default: the embedded tiny setup)")
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--envs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--etas", default="0,1,2,4")
    ap.add_argument("--delay-ms", type=float, default=4000.0,
                    help="policy latency per request, median (a GPU server's generation time; 0: none)")
    ap.add_argument("--delay-sigma", type=float, default=1.0, help="lognormal sigma of that latency (0: fixed)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--suite", type=Path, default=Path(__file__).parent / "fixtures" / "multistep_suite",
                    help="task suite (default: a choice task of 5 policy calls per episode; a GUI agent's "
                         "episodes have many steps, each waiting on the policy)")
    ap.add_argument("--max-steps", type=int, default=5,
                    help="steps per episode (at least the task's osfarm_choice_steps)")
    ap.add_argument("--screenshot", action=argparse.BooleanOptionalAction, default=False,
                    help="send the screenshot to the policy (the choice task does not need it; on 2 CPUs the tiny "
                         "model's vision pass would be rollout CPU a GPU server does not cost)")
    ap.add_argument("--max-episodes", type=int, default=400, help="safety stop per setting")
    ap.add_argument("--learner-cpus", default="0",
                    help="CPUs of the learner, the rest run the rollouts (as a cluster's trainer and inference "
                         "devices); 'none': everything shares every CPU")
    ap.add_argument("--reset-mode", choices=("cold", "warm"), default="warm",
                    help="the in-process farm's reset_mode in every setting (the farm's default is warm; run once "
                         "with each to compare)")
    ap.add_argument("--desktop", choices=("gnome", "light"), default="gnome",
                    help="the desktops' session in every setting (the choice task reads no screen: light keeps "
                         "GNOME's CPU and its 8-12 s warm resets under load off a 2-core machine's rollout side)")
    ap.add_argument("--spares", type=int, default=1,
                    help="desktops kept ready beyond --envs (farm.spares): resets off the rollouts' path")
    ap.add_argument("--update-ratios", default="",
                    help="model a real learner: update held r × a batch's rollout time (measured by a first η=0 "
                         "run) for each r, e.g. 0.5,1,2 (default: the tiny model's own update time)")
    ap.add_argument("--sample-s", type=float, default=None,
                    help="with --update-ratios: the hold per sample in seconds, given (no measuring run; give one "
                         "ratio, it only labels the table)")
    ap.add_argument("--quick", action="store_true",
                    help="a smaller run that fits ~10 min: 4 updates, 4 desktops, batch 4, latency 1 s σ 0.5, "
                         "ratios 1, 0.5, 2 (the target first; flags given explicitly still win)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    if args.quick:
        quick = {"updates": 4, "envs": 4, "batch_size": 4, "delay_ms": 1000.0, "delay_sigma": 0.5,
                 "update_ratios": "1,0.5,2"}
        for k, v in quick.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    args.learner_cpus = None if args.learner_cpus == "none" else [int(c) for c in args.learner_cpus.split(",")]
    os.environ.setdefault("OSFARM_STATE_DIR", "/tmp/of-bench-async")
    console = Console(stderr=True)
    etas = [int(x) for x in args.etas.split(",")]
    ratios = [float(x) for x in args.update_ratios.split(",") if x]
    split = f"learner on CPUs {args.learner_cpus}, rollouts on the rest" if args.learner_cpus else "shared CPUs"
    title = (f"async vs sync: {args.updates} updates, {args.envs} desktops, batch {args.batch_size}, policy latency "
             f"{args.delay_ms:g} ms σ {args.delay_sigma:g}, {split}, {args.desktop} desktops + {args.spares} spare, "
             f"{args.reset_mode} resets")
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="osfarm-async-bench-") as tmp:
        if not ratios:
            results = {eta: run_one(eta, args, Path(tmp), console) for eta in etas}
            show(results, title)
            figures = {str(k): v for k, v in results.items()}
        else:
            if args.sample_s is not None:  # given: no measuring run
                base = {"samples_per_update": float("nan")}
                rollout_s = float("nan")
            else:
                base = run_one(0, args, Path(tmp), console, name="measure")
                rollout_s = rollout_seconds(base, args.updates)
                figures.update(measured=base, rollout_s=rollout_s)
            every: dict[str, dict[int, dict[str, float]]] = {}
            for r in ratios:
                per = args.sample_s if args.sample_s is not None else sample_seconds(base, args.updates, r)
                every[f"{r:g}"] = {}
                for eta in etas:
                    every[f"{r:g}"][eta] = run_one(eta, args, Path(tmp), console, per, f"r{r:g}-eta{eta}")
                    figures[f"ratio {r:g}"] = {str(k): v for k, v in every[f"{r:g}"].items()}
                    if args.out:  # as each setting ends: a long run cut short keeps what it measured
                        args.out.write_text(json.dumps(figures, indent=2))
            for r, results in every.items():  # the tables together at the end, where they are read
                per = args.sample_s if args.sample_s is not None else sample_seconds(base, args.updates, float(r))
                show(results, f"{title}; update held {per:.2f} s per sample = {r} × a batch's rollout time "
                              f"{rollout_s:.1f} s over its {base['samples_per_update']:.0f} samples")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))


def show(results: dict[int, dict[str, float]], title: str) -> None:
    base = results.get(0)
    if base and base["rollout_s"] > 0:  # the measuring run and this one may meet another load
        title += (f"; η = 0's own rollouts {base['rollout_s']:.1f} s per update: update / rollouts = "
                  f"{base['update_s_mean'] / base['rollout_s']:.2f}")
    table = Table(title=title)
    for col in ("η", "samples/s", "× sync", "episodes/s", "× sync", "env util", "learner util", "samples/update",
                "update s", "lease wait s", "max staleness", "wall s"):
        table.add_column(col, justify="right")
    for eta, r in results.items():
        ratio = r["samples_per_s"] / base["samples_per_s"] if base else float("nan")
        eps = r["episodes_per_s"] / base["episodes_per_s"] if base else float("nan")
        table.add_row(str(eta), f"{r['samples_per_s']:.3f}", f"{ratio:.2f}", f"{r['episodes_per_s']:.3f}",
                      f"{eps:.2f}", f"{r['env_utilisation']:.2f}", f"{r['learner_utilisation']:.2f}",
                      f"{r['samples_per_update']:.1f}", f"{r['update_s_mean']:.1f}", f"{r['lease_wait_s']:.1f}",
                      str(r["staleness_max"]),
                      f"{r['wall_s']:.0f}")
    Console(width=200).print(table)  # whole columns when piped to a file


if __name__ == "__main__":
    main()
