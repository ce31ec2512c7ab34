"""The long chaos run (tests/chaos/test_chaos.py is the short one in ``make test``).

Everything real: Redis (AOF, fsync always), a farm of sandbox (or docker) desktops, two Celery
workers, the eval of suites/mini through Celery, and a training run (tiny model, its own policy
server). A seeded driver kills, at random moments for ``--minutes``, one part after another with
SIGKILL: a desktop (its Xvfb), a whole worker (supervisor and pool: its job comes back after the
broker's visibility timeout), a worker's pool process (OOM-like), the farm (restarted on its port
and state dir), Redis (restarted on its AOF); then the trainer and its policy server while the
training run goes on. At the end:

* every eval round has exactly one record per task (run dir and stream) and equals the fault-free
  round's results;
* the training run reached its version count;
* nothing of the cluster is left (processes, sockets, temp files under the base dir);
* farm memory and open files over ``--cycles`` lease/release cycles on real desktops.

    python bench/chaos.py --minutes 20 --seed 3
    python bench/chaos.py --minutes 5 --provider docker --cycles 300 --train-updates 3
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from osfarm.runner.executors.celery_app import hard_limit_s
from osfarm.testing.chaos_cluster import (
    SUITE,
    Driver,
    Fault,
    Tracker,
    Training,
    Workers,
    base_env,
    essentials,
    kill_a_desktop,
    leftovers,
    one_record_per_task,
    train_under_faults,
)
from osfarm.testing.farm_process import FarmProcess
from osfarm.testing.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent

TIME_LIMIT_S, RETRIES, STREAM = 60, 3, "chaos:episodes"


def run_eval(out: Path, broker: RedisServer, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "osfarm.cli", "eval", "--suite", str(SUITE), "--agent", "replay", "--out", str(out),
         "--no-progress", "--time-limit", str(TIME_LIMIT_S), "--retries", str(RETRIES), "--executor", "celery",
         "--broker", broker.url, "--max-concurrent", "3"],
        cwd=ROOT, env=env, stdout=(out.parent / f"{out.name}.log").open("wb"), stderr=subprocess.STDOUT)


def cycles(farm: FarmProcess, n: int) -> list[tuple[int, float, int]]:
    """Lease, observe, release ``n`` times on real desktops; (cycle, RSS MiB, open files) samples."""
    out = []
    with farm.client(timeout=300) as c:
        for i in range(1, n + 1):
            r = c.post("/v1/desktops", json={"wait_s": 240, "ttl_s": 120})
            r.raise_for_status()
            lid = r.json()["id"]
            c.get(f"/v1/desktops/{lid}/observation", params={"screenshot": "false"}).raise_for_status()
            c.delete(f"/v1/desktops/{lid}").raise_for_status()
            if i % max(1, n // 10) == 0:
                out.append((i, round(farm.rss_bytes() / 2**20, 1), farm.open_fds()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="how long the eval rounds go on under faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--provider", default="sandbox", choices=("sandbox", "docker"))
    ap.add_argument("--train-updates", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=300, help="lease/release cycles on real desktops for the leak check")
    ap.add_argument("--base", type=Path, default=Path("/tmp/osfarm-chaos-bench"))
    a = ap.parse_args()
    rng = random.Random(a.seed)
    base = a.base
    shutil.rmtree(base, ignore_errors=True)
    (base / "redis").mkdir(parents=True)
    vis = int(hard_limit_s(TIME_LIMIT_S, RETRIES)) + 5
    env = base_env(base, OSFARM_CELERY_VISIBILITY_S=str(vis), OSFARM_CELERY_RESTORE_S="2", OSFARM_CLAIM_TTL_S="6")
    tracker = Tracker()
    broker = RedisServer(aof=True, data_dir=base / "redis").start()
    farm_env = dict(env)
    if a.provider == "docker":
        farm_env["OSFARM_DOCKER_SHARED_DIR"] = str(base / "farm" / "docker")
    farm = FarmProcess(base / "farm", provider=a.provider, pool_min=2, pool_max=3, env=farm_env)
    workers: Workers | None = None
    report: dict[str, object] = {"seed": a.seed, "provider": a.provider}
    problems: list[str] = []
    t_start = time.monotonic()
    try:
        farm.start(timeout=600)
        tracker.roots += [lambda: [farm.pid] if farm.alive() else [], lambda: [broker.proc.pid] if broker.proc else []]
        workers = Workers(base, farm, broker, STREAM, env)
        workers.start("w1")
        workers.start("w2")
        tracker.roots.append(workers.pids)
        tracker.start()

        clean = base / "clean"
        assert run_eval(clean, broker, env).wait(1800) == 0, (base / "clean.log").read_text()[-3000:]
        expected = json.loads((clean / "results.json").read_text())

        def kill_worker() -> str:
            assert workers is not None
            name = rng.choice(sorted(workers.procs))
            workers.kill(name)
            time.sleep(rng.uniform(0.5, 3.0))
            workers.start(name, wait=False)
            return f"{name} (whole worker)"

        def kill_pool_process() -> str:
            assert workers is not None
            name = rng.choice(sorted(workers.procs))
            return f"{name}: {workers.kill_child(name)}"

        def kill_farm() -> str:
            farm.kill()
            time.sleep(rng.uniform(0.2, 3.0))
            farm.start(timeout=600, warm=False)
            return f"restart {farm.starts}"

        def kill_redis() -> str:
            broker.restart(kill=True, down_s=rng.uniform(0.5, 5.0))
            return "restarted"

        actions = {"desktop": lambda: kill_a_desktop(farm, rng), "worker": kill_worker, "pool": kill_pool_process,
                   "farm": kill_farm, "redis": kill_redis}
        rounds: list[dict[str, object]] = []
        faults: list[Fault] = []
        n = 0
        while time.monotonic() - t_start < a.minutes * 60:
            n += 1
            out = base / f"round{n}"
            proc = run_eval(out, broker, env)
            plan = [rng.choice(list(actions)) for _ in range(6)]
            driver = Driver(rng, actions, plan, spacing=(2.0, 15.0), until=lambda p=proc: p.poll() is not None)
            thread = driver.start()
            rc = proc.wait(vis * 3 + 1800)
            thread.join(600)
            got = json.loads((out / "results.json").read_text()) if rc == 0 else {"tasks": []}
            same = rc == 0 and essentials(got) == essentials(expected)
            records = one_record_per_task(out, got, broker.url, STREAM) if rc == 0 else [f"eval exited {rc}"]
            rounds.append({"round": n, "faults": [(f.at, f.kind, f.detail) for f in driver.done], "rc": rc,
                           "equal_to_fault_free": same, "record_problems": records, "driver_errors": driver.errors})
            faults += driver.done
            if not same:
                problems.append(f"round {n}: results differ from the fault-free run: {got.get('tasks')}")
            problems += [f"round {n}: {p}" for p in records + driver.errors]
            print(f"round {n}: rc={rc} equal={same} faults={[(f.kind, f.detail) for f in driver.done]}", flush=True)
        report["eval_rounds"] = rounds
        report["eval_faults"] = len(faults)

        train_env = base_env(base, OSFARM_STATE_DIR=str(base / "train-farm"))
        training = Training(base, updates=a.train_updates, env=train_env)
        kills = ["policy", "trainer", "policy", "trainer"][: 2 + a.train_updates // 2]
        t0 = time.monotonic()
        tf = train_under_faults(training, rng, tracker, timeout=3600, kills=kills)
        report["training"] = {"updates": a.train_updates, "version": training.version(), "starts": training.starts,
                              "faults": [(f.at, f.kind, f.detail) for f in tf], "seconds": round(time.monotonic() - t0)}
        if training.version() != a.train_updates:
            problems.append(f"training reached version {training.version()}, not {a.train_updates}")

        if a.cycles:
            samples = cycles(farm, a.cycles)
            report["cycles"] = samples
            if len(samples) >= 3 and samples[-1][1] - samples[1][1] > 32:
                problems.append(f"farm RSS grew over the lease/release cycles: {samples}")
            if len(samples) >= 3 and samples[-1][2] > samples[1][2] + 8:
                problems.append(f"farm open files grew over the lease/release cycles: {samples}")
    finally:
        if workers is not None:
            workers.stop_all()
        farm.stop(timeout=120)
        broker.stop()
        tracker.stop()
    time.sleep(5)
    left = leftovers(base, tracker)
    report["leftovers"] = left
    problems += [f"left behind: {x}" for x in left]
    if a.provider == "docker":
        import docker

        scope = str(base / "farm" / "docker")
        left_c = docker.from_env().containers.list(all=True, filters={"label": f"org.osfarm.scope={scope}"})
        problems += [f"container left: {c.name}" for c in left_c]
    report["problems"] = problems
    report["minutes"] = round((time.monotonic() - t_start) / 60, 1)
    (base / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "eval_rounds"}, indent=1, default=str))
    print(f"\n{len(report.get('eval_rounds', []))} eval rounds, {report.get('eval_faults')} faults; "
          f"problems: {len(problems)}; report: {base / 'report.json'}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
