"""The Celery executor end to end: a real redis-server, real `osfarm worker` processes, a real
farm of sandbox desktops, the replay agent on suites/mini. Faults: a worker killed with SIGKILL
mid-episode, Redis killed and restarted mid-run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import redis

from osfarm.farm.server import FarmServer
from osfarm.runner.executors.rollout_control import abort_key
from osfarm.stream.jsonl import read_jsonl
from osfarm.testing.redis_server import RedisServer
from osfarm.testing.waiting import wait_until
from osfarm.trainer.data_manager import DataConfig, DataManager
from osfarm.trainer.queued_rollouts import QueuedRollouts, rollout_episode_id

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "suites" / "mini"
N_TASKS = 3
TIME_LIMIT_S = 40  # per episode; the hard limit is 70 s
VISIBILITY_S = 75  # > the hard limit: a dead worker's episode is redelivered after this


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    # AOF with fsync on every write: a restarted broker keeps its queue, as a production one must
    with RedisServer(aof=True) as server:
        yield server


def _env() -> dict[str, str]:
    return {**os.environ, "OSFARM_CELERY_VISIBILITY_S": str(VISIBILITY_S), "OSFARM_CELERY_RESTORE_S": "1",
            "PYTHONUNBUFFERED": "1"}


class Workers:
    def __init__(self, farm: FarmServer, broker: RedisServer, stream: str, logs: Path):
        self.farm, self.broker, self.stream, self.logs = farm, broker, stream, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, concurrency: int = 1) -> None:
        log = (self.logs / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "osfarm.cli", "worker", "--farm", self.farm.url, "--token", self.farm.token,
             "--broker", self.broker.url, "--concurrency", str(concurrency), "--stream", self.stream,
             "--name", f"{name}@test"],
            cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: b" ready." in (self.logs / f"{name}.log").read_bytes(), 120, f"worker {name} ready")

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str) -> None:
        """SIGKILL the worker and its pool children (its whole session): a lost machine."""
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@pytest.fixture
def workers(farm: FarmServer, broker: RedisServer, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Workers]:
    w = Workers(farm, broker, f"test:{request.node.name}", tmp_path)
    try:
        yield w
    finally:
        w.stop_all()


def eval_args(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "osfarm.cli", "eval", "--suite", str(SUITE), "--agent", "replay", "--out", str(out),
            "--no-progress", "--time-limit", str(TIME_LIMIT_S), "--retries", "0", *extra]


def run_eval(out: Path, *extra: str) -> dict:
    r = subprocess.run(eval_args(out, *extra), cwd=ROOT, env=_env(), check=False, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / "results.json").read_text())


def stream_records(broker: RedisServer, stream: str, run_id: str) -> list[dict]:
    r = redis.Redis.from_url(broker.url, decode_responses=True)
    return [rec for _, f in r.xrange(stream) if (rec := json.loads(f["record"]))["run_id"] == run_id]


def essentials(results: dict) -> list[tuple]:
    return [(t["task_id"], t["domain"], t["status"], t["score"], t["steps"], t["attempts"]) for t in results["tasks"]]


def check_one_record_per_task(out: Path, results: dict, broker: RedisServer, stream: str) -> None:
    recs = list(read_jsonl(out / "episodes.jsonl"))
    assert Counter(r["task_id"] for r in recs) == Counter(t["task_id"] for t in results["tasks"])
    on_stream = stream_records(broker, stream, results["run_id"])
    assert Counter(r["episode_id"] for r in on_stream) == Counter(r["episode_id"] for r in recs)  # once each


@pytest.mark.timeout(600)
def test_celery_gives_the_same_results_as_in_process(farm: FarmServer, broker: RedisServer, workers: Workers,
                                                     tmp_path: Path) -> None:
    # in process, also publishing to the stream (--stream-url)
    local = run_eval(tmp_path / "local", "--url", farm.url, "--token", farm.token, "--envs", "2",
                     "--stream-url", broker.url, "--stream", workers.stream)
    workers.start("w1", concurrency=2)
    remote = run_eval(tmp_path / "celery", "--executor", "celery", "--broker", broker.url)
    assert remote["executor"] == "celery" and local["executor"] == "inprocess"
    assert remote["max_concurrent"] == N_TASKS and local["max_concurrent"] == 2
    assert essentials(remote) == essentials(local)
    assert remote["success_rate"] == 1.0 and remote["n_tasks"] == N_TASKS
    check_one_record_per_task(tmp_path / "local", local, broker, workers.stream)
    check_one_record_per_task(tmp_path / "celery", remote, broker, workers.stream)
    a = {r["task_id"]: r for r in read_jsonl(tmp_path / "local" / "episodes.jsonl")}
    b = {r["task_id"]: r for r in read_jsonl(tmp_path / "celery" / "episodes.jsonl")}
    for tid in a:
        assert [s["actions"] for s in a[tid]["steps"]] == [s["actions"] for s in b[tid]["steps"]]
        assert a[tid]["episode_id"] != b[tid]["episode_id"]  # different runs
        for s in b[tid]["steps"]:  # the workers wrote the blobs into the run dir
            assert (tmp_path / "celery" / s["observation"]["screenshot"]["path"]).is_file()
    for t in remote["tasks"]:  # and OSWorld's per-task layout
        assert (tmp_path / "celery" / t["domain"] / t["task_id"] / "result.txt").is_file()


@pytest.mark.timeout(600)
def test_each_repeat_is_a_job_of_its_own(broker: RedisServer, workers: Workers, tmp_path: Path) -> None:
    workers.start("w1", concurrency=2)
    out = tmp_path / "repeats"
    res = run_eval(out, "--executor", "celery", "--broker", broker.url, "--repeats", "2")
    assert (res["executor"], res["repeats"], res["n_tasks"], res["success_rate"]) == ("celery", 2, 2 * N_TASKS, 1.0)
    ids = sorted({t["task_id"] for t in res["tasks"]})
    assert sorted((t["task_id"], t["repeat"]) for t in res["tasks"]) == [(i, r) for i in ids for r in (1, 2)]
    assert {(c["episodes"], c["successes"]) for c in res["task_counts"].values()} == {(2, 2)}
    recs = list(read_jsonl(out / "episodes.jsonl"))
    assert len({r["episode_id"] for r in recs}) == 2 * N_TASKS  # one episode, one record per repeat
    on_stream = stream_records(broker, workers.stream, res["run_id"])
    assert Counter(r["episode_id"] for r in on_stream) == Counter(r["episode_id"] for r in recs)
    for t in res["tasks"]:  # the workers wrote each repeat's own OSWorld layout
        assert (out / f"repeat-{t['repeat']}" / t["domain"] / t["task_id"] / "result.txt").read_text() == "1.0\n"


def _claims(broker: RedisServer) -> dict[str, str]:
    r = redis.Redis.from_url(broker.url, decode_responses=True)
    try:
        return {k: r.get(k) or "" for k in r.scan_iter("osfarm:job:*:claim")}
    except redis.ConnectionError:
        return {}


@pytest.mark.timeout(900)
def test_a_worker_killed_mid_episode_its_episode_runs_again_elsewhere_once(
        farm: FarmServer, broker: RedisServer, workers: Workers, tmp_path: Path) -> None:
    workers.start("doomed", concurrency=1)
    out = tmp_path / "run"
    proc = subprocess.Popen(eval_args(out, "--executor", "celery", "--broker", broker.url, "--max-concurrent", "3"),
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        claims = wait_until(lambda: {k: v for k, v in _claims(broker).items() if v.startswith("doomed@")}, 180,
                            "the doomed worker to start an episode")
        workers.kill("doomed")  # mid-episode: its claim is held, its message unacknowledged
        workers.start("survivor", concurrency=1)
        stdout, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, stdout.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    results = json.loads((out / "results.json").read_text())
    assert results["n_tasks"] == N_TASKS and results["success_rate"] == 1.0, results["tasks"]
    check_one_record_per_task(out, results, broker, workers.stream)
    killed_task = next(iter(claims)).split(":")[3]
    assert killed_task in workers.log("survivor")  # the survivor ran the killed worker's episode


@pytest.mark.timeout(900)
def test_redis_restarted_mid_run_workers_reconnect_and_no_episode_is_lost(
        farm: FarmServer, broker: RedisServer, workers: Workers, tmp_path: Path) -> None:
    workers.start("w1", concurrency=1)
    workers.start("w2", concurrency=1)
    out = tmp_path / "run"
    proc = subprocess.Popen(eval_args(out, "--executor", "celery", "--broker", broker.url, "--max-concurrent", "3"),
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _claims(broker), 180, "an episode to start")
        broker.restart(kill=True, down_s=3.0)  # a crash: SIGKILL, then back on the same port with its AOF
        stdout, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, stdout.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    results = json.loads((out / "results.json").read_text())
    assert results["n_tasks"] == N_TASKS and results["success_rate"] == 1.0, results["tasks"]
    check_one_record_per_task(out, results, broker, workers.stream)
    # both workers are still serving after the restart
    assert all(p.poll() is None for p in workers.procs.values())


@pytest.mark.timeout(900)
def test_a_job_that_kills_its_worker_every_time_is_dead_lettered_after_the_cap(
        farm: FarmServer, broker: RedisServer, workers: Workers, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The out-of-memory case: the kernel kills the pool process running the episode, Celery hands
    the job out again (reject_on_worker_lost), the next run dies the same way. After
    OSFARM_MAX_DELIVERIES starts the job ends as an infra_error saying why, with one record."""
    import psutil

    monkeypatch.setenv("OSFARM_CLAIM_TTL_S", "3")  # a dead run's claim lapses quickly
    monkeypatch.setenv("OSFARM_MAX_DELIVERIES", "2")
    index = tmp_path / "one.json"
    first = json.loads((SUITE / "test_all.json").read_text())["os"][0]
    index.write_text(json.dumps({"os": [first]}))
    workers.start("oom", concurrency=1)
    out = tmp_path / "run"
    proc = subprocess.Popen(eval_args(out, "--executor", "celery", "--broker", broker.url, "--index", str(index)),
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for start in (1, 2):
            wait_until(lambda n=start: f"running the episode (start {n})" in workers.log("oom"), 180,
                       f"start {start} of the episode")
            for child in psutil.Process(workers.procs["oom"].pid).children():
                child.kill()  # the pool process running the episode: what the OOM killer does
        stdout, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, stdout.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    results = json.loads((out / "results.json").read_text())
    [row] = results["tasks"]
    assert row["status"] == "infra_error" and "started 2 times and never finished" in row["error"], row
    assert "running the episode (start 3)" not in workers.log("oom")
    check_one_record_per_task(out, results, broker, workers.stream)
    dead = redis.Redis.from_url(broker.url, decode_responses=True).xrange("osfarm:jobs:dead")
    assert [f["task_id"] for _, f in dead if f["run_id"] == results["run_id"]] == [first]
    assert workers.procs["oom"].poll() is None  # the worker itself lives on


def test_worker_and_executor_refuse_bad_settings(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "osfarm.cli", "worker", "--farm", "http://127.0.0.1:1", "--token", "t",
                        "--broker", "amqp://x"], cwd=ROOT, check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--broker must be a Redis URL" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(eval_args(tmp_path / "x", "--executor", "celery", "--broker", "redis://127.0.0.1:1/0",
                                 "--time-limit", "600"),
                       cwd=ROOT, env=_env(), check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "visibility timeout" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("repeat", ["../../etc", 0, -1, 1.5, True])
def test_a_jobs_repeat_must_be_a_positive_integer(repeat: object) -> None:
    from osfarm.runner.executors.worker_task import rollout_name

    # it names the repeat's directory on the worker: a job from the broker cannot climb out of the run
    with pytest.raises(ValueError, match="^repeat: must be a positive integer"):
        rollout_name({"task_id": "t", "repeat": repeat})
    assert rollout_name({"task_id": "t", "repeat": 2}) == "t#2" and rollout_name({"task_id": "t"}) == "t"


def test_time_limits_and_the_visibility_timeout_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from osfarm.runner.executors.celery_app import hard_limit_s, soft_limit_s
    from osfarm.runner.executors.celery_exec import CeleryExecutor

    assert hard_limit_s(40, 0) == 70 and soft_limit_s(40, 0) == 55  # 40 x 1 attempt + 30 s; 15 s earlier
    # every attempt may use its whole limit, plus the longest backoff before each retry (2 s, 4 s)
    assert hard_limit_s(600, 2) == 1836
    monkeypatch.setenv("OSFARM_CELERY_VISIBILITY_S", "1836")
    with pytest.raises(ValueError, match="visibility timeout is 1836 s"):
        CeleryExecutor.check_limits(600, 2)
    monkeypatch.setenv("OSFARM_CELERY_VISIBILITY_S", "1837")
    CeleryExecutor.check_limits(600, 2)


class AdapterServer:
    """A policy endpoint that answers as vLLM serving LoRA adapters does (a real HTTP server on
    loopback): every chat completion is WAIT, with no policy version in the answer; it logs the
    model (adapter) each request named and holds request number ``hold_at`` until ``release()``."""

    def __init__(self, hold_at: int) -> None:
        self.models: list[str] = []
        self.hold_at = hold_at
        self.held = threading.Event()
        self.go_on = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.models.append(body["model"])
                if len(outer.models) == outer.hold_at:
                    outer.held.set()
                    outer.go_on.wait(60)
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": "WAIT"},
                                                "finish_reason": "stop"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def hold(self, at: int) -> None:
        self.hold_at = len(self.models) + at
        self.held.clear()
        self.go_on.clear()

    def close(self) -> None:
        self.go_on.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.timeout(300)
def test_a_running_training_rollout_moves_to_the_newest_adapter_and_stops_when_aborted(
        farm: FarmServer, broker: RedisServer, workers: Workers, tmp_path: Path) -> None:
    """Issue 29, item 1: the trainer's queue side (QueuedRollouts) against a real worker. An
    interruptible rollout asks for the adapter the trainer published at its next step, and its
    steps record the version of the adapter that answered each; an aborted rollout that is
    running stops at its next step, releases its desktop and comes back as aborted, with no record."""
    workers.start("w1")
    policy = AdapterServer(hold_at=0)
    q: QueuedRollouts[str] = QueuedRollouts(broker.url, workers.stream, "run-ctl", time_limit_s=TIME_LIMIT_S,
                                            poll_s=0.2)
    task_id = json.loads(next((SUITE / "os").glob("*.json")).read_text())["id"]
    reports: list[tuple[str | None, object]] = []

    def job(steps: int, interruptible: bool) -> dict:
        return {"suite": str(SUITE), "index": None, "agent": "vlm",
                "agent_options": {"base_url": policy.url, "model": "policy-v1", "temperature": 0.0, "timeout_s": 60},
                "episode": {"max_steps": steps, "time_limit_s": TIME_LIMIT_S, "infra_retries": 0},
                "out": str(tmp_path / "run"), "cache": None, "offline": True, "policy_version": 1,
                "interruptible": interruptible}

    async def finished(seq: int) -> tuple[str, object]:
        tid = q.jobs[rollout_episode_id("run-ctl", task_id, seq)].task_id
        for _ in range(600):
            ((state, result),) = await asyncio.to_thread(q.states, [tid])
            if state in ("SUCCESS", "FAILURE", "REVOKED"):
                return state, result
            await asyncio.sleep(0.2)
        raise AssertionError(f"job {seq} did not end")

    async def scenario() -> tuple[dict, list[str], int]:
        policy.hold(2)  # step 2's call waits while the trainer moves on to version 2
        await q.submit("moved", task_id, 1, job(4, interruptible=True))
        await asyncio.to_thread(policy.held.wait, 120)
        await q.publish_routes({policy.url: ("policy-v2", 2)})
        policy.go_on.set()
        state, moved = await finished(1)
        assert state == "SUCCESS", moved
        moved_models = list(policy.models)
        policy.hold(2)
        await q.submit("aborted", task_id, 2, job(8, interruptible=False))
        await asyncio.to_thread(policy.held.wait, 120)
        assert await q.revoke(lambda item: item == "aborted") == 1
        policy.go_on.set()
        j = q.jobs[rollout_episode_id("run-ctl", task_id, 2)]
        state, result = await finished(2)
        q.judge([(j, (state, result))], time.monotonic(), DataManager(DataConfig()), tmp_path,
                lambda item, _rec, outcome, _sent, _done: reports.append((item, outcome)))
        assert state == "FAILURE", result
        return moved, moved_models, len(policy.models) - len(moved_models)

    try:
        result, moved_models, aborted_calls = asyncio.run(scenario())
    finally:
        policy.close()
    assert moved_models == ["policy-v1", "policy-v1", "policy-v2", "policy-v2"]
    versions = [s["model"]["policy_version"] for s in result["record"]["steps"]]
    assert versions == [1, 1, 2, 2]
    assert aborted_calls == 2  # stopped at its third step: no model call after the abort
    assert [(i, type(o).__name__) for i, o in reports] == [("aborted", "JobRevoked")] and q.counts.stopped == 1
    on_stream = [r["episode_id"] for r in stream_records(broker, workers.stream, "run-ctl")]
    assert on_stream == [rollout_episode_id("run-ctl", task_id, 1)]  # the aborted one left no record
    with httpx.Client(base_url=farm.url, headers={"Authorization": f"Bearer {farm.token}"}) as c:
        wait_until(lambda: c.get("/v1/pool").json()["counts"].get("leased", 0) == 0, 30, "the desktop released")
    assert "aborted by the trainer at a step" in workers.log("w1")


def test_a_restarted_trainer_aborts_the_jobs_its_crashed_process_left(broker: RedisServer, tmp_path: Path) -> None:
    """Issue 29, item 2: a trainer killed with jobs in the queue; the next process on the same
    stream (a new run id) aborts them before it sends its own (its capacity would not count them).
    No worker runs here: the jobs stay queued, as behind busy workers."""
    stream = "test:restart"
    url = broker.url.rsplit("/", 1)[0] + "/5"  # a database of its own: the other tests' workers never see these jobs
    job = {"suite": str(SUITE), "index": None, "agent": "noop", "agent_options": {},
           "episode": {"max_steps": 1, "time_limit_s": TIME_LIMIT_S, "infra_retries": 0}, "out": str(tmp_path),
           "cache": None, "offline": True}
    first: QueuedRollouts[int] = QueuedRollouts(url, stream, "run-first", time_limit_s=TIME_LIMIT_S)
    second: QueuedRollouts[int] = QueuedRollouts(url, stream, "run-second", time_limit_s=TIME_LIMIT_S)

    async def scenario() -> tuple[int, int]:
        for seq in (1, 2):
            await first.submit(seq, "t1", seq, job)  # then the process dies: nothing revokes them
        return await second.abort_earlier(), await second.abort_earlier()

    try:
        aborted, again = asyncio.run(scenario())
    finally:
        first.executor.close()
        second.executor.close()
    assert (aborted, again) == (2, 0) and second.counts.earlier_aborted == 2
    r = redis.Redis.from_url(url, decode_responses=True)
    # a worker that takes one of them anyway finds its episode aborted and does not run it
    assert r.smembers(abort_key("run-first")) == {rollout_episode_id("run-first", "t1", s) for s in (1, 2)}
    assert r.hlen(f"{stream}:jobs") == 0
