"""Environment utilisation: synchronous batches vs rollout-wise scheduling (DART's comparison).

One run, real desktops: an in-process farm of ``--envs`` sandbox desktops, and for each mode
the same seeded, endless sequence of episodes fed for ``--seconds`` of wall clock (a trainer
keeps asking for rollouts; what is in flight at the end finishes, clipped to the window):

* sync batches: ``envs`` episodes start together; the next batch starts when the whole batch
  has finished (the barrier of batch rollout);
* rollout-wise: up to ``envs`` episodes in flight; the next starts the moment any finishes
  (``RolloutScheduler``, the same code ``osfarm eval`` uses).

The policy is heavy-tailed on both axes: episode k gets a step budget from a lognormal
(median ``--steps-median``, sigma ``--steps-sigma``, clipped to [1, ``--max-steps``]) and every
step's model latency is lognormal (median ``--think-ms``, sigma ``--think-sigma``). Two policies:

* ``--policy sleep`` (default): a bench agent that waits the drawn latency (the model's time)
  and then moves the mouse to a random point; every step is a real farm step with a settled
  screenshot observation. Honest about what it is: the latency is synthetic, the environment is real.
* ``--policy vlm --model-url URL --model NAME``: the VLM agent against an OpenAI-compatible
  server (e.g. ``osfarm policy serve --model tiny --delay-ms MEAN --delay-sigma S``: then the
  latency knob lives in the server and ``--think-ms`` is not used).

Busy = seconds an episode holds a desktop (lease granted -> released: setup, agent steps,
evaluation). Slot utilisation = busy / (envs x window): how full the ``envs`` rollout slots are
kept, the quantity scheduling controls (DART's environment utilisation). Desktop utilisation =
busy / ((envs + spares) x window): the same over every desktop of the farm, spares resetting in
the background included. Episodes/hour counts episodes finished inside the window.

Usage: python bench/env_utilization.py [--envs 6] [--seconds 180] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from osfarm.agents.base import BaseAgent
from osfarm.client import AsyncFarm
from osfarm.runner.episode import EpisodeConfig, EpisodeResult, run_episode
from osfarm.runner.scheduler import Done, RolloutScheduler, utilisation
from osfarm.tasks.filecache import suite_cache
from osfarm.tasks.suite import load_suite

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "suites" / "mini"
TASK_ID = "5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0a03"  # no setup, infeasible evaluator: the episode is the agent's steps


@dataclass(frozen=True)
class EpisodePlan:
    k: int
    steps: int
    think_s: tuple[float, ...]  # per step


def lognormal_median(rng: random.Random, median: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(median), sigma)


def plans(seed: int, steps_median: float, steps_sigma: float, max_steps: int, think_ms: float,
          think_sigma: float) -> Iterator[EpisodePlan]:
    """The endless episode sequence: the same for every mode with the same seed."""
    rng = random.Random(seed)
    k = 0
    while True:
        steps = max(1, min(max_steps, round(lognormal_median(rng, steps_median, steps_sigma))))
        think = tuple(lognormal_median(rng, think_ms / 1000.0, think_sigma) for _ in range(steps))
        yield EpisodePlan(k, steps, think)
        k += 1


class LatencyAgent(BaseAgent):
    """The bench policy: waits the planned model latency, then moves the mouse somewhere."""

    name = "bench-latency"
    settle_s = 0.2

    def __init__(self, plan: EpisodePlan, screen: tuple[int, int] = (800, 600)):
        self.plan = plan
        self.rng = random.Random(plan.k)
        self.screen = screen
        self.i = 0

    def reset(self, task: Any = None) -> None:
        self.i = 0

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[Any]]:
        time.sleep(self.plan.think_s[min(self.i, len(self.plan.think_s) - 1)])  # runs in a worker thread
        self.i += 1
        x, y = self.rng.randrange(self.screen[0]), self.rng.randrange(self.screen[1])
        return f"move to {x},{y}", [{"action_type": "MOVE_TO", "parameters": {"x": x, "y": y}}]


def make_policy(args: argparse.Namespace, plan: EpisodePlan) -> Any:
    if args.policy == "sleep":
        return LatencyAgent(plan, (args.width, args.height))
    from osfarm.agents import make_agent

    return make_agent("vlm", base_url=args.model_url, model=args.model, action_space="pyautogui",
                      max_tokens=args.max_tokens, seed=plan.k)


async def run_mode(args: argparse.Namespace, url: str, token: str, sync: bool, console: Console) -> dict[str, Any]:
    suite = load_suite(SUITE)
    task = next(t for t in suite if t.id == TASK_ID)
    work = Path(tempfile.mkdtemp(prefix="osfarm-util-"))
    cache = suite_cache(suite, SUITE, None, work, True)
    source = plans(args.seed, args.steps_median, args.steps_sigma, args.max_steps, args.think_ms, args.think_sigma)
    done: list[Done[EpisodePlan, EpisodeResult]] = []

    async with AsyncFarm(url, token) as farm:
        async def one(plan: EpisodePlan) -> EpisodeResult:
            cfg = EpisodeConfig(max_steps=plan.steps, time_limit_s=600, infra_retries=0, work_dir=work / ".work")
            return await run_episode(farm, task, make_policy(args, plan), cache, cfg, f"bench-{sync}")

        sched: RolloutScheduler[EpisodePlan, EpisodeResult] = RolloutScheduler(one, args.envs, sync_batches=sync)
        t0 = time.monotonic()
        end = t0 + args.seconds
        for _ in range(args.envs):
            sched.submit(next(source))
        closed = False
        async for d in sched.results():
            done.append(d)
            if closed:
                continue
            if time.monotonic() < end:
                sched.submit(next(source))  # keep the producer fed until the window closes
            else:
                sched.close()  # what is in flight finishes; only its part inside the window counts
                closed = True
    results = [d.result for d in done if d.result is not None]
    errors = [d for d in done if d.error is not None or (d.result and d.result.status == "infra_error")]
    # busy: from the lease being granted to the release (setup + agent + evaluation)
    spans = [(d.started + float((d.result.timings if d.result else {}).get("lease", 0.0)), d.finished) for d in done]
    util = utilisation(spans, args.envs, t0, end)
    util_desktops = utilisation(spans, args.envs + args.spares, t0, end)
    in_window = [d for d in done if d.finished <= end]
    steps = [len(r.steps) for r in results]
    think = [s.t_model_ms for r in results for s in r.steps]
    env_ms = [s.t_env_ms for r in results for s in r.steps]
    lease = [float(r.timings.get("lease", 0.0)) for r in results]
    return {
        "mode": "sync-batches" if sync else "rollout-wise",
        "episodes_in_window": len(in_window),
        "episodes_per_hour": len(in_window) * 3600.0 / args.seconds,
        "utilisation": util,
        "desktop_utilisation": util_desktops,
        "error_samples": [str(d.error) if d.error else (d.result.error if d.result else None) for d in errors][:5],
        "episodes_total": len(done),
        "infra_errors": len(errors),
        "steps_mean": statistics.fmean(steps) if steps else 0.0,
        "steps_max": max(steps, default=0),
        "model_ms_median": statistics.median(think) if think else 0.0,
        "model_ms_p99": sorted(think)[int(0.99 * (len(think) - 1))] if think else 0.0,
        "env_step_ms_median": statistics.median(env_ms) if env_ms else 0.0,
        "lease_wait_s_mean": statistics.fmean(lease) if lease else 0.0,
        "episode_s_median": statistics.median(d.finished - d.started for d in done) if done else 0.0,
        "drain_s": round(max((d.finished for d in done), default=end) - end, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, default=6, help="environment slots (episodes in flight)")
    ap.add_argument("--spares", type=int, default=None, help="extra warm desktops resetting in the background "
                    "(default envs/2; the farm holds envs + spares desktops)")
    ap.add_argument("--seconds", type=float, default=180.0, help="measurement window per mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps-median", type=float, default=3.0)
    ap.add_argument("--steps-sigma", type=float, default=1.0)
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--think-ms", type=float, default=400.0, help="median model latency per step (sleep policy)")
    ap.add_argument("--think-sigma", type=float, default=1.0)
    ap.add_argument("--policy", choices=("sleep", "vlm"), default="sleep")
    ap.add_argument("--model-url", default=None)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--width", type=int, default=800)
    ap.add_argument("--height", type=int, default=600)
    ap.add_argument("--modes", default="sync,rollout", help="which modes, in this order")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    if args.spares is None:
        args.spares = max(1, args.envs // 2)
    if args.policy == "vlm" and not args.model_url:
        ap.error("--policy vlm needs --model-url")
    console = Console(width=160)

    from osfarm.farm.local import local_farm_settings
    from osfarm.testing.farms import running_farm

    settings = local_farm_settings(args.envs, args.spares, width=args.width, height=args.height, lease_ttl_s=120)
    console.print(f"starting {args.envs + args.spares} desktops ...")
    rows = []
    with running_farm(settings=settings, start_timeout_s=settings.start_timeout_s + 60) as server:
        for mode in args.modes.split(","):
            console.print(f"[bold]{mode}[/]: {args.seconds:g} s window ...")
            rows.append(asyncio.run(run_mode(args, server.url, server.token, mode.strip() == "sync", console)))

    t = Table(title=f"environment utilisation: {args.envs} slots + {args.spares} spare desktops, "
                    f"{args.seconds:g} s per mode, policy {args.policy}")
    for c in ("mode", "slot util.", "desktop util.", "episodes/hour", "episodes", "mean steps", "model ms p50/p99",
              "env step ms p50", "lease wait s", "infra errors"):
        t.add_column(c, justify="left" if c == "mode" else "right")
    for r in rows:
        t.add_row(r["mode"], f"{r['utilisation']:.1%}", f"{r['desktop_utilisation']:.1%}",
                  f"{r['episodes_per_hour']:.0f}", str(r["episodes_in_window"]),
                  f"{r['steps_mean']:.1f}", f"{r['model_ms_median']:.0f}/{r['model_ms_p99']:.0f}",
                  f"{r['env_step_ms_median']:.0f}", f"{r['lease_wait_s_mean']:.1f}", str(r["infra_errors"]))
    by = {r["mode"]: r for r in rows}
    ratios = {}
    if {"sync-batches", "rollout-wise"} <= by.keys():
        s, w = by["sync-batches"], by["rollout-wise"]
        ratios = {"utilisation": w["utilisation"] / s["utilisation"] if s["utilisation"] else None,
                  "desktop_utilisation": (w["desktop_utilisation"] / s["desktop_utilisation"]
                                          if s["desktop_utilisation"] else None),
                  "episodes_per_hour": (w["episodes_per_hour"] / s["episodes_per_hour"]
                                        if s["episodes_per_hour"] else None)}
        t.add_section()
        t.add_row("[bold]rollout-wise / sync[/]", f"[bold]{ratios['utilisation']:.2f}x[/]",
                  f"[bold]{ratios['desktop_utilisation']:.2f}x[/]", f"[bold]{ratios['episodes_per_hour']:.2f}x[/]",
                  "", "", "", "", "", "")
    console.print(t)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(args).items()},
                                         "modes": rows, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
