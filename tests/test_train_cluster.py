"""``osfarm train --executor celery`` on a two-host cluster, on this machine (issue 29).

Host A is the trainer on 127.0.0.1 with Redis (broker, result backend, record stream) and its
spawned CPU policy server; hosts B and C are each a farm (``osfarm serve``, sandbox provider, the
light desktop) bound to its own loopback address, 127.0.0.2 and 127.0.0.3, and an ``osfarm worker``
running episodes on it that connects from that address (``--bind-address``: the farm's access log
and Redis's CLIENT LIST show it; Redis has a password, as a cluster's would). The trainer has no
farm: every rollout is a Celery job, every record comes back on the stream. Host C is lost after
the first update: its worker is SIGKILLed (its whole process group) and its farm too (its desktops
die with it); its unacknowledged job goes to worker B after the visibility timeout, under the same
episode id, and the run still reaches its last version: nothing waits on the dead host's desktops.
The trainer is SIGKILLed after version 2 and started again; it aborts the jobs its first life left
out that have not ended.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

pytest.importorskip("torch")
pytest.importorskip("transformers")

from osfarm.dashboard import pages  # noqa: E402
from osfarm.dashboard.runs import RunsRoot  # noqa: E402
from osfarm.testing.host_farm import HostFarm  # noqa: E402
from osfarm.testing.redis_server import RedisServer  # noqa: E402
from osfarm.testing.waiting import wait_until  # noqa: E402
from osfarm.trainer.learner import latest_checkpoint, read_state  # noqa: E402

pytestmark = [pytest.mark.acceptance, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
UPDATES = 3
KILL_TRAINER_AT = 2
ETA = 1
BATCH = 4
STREAM = "osfarm:train:test"
TIME_LIMIT_S = 20  # per episode: a job's hard limit is 50 s, so the visibility timeout can be 55 s
VISIBILITY_S = 55
CONFIG = """\
run_dir: {run}
updates: {updates}
max_episodes: 120
rollout:
  envs: 2
  eta: {eta}
  batch_size: {batch}
  max_steps: 1
  episode_time_limit_s: {limit}
  action_timing: osworld
  stream: "{stream}"
  worker_out: {worker_out}
  options: {{allocator: fixed, group_size: 2}}
data:
  options:
    drop_no_signal: false
"""


def _env() -> dict[str, str]:
    return {**os.environ, "OSFARM_CELERY_VISIBILITY_S": str(VISIBILITY_S), "OSFARM_CELERY_RESTORE_S": "1",
            "OSFARM_CLAIM_TTL_S": "5", "PYTHONUNBUFFERED": "1"}


def _start_worker(name: str, farm: HostFarm, broker: RedisServer, log: Path, out: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "osfarm.cli", "worker", "--farm", farm.url, "--token", farm.token, "--broker",
         broker.url, "--concurrency", "1", "--name", f"{name}@test", "--out", str(out), "--bind-address", farm.host],
        cwd=ROOT, env=_env(), stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_until(lambda: b" ready." in log.read_bytes() or proc.poll() is not None, 120, f"worker {name} ready")
    assert proc.poll() is None, log.read_text()[-3000:]
    return proc


def _stop_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """SIGTERM: the worker's warm shutdown (to its main process alone: the episode it runs ends
    and releases its lease); SIGKILL: the whole process group at once, a lost host."""
    if proc.poll() is None:
        if sig == signal.SIGKILL:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _running(worker_log: str) -> bool:
    """The worker has an episode started and not finished."""
    return worker_log.count("running the episode") > worker_log.count("] succeeded in")


def _wait_version(trainer: subprocess.Popen[bytes], run_dir: Path, version: int, log: Path) -> None:
    deadline = time.monotonic() + 300
    while not any(r["version"] >= version for r in _rows(run_dir)):
        if trainer.poll() is not None:
            pytest.fail(f"osfarm train exited {trainer.returncode} early:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no version {version} in 300 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _redis_peers(r: redis.Redis) -> set[str]:
    """The addresses Redis sees its clients connect from, but the asking client's own."""
    me = r.client_id()
    return {c["addr"].rsplit(":", 1)[0] for c in r.client_list() if int(c["id"]) != me}


_ACCESS = re.compile(r'msg="([0-9.]+):\d+ - \\"(\w+) (\S+) HTTP')


def _lease_peers(farm: HostFarm) -> Counter[str]:
    """From the farm's access log: the addresses its lease requests (POST /v1/desktops) came from."""
    hits = (_ACCESS.search(line) for line in farm.log_path.read_text(errors="replace").splitlines())
    return Counter(m[1] for m in hits if m and m[2] == "POST" and m[3] == "/v1/desktops")


def _rows(run: Path) -> list[dict[str, Any]]:
    p = run / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.is_file() else []


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("cluster")
    run_dir = base / "run"
    cfg = base / "train.yaml"
    worker_out = base / "worker-out"  # the hosts' OSFARM_WORKER_OUT, as the trainer sees it (one mount)
    cfg.write_text(CONFIG.format(run=run_dir, updates=UPDATES, eta=ETA, batch=BATCH, limit=TIME_LIMIT_S,
                                 stream=STREAM, worker_out=worker_out))
    farms = {"b": HostFarm("127.0.0.2", base / "farm-b"), "c": HostFarm("127.0.0.3", base / "farm-c")}
    workers: dict[str, subprocess.Popen[bytes]] = {}
    trainer: subprocess.Popen[bytes] | None = None
    log = base / "train.log"
    # a password: Redis's protected mode refuses clients from loopback addresses other than 127.0.0.1
    with RedisServer(password=secrets.token_hex(16)) as broker:
        r = redis.Redis.from_url(broker.url, decode_responses=True)
        try:
            for f in farms.values():
                f.start()
            for name, f in farms.items():
                workers[name] = _start_worker(name, f, broker, base / f"worker-{name}.log", worker_out)
            redis_peers_workers = _redis_peers(r)  # the two workers alone (the trainer is not started)
            argv = [sys.executable, "-m", "osfarm.cli", "train", "--config", str(cfg), "--executor", "celery",
                    "--broker", broker.url]
            trainer = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=log.open("ab"), stderr=subprocess.STDOUT)
            _wait_version(trainer, run_dir, 1, log)  # the first update: both workers have run episodes by now
            # host C is lost mid-episode when it can be caught in one (its episodes take about a second)
            c_log = base / "worker-c.log"
            try:
                mid_episode = wait_until(lambda: _running(c_log.read_text(errors="replace")), 30, interval=0.02)
            except AssertionError:  # none caught in 30 s: killed between episodes
                mid_episode = False
            _stop_group(workers["c"], signal.SIGKILL)
            farms["c"].kill()  # the whole host is gone: its farm and desktops with it
            # the trainer crashes after version 2 and is started again: it resumes from its checkpoint
            # and its stream journal while jobs of its first life are still out
            _wait_version(trainer, run_dir, KILL_TRAINER_AT, log)
            trainer.kill()
            trainer.wait(30)
            killed_rows = len(_rows(run_dir))
            trainer = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=log.open("ab"), stderr=subprocess.STDOUT)
            rc = trainer.wait(420)
            assert rc == 0, log.read_text()[-4000:]
            # what the trainer took from the stream, in its journal (acked entries are trimmed from the stream)
            records = [json.loads(x) for x in (run_dir / "stream-journal.jsonl").read_text().splitlines() if x.strip()]
            redis_peers_end = _redis_peers(r)  # worker B and its pool process's stream client (the trainer is gone)
            pending = [g["pending"] for g in r.xinfo_groups(STREAM)]
            _stop_group(workers["b"])  # a warm shutdown: the episode it may still run ends, its lease too
            with farms["b"].client() as c:
                pool_b = c.get("/v1/pool").json()["counts"]
        finally:
            if trainer is not None and trainer.poll() is None:
                trainer.kill()
                trainer.wait(30)
            for w in workers.values():
                _stop_group(w)
            for f in farms.values():
                f.stop()
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"]) if str(base) in " ".join(p.info["cmdline"] or [])]
    yield {"dir": run_dir, "worker_out": worker_out, "farms": farms, "records": records, "rows": _rows(run_dir),
           "pending": pending,
           "summary": json.loads((run_dir / "summary.json").read_text()), "log": log.read_text(), "workers": workers,
           "pool_b": pool_b, "left": left, "mid_episode": mid_episode, "killed_rows": killed_rows,
           "redis_peers": (redis_peers_workers, redis_peers_end), "broker_password": broker.password,
           "worker_logs": "".join((base / f"worker-{n}.log").read_text(errors="replace") for n in farms),
           "lease_peers": {name: _lease_peers(f) for name, f in farms.items()}}


def test_the_run_reaches_its_versions_through_the_queue(cluster: dict[str, Any]) -> None:
    assert read_state(latest_checkpoint(cluster["dir"] / "checkpoints"))["version"] == UPDATES
    assert sorted({r["version"] for r in cluster["rows"]}) == list(range(1, UPDATES + 1))
    assert "rollouts go to the Celery queue" in cluster["log"]
    # the broker URL carries Redis's password: no log shows it
    assert cluster["broker_password"] not in cluster["log"] + cluster["worker_logs"]
    queue = cluster["summary"]["totals"]["queue"]
    resumed = (UPDATES - KILL_TRAINER_AT) * BATCH  # summary.json: the resumed process's own jobs
    assert queue["sent"] >= resumed and queue["timed"] >= resumed
    assert queue["overhead_ms"] is not None and 0 <= queue["overhead_ms"] < 60_000
    last = cluster["rows"][-1]  # the metrics rows (and Prometheus) carry the queue's figures and per-worker episodes
    assert last["queue_outstanding"] >= 0 and last["queue_overhead_ms"] is not None
    assert any(k.startswith("rollouts_worker_b") for k in last), sorted(last)
    assert "osfarm_train_queue_outstanding" in (cluster["dir"] / "metrics.prom").read_text()


def test_a_killed_trainer_resumes_from_its_checkpoint_and_journal(cluster: dict[str, Any]) -> None:
    assert "resumed from" in cluster["log"]
    # what the first life left out was looked for (the one live worker may have run it all by then:
    # test_celery.py's test_a_restarted_trainer_aborts_the_jobs_its_crashed_process_left shows the abort)
    assert "earlier_aborted" in cluster["summary"]["totals"]["queue"]
    versions = [r["version"] for r in cluster["rows"]]
    assert versions == sorted(set(versions)), versions  # no version trained twice across the crash
    after = cluster["rows"][cluster["killed_rows"]:]
    assert after and after[0]["version"] == cluster["rows"][cluster["killed_rows"] - 1]["version"] + 1


def test_desktops_of_both_hosts_were_used(cluster: dict[str, Any]) -> None:
    farms = Counter(rec["worker"]["farm"] for rec in cluster["records"])
    assert set(farms) == {f.url for f in cluster["farms"].values()}, farms
    assert {u.split("//")[1].split(":")[0] for u in farms} == {"127.0.0.2", "127.0.0.3"}
    per_worker = {k for r in cluster["rows"] for k in r if k.startswith("rollouts_worker_")}  # both processes' rows
    assert {k.removeprefix("rollouts_worker_").split("@")[0] for k in per_worker} == {"b", "c"}, per_worker


def test_each_hosts_worker_connects_from_its_own_address(cluster: dict[str, Any]) -> None:
    """``osfarm worker --bind-address``: the farm saw each host's leases come from that host's
    address, and Redis its worker's connections (the kernel's choice would be 127.0.0.1 for all)."""
    assert cluster["lease_peers"]["b"] and set(cluster["lease_peers"]["b"]) == {"127.0.0.2"}, cluster["lease_peers"]
    assert cluster["lease_peers"]["c"] and set(cluster["lease_peers"]["c"]) == {"127.0.0.3"}, cluster["lease_peers"]
    workers, end = cluster["redis_peers"]
    assert workers == {"127.0.0.2", "127.0.0.3"}, workers  # the broker and result backend connections
    assert end == {"127.0.0.2"}, end  # host C is gone; B's episodes' stream client too came from its address


def test_every_episode_is_trained_at_most_once(cluster: dict[str, Any]) -> None:
    ids = Counter(rec["episode_id"] for rec in cluster["records"])
    assert ids and max(ids.values()) == 1, [i for i, n in ids.items() if n > 1]
    dm = json.loads((latest_checkpoint(cluster["dir"] / "checkpoints") / "state" / "data_manager.json").read_text())
    assert dm["counters"].get("duplicate", 0) == 0 or set(dm["seen"]) <= set(ids)
    assert set(dm["seen"]) <= set(ids)  # nothing trained that did not come through the stream
    # every record carries the group its rollout was planned in: each is one of the trainer's rollouts
    assert all("#g" in rec["group_id"] for rec in cluster["records"])
    # rollout.action_timing travels in the job to the workers, who pace and record by it
    assert {rec["action_timing"] for rec in cluster["records"]} == {"osworld"}


def test_the_trainer_reads_the_blobs_where_the_workers_wrote_them(cluster: dict[str, Any]) -> None:
    rec = next(r for r in cluster["records"] if r["steps"])
    shot = rec["steps"][0]["observation"]["screenshot"]["path"]
    assert (cluster["worker_out"] / rec["run_id"] / shot).is_file()
    assert not (cluster["dir"] / shot).exists()  # not in the run dir: the samples were built from the workers' dir


def test_the_staleness_bound_held(cluster: dict[str, Any]) -> None:
    for r in cluster["rows"]:
        assert r["staleness_max"] <= ETA, r
        assert all((r["version"] - 1) - v <= ETA for v in r["sample_versions"]), r
    rc = json.loads((latest_checkpoint(cluster["dir"] / "checkpoints") / "state" / "rollout_controller.json")
                    .read_text())
    assert rc["gate"]["accepted"] - rc["gate"]["consumed"] <= (ETA + 1) * BATCH + 1


def test_nothing_is_left_running(cluster: dict[str, Any]) -> None:
    print(f"worker c killed mid-episode: {cluster['mid_episode']}")
    assert cluster["workers"]["c"].returncode == -signal.SIGKILL
    assert cluster["farms"]["c"].proc.returncode == -signal.SIGKILL  # host C was lost, and nothing waited on it
    assert cluster["workers"]["b"].returncode == 0
    assert cluster["pool_b"].get("leased", 0) == 0, cluster["pool_b"]  # the live host's desktops all came back
    assert cluster["pending"] == [0]  # every record the trainer read was acknowledged
    assert cluster["left"] == []  # no farm, desktop or worker process of the cluster survives it
    for f in cluster["farms"].values():
        assert f.proc is not None and f.proc.returncode is not None


def test_prometheus_and_the_dashboard_show_the_cluster(cluster: dict[str, Any]) -> None:
    """Issue 29, item 7's second half: per-worker rollouts, queue depth, stream lag and the
    staleness histogram, in Prometheus's text file and on the dashboard's training page."""
    prom = (cluster["dir"] / "metrics.prom").read_text()
    assert 'osfarm_train_worker_rollouts{worker="b@test"}' in prom, prom
    assert "osfarm_train_queue_queued" in prom and "osfarm_train_queue_stream_lag" in prom
    assert "osfarm_train_queue_stream_pending" in prom
    assert 'osfarm_train_sample_staleness_bucket{le="1.0"}' in prom
    rows = cluster["rows"]
    assert all(0 < sum(r["staleness_hist"].values()) <= r["samples"] - r["pool_samples"] for r in rows)
    assert all(int(k) <= ETA for r in rows for k in r["staleness_hist"])
    assert any(r["queue_stream_lag"] is not None for r in rows)
    run = RunsRoot(cluster["dir"].parent).training_run(cluster["dir"].name)
    charts = {c["key"]: c for c in pages.training_data(run.rows, run.eval_rows)["charts"]}
    assert {"queue", "workers", "staleness_hist"} <= set(charts), sorted(charts)
    assert {ln["name"].split("@")[0] for ln in charts["workers"]["lines"]} == {"b", "c"}
    assert {ln["name"] for ln in charts["queue"]["lines"]} >= {"queued", "running", "stream lag"}
