"""``osfarm train`` over the queue: samples/s with rollouts on 1 vs 2 worker "hosts", and the
queue's overhead per rollout (issue 29, item 7).

One run on this machine, real parts: a Redis (broker, result backend, record stream), two farms
(``osfarm serve``, sandbox provider) bound to 127.0.0.2 and 127.0.0.3, each with an ``osfarm
worker`` of ``--concurrency`` episodes connecting from that address, and ``osfarm train`` with
the tiny model and its spawned CPU policy server (``--delay-ms`` of model latency per request:
the part a bigger cluster adds desktops for). Three trainings of ``--updates`` versions each:

* ``inprocess``: the trainer's own scheduler on farm B (``rollout.executor: inprocess``), ``envs``
  = concurrency;
* ``celery x1``: rollouts as Celery jobs, one worker host (B), ``envs`` = concurrency;
* ``celery x2``: both worker hosts, ``envs`` = 2 × concurrency.

Samples/s is the learner's steady rate: the samples of every update after the first over the
time between the first and the last update (start-up — model load, policy server — left out).
Desktop utilisation: the episodes' own time (the records' started/finished) inside that window
over (desktops × window). Queue overhead per rollout: a job's time from sent to its record at the
trainer, less the episode's own time on the worker (the trainer's ``totals.queue.overhead_ms``;
with no more jobs than desktops none waits for a worker); the in-process path has no such hop.

On a 2-core machine shared with other work the ratio says more about the CPU than about the
queue: the desktops, the policy server and the learner all share those cores.

Usage: python bench/train_cluster.py [--updates 4] [--concurrency 2] [--delay-ms 300] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from osfarm.testing.host_farm import HostFarm
from osfarm.testing.redis_server import RedisServer
from osfarm.testing.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
VISIBILITY_S = 120


def _env() -> dict[str, str]:
    return {**os.environ, "OSFARM_CELERY_VISIBILITY_S": str(VISIBILITY_S), "OSFARM_CELERY_RESTORE_S": "1",
            "PYTHONUNBUFFERED": "1"}


def _config(run: Path, args: argparse.Namespace, envs: int, extra: str) -> str:
    return (f"run_dir: {run}\nupdates: {args.updates}\nmax_episodes: 1000\n"
            f"policy: {{delay_ms: {args.delay_ms}}}\n"
            f"rollout:\n  envs: {envs}\n  eta: 1\n  batch_size: {args.batch}\n  max_steps: 1\n"
            f"  episode_time_limit_s: 60\n  options: {{allocator: fixed, group_size: 2}}\n{extra}"
            "data:\n  options: {drop_no_signal: false}\nmetrics: {plot: false, tensorboard: false}\n")


def _train(base: Path, name: str, cfg_text: str, extra_args: list[str]) -> dict[str, Any]:
    run = base / f"run-{name}"
    cfg = base / f"{name}.yaml"
    cfg.write_text(cfg_text)
    log = base / f"train-{name}.log"
    with log.open("wb") as out:
        rc = subprocess.run([sys.executable, "-m", "osfarm.cli", "train", "--config", str(cfg), *extra_args],
                            cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, timeout=1200).returncode
    if rc != 0:
        raise SystemExit(f"{name}: osfarm train exited {rc}:\n{log.read_text()[-3000:]}")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run / "summary.json").read_text())
    return {"rows": rows, "summary": summary, "run": run}


def _episodes(run: Path) -> list[dict[str, Any]]:
    for name in ("stream-journal.jsonl", "episodes.jsonl"):
        p = run / name
        if p.is_file():
            return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return []


def _figures(res: dict[str, Any], desktops: int) -> dict[str, Any]:
    rows = res["rows"]
    if len(rows) < 2:
        raise SystemExit("need at least 2 updates for a steady rate (--updates)")
    t0, t1 = rows[0]["time"], rows[-1]["time"]
    window = t1 - t0
    samples = sum(r["samples"] for r in rows[1:])
    busy = 0.0
    for e in _episodes(res["run"]):
        s, f = datetime.fromisoformat(e["started_at"]).timestamp(), datetime.fromisoformat(e["finished_at"]).timestamp()
        busy += max(0.0, min(f, t1) - max(s, t0))
    queue = res["summary"]["totals"].get("queue") or {}
    return {"desktops": desktops, "window_s": round(window, 1), "samples": samples,
            "samples_per_s": round(samples / window, 3) if window > 0 else None,
            "desktop_utilisation": round(busy / (desktops * window), 3) if window > 0 else None,
            "queue_overhead_ms": round(queue["overhead_ms"], 1) if queue.get("overhead_ms") is not None else None,
            "by_worker": queue.get("by_worker")}


def _worker(name: str, farm: HostFarm, broker: RedisServer, base: Path, concurrency: int) -> subprocess.Popen[bytes]:
    log = base / f"worker-{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "osfarm.cli", "worker", "--farm", farm.url, "--token", farm.token,
                             "--broker", broker.url, "--concurrency", str(concurrency), "--name", f"{name}@bench",
                             "--out", str(base / "worker-out"), "--bind-address", farm.host],
                            cwd=ROOT, env=_env(), stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    wait_until(lambda: b" ready." in log.read_bytes() or proc.poll() is not None, 120, f"worker {name} ready")
    if proc.poll() is not None:
        raise SystemExit(f"worker {name} exited:\n{log.read_text()[-3000:]}")
    return proc


def _wait_idle(farms: dict[str, HostFarm]) -> None:
    """No desktop leased on any farm: a run that ended with lease requests still waiting leaves
    them granted to nobody until their TTL (120 s) runs out, and the next run would wait for them."""
    def idle() -> bool:
        for f in farms.values():
            with f.client() as c:
                if c.get("/v1/pool").json()["counts"].get("leased", 0):
                    return False
        return True

    wait_until(idle, 300, "every desktop free", interval=1.0)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2, help="episodes at once per worker host")
    ap.add_argument("--delay-ms", type=float, default=300.0, help="policy server latency per request")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    c = args.concurrency
    out: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    # each worker connects from its host's address; Redis's protected mode then wants a password
    with (tempfile.TemporaryDirectory(prefix="osfarm-train-cluster-") as tmp,
          RedisServer(password=secrets.token_hex(16)) as broker):
        base = Path(tmp)
        farms = {"b": HostFarm("127.0.0.2", base / "farm-b", c, warm=c),
                 "c": HostFarm("127.0.0.3", base / "farm-c", c, warm=c)}
        workers: list[subprocess.Popen[bytes]] = []
        try:
            for f in farms.values():
                f.start()
            worker_out = base / "worker-out"
            for n_hosts in (1, 2):
                workers.append(_worker(list(farms)[n_hosts - 1], list(farms.values())[n_hosts - 1], broker, base, c))
                name = f"celery-x{n_hosts}"
                _wait_idle(farms)
                t = time.monotonic()
                res = _train(base, name, _config(base / f"run-{name}", args, c * n_hosts,
                                                 f"  stream: osfarm:bench:{name}\n  worker_out: {worker_out}\n"),
                             ["--executor", "celery", "--broker", broker.url])
                out[name] = _figures(res, c * n_hosts)
                print(f"{name:11} ({time.monotonic() - t:.0f} s): {out[name]}", flush=True)
            for w in workers:  # the in-process run has farm B to itself
                _stop(w)
            _wait_idle(farms)
            fb = farms["b"]
            t = time.monotonic()
            res = _train(base, "inprocess", _config(base / "run-inprocess", args, c,
                                                    f"farm: {{url: \"{fb.url}\", token: \"{fb.token}\"}}\n"), [])
            out["inprocess"] = _figures(res, c)
            print(f"inprocess   ({time.monotonic() - t:.0f} s): {out['inprocess']}", flush=True)
        finally:
            for w in workers:
                _stop(w)
            for f in farms.values():
                f.stop()
    one, two = out["celery-x1"]["samples_per_s"], out["celery-x2"]["samples_per_s"]
    out["ratio_2_over_1"] = round(two / one, 2) if one and two else None
    print(f"samples/s: in-process {out['inprocess']['samples_per_s']}, 1 worker host {one}, 2 worker hosts {two} "
          f"(ratio {out['ratio_2_over_1']}); queue overhead per rollout: {out['celery-x1']['queue_overhead_ms']} ms "
          f"(1 host), {out['celery-x2']['queue_overhead_ms']} ms (2 hosts)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
