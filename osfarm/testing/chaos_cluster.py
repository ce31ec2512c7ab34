"""The parts a chaos run kills, each a real process it can SIGKILL and bring back: Redis (AOF,
fsync always), a farm of sandbox desktops (``osfarm serve``), Celery workers (``osfarm worker``),
and a driver that kills them at random times. Used by tests/chaos/test_chaos.py (short, in
``make test``) and bench/chaos.py (long).

Everything runs under one base dir (state dirs, logs, run dirs, ``TMPDIR``), so that what is left
behind at the end can be found: processes (every pid the cluster ever had is remembered, with its
start time), sockets and temp files under the base dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import psutil
import redis

from osfarm.stream.jsonl import read_jsonl
from osfarm.testing.farm_process import FarmProcess
from osfarm.testing.redis_server import RedisServer
from osfarm.trainer.loop import checkpoint_state

# The source checkout: a chaos run replays its suites/mini and runs its processes from there.
ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "suites" / "mini"


def base_env(base: Path, **extra: str) -> dict[str, str]:
    tmp = base / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), **extra}


class Tracker:
    """Remembers every process of the cluster (the roots and, sampled every 0.2 s, their
    descendants) to find the ones still alive at the end."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[float, str]] = {}  # pid -> (create time, command)
        self.roots: list[Callable[[], list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos-tracker")

    def start(self) -> None:
        self._thread.start()

    def add(self, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            self.seen.setdefault(pid, (p.create_time(), " ".join(p.cmdline()[:6])))
            for c in p.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault(c.pid, (c.create_time(), " ".join(c.cmdline()[:6])))

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for root in list(self.roots):
                for pid in root():
                    self.add(pid)

    def stop(self) -> None:
        self._stop.set()

    def alive(self) -> list[str]:
        out = []
        for pid, (created, cmd) in self.seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} {cmd}")
        return out


class Workers:
    """``osfarm worker`` processes (each its own session: a kill takes its pool children too)."""

    def __init__(self, base: Path, farm: FarmProcess, broker: RedisServer, stream: str, env: dict[str, str]):
        self.base, self.farm, self.broker, self.stream, self.env = base, farm, broker, stream, env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs = base / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, concurrency: int = 1, wait: bool = True) -> None:
        log_path = self.logs / f"{name}.log"
        mark = log_path.stat().st_size if log_path.exists() else 0
        with log_path.open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "osfarm.cli", "worker", "--farm", self.farm.url, "--token", self.farm.token,
                 "--broker", self.broker.url, "--concurrency", str(concurrency), "--stream", self.stream,
                 "--name", f"{name}@chaos", "--loglevel", "info"],
                cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                stdin=subprocess.DEVNULL)
        if wait:
            deadline = time.monotonic() + 120
            while b" ready." not in log_path.read_bytes()[mark:]:
                if time.monotonic() > deadline or self.procs[name].poll() is not None:
                    raise RuntimeError(f"worker {name} did not start: {log_path.read_text(errors='replace')[-3000:]}")
                time.sleep(0.1)

    def kill(self, name: str) -> None:
        """SIGKILL the worker and its pool children: a lost machine."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)

    def kill_child(self, name: str) -> str:
        """SIGKILL the worker's pool process (the one running its episode, if any): Celery requeues
        the job (reject_on_worker_lost) and starts a new pool process."""
        children = psutil.Process(self.procs[name].pid).children()
        if not children:
            return "no pool process"
        busy = [c for c in children if c.cpu_percent(0.05) > 0] or children
        victim = busy[0]
        with contextlib.suppress(psutil.Error):
            victim.kill()
        return f"pool process {victim.pid}"

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.poll() is None]

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@dataclass
class Fault:
    at: float  # seconds after the driver started
    kind: str
    detail: str = ""


@dataclass
class Driver:
    """Kills one part at a time at random moments (seeded): ``plan`` lists fault kinds; each is
    run ``spacing`` (random within the range) after the previous one came back."""

    rng: random.Random
    actions: dict[str, Callable[[], str]]
    plan: list[str]
    spacing: tuple[float, float] = (2.0, 8.0)
    until: Callable[[], bool] = lambda: False
    done: list[Fault] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def run(self) -> None:
        t0 = time.monotonic()
        for kind in self.plan:
            wait_end = time.monotonic() + self.rng.uniform(*self.spacing)
            while time.monotonic() < wait_end:
                if self.until():
                    return
                time.sleep(0.1)
            if self.until():
                return
            try:
                detail = self.actions[kind]()
            except Exception as e:  # noqa: BLE001 - recorded; the test fails on it
                self.errors.append(f"{kind}: {type(e).__name__}: {e}")
                detail = f"FAILED: {e}"
            self.done.append(Fault(round(time.monotonic() - t0, 1), kind, detail))

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.run, daemon=True, name="chaos-driver")
        t.start()
        return t


def kill_a_desktop(farm: FarmProcess, rng: random.Random) -> str:
    """SIGKILL one desktop's X server (the session ends with it): a crashed desktop."""
    xs = []
    with contextlib.suppress(psutil.Error):
        for c in psutil.Process(farm.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if c.name() == "Xvfb":
                    xs.append(c)
    if not xs:
        return "no desktop running"
    victim = rng.choice(xs)
    with contextlib.suppress(psutil.Error):
        victim.kill()
    return f"Xvfb pid {victim.pid}"


def stream_records(broker_url: str, stream: str, run_id: str) -> list[dict[str, Any]]:
    r = redis.Redis.from_url(broker_url, decode_responses=True)
    entries = cast("list[tuple[str, dict[str, str]]]", r.xrange(stream))  # decode_responses: str, not bytes
    return [rec for _, f in entries if (rec := json.loads(f["record"]))["run_id"] == run_id]


def essentials(results: dict[str, Any]) -> list[tuple[Any, ...]]:
    return sorted((t["task_id"], t["status"], t["score"]) for t in results["tasks"])


def one_record_per_task(out: Path, results: dict[str, Any], broker_url: str, stream: str) -> list[str]:
    """Problems with the records of a run (empty: exactly one per task, in the run dir and on the stream)."""
    problems = []
    tasks = Counter(t["task_id"] for t in results["tasks"])
    recs = list(read_jsonl(out / "episodes.jsonl"))
    if Counter(r["task_id"] for r in recs) != tasks:
        problems.append(f"episodes.jsonl: {Counter(r['task_id'] for r in recs)} != tasks {tasks}")
    on_stream = stream_records(broker_url, stream, results["run_id"])
    if Counter(r["task_id"] for r in on_stream) != tasks:
        problems.append(f"stream: {Counter(r['task_id'] for r in on_stream)} != tasks {tasks}")
    if sorted(r["episode_id"] for r in on_stream) != sorted(r["episode_id"] for r in recs):
        problems.append("the stream's episode ids differ from episodes.jsonl's")
    return problems


def leftovers(base: Path, tracker: Tracker) -> list[str]:
    """What a finished run left: live processes, unix sockets and files in temp/state dirs."""
    out = [f"process {p}" for p in tracker.alive()]
    for p in base.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_socket():
                out.append(f"socket {p}")
    tmp = base / "tmp"
    if tmp.is_dir():
        # torch's compile cache (torchinductor_<user>) is shared by every later run on purpose
        out += [f"temp {p}" for p in tmp.iterdir() if not p.name.startswith(PERSISTENT_CACHES)]
    return out


PERSISTENT_CACHES = ("torchinductor_",)


# -- a training run under faults ------------------------------------------------------------------

TRAIN_CONFIG = """\
run_dir: {run}
updates: {updates}
max_episodes: 400
seed: 0
rollout:
  envs: 2
  eta: 1
  batch_size: {batch}
  max_steps: 1
agent:
  kind: choice
  temperature: 0.1
learner:
  lr: 0.003
  temperature: 0.1
data:
  options:
    drop_no_signal: false
metrics:
  plot: false
  prometheus_port: 0
"""


class Training:
    """``osfarm train`` (embedded default: tiny model, its own policy server and in-process sandbox
    farm, the choice agent) in a run dir; killed and resumed with the same command."""

    def __init__(self, base: Path, updates: int, env: dict[str, str], batch: int = 4):
        self.base, self.updates, self.env = base, updates, env
        self.run = base / "train"
        self.cfg = base / "train.yaml"
        self.cfg.write_text(TRAIN_CONFIG.format(run=self.run, updates=updates, batch=batch))
        self.log = base / "logs" / "train.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", "from osfarm.cli import app; app()", "train",
                                          "--config", str(self.cfg)], cwd=ROOT, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None and self.proc.poll() is None else []

    def episodes(self) -> int:
        p = self.run / "episodes.jsonl"
        return sum(1 for line in p.read_bytes().splitlines() if line.strip()) if p.is_file() else 0

    def version(self) -> int:
        state = checkpoint_state(self.run)
        return int(state.get("version", 0)) if state else 0

    def policy_server(self) -> psutil.Process | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "policy" in c.cmdline() and "serve" in c.cmdline():
                        return c
        return None

    def kill(self) -> str:
        """SIGKILL the trainer (its policy server and in-process farm's boxes die with it)."""
        if not self.alive():
            return "not running"
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)
        return f"trainer pid {self.proc.pid}"

    def kill_policy(self) -> str:
        server = self.policy_server()
        if server is None:
            return "no policy server"
        with contextlib.suppress(psutil.Error):
            server.kill()
        return f"policy server pid {server.pid}"

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def train_under_faults(training: Training, rng: random.Random, tracker: Tracker, timeout: float,
                       kills: list[str]) -> list[Fault]:
    """Run the training to its version count while ``kills`` ("policy", "trainer") happen one after
    another at random moments after episodes flow; every killed trainer is started again (resume).
    Returns the faults done; raises AssertionError when the run does not finish in ``timeout``."""
    done: list[Fault] = []
    t0 = time.monotonic()
    deadline = t0 + timeout
    training.start()
    tracker.roots.append(training.pids)
    todo = list(kills)
    next_at = training.episodes() + rng.randint(2, 6)
    while True:
        if training.proc is not None and training.proc.poll() is not None:
            rc = training.proc.returncode
            if rc == 0 and training.version() >= training.updates:
                return done
            if rc != 0 and rc != -signal.SIGKILL:
                raise AssertionError(f"osfarm train exited {rc}: {training.tail()}")
            training.start()  # resume
        if time.monotonic() > deadline:
            raise AssertionError(f"training did not reach version {training.updates} in {timeout:.0f} s "
                                 f"(version {training.version()}, faults {done}): {training.tail()}")
        if todo and training.episodes() >= next_at:
            kind = todo.pop(0)
            if kind == "policy" and training.policy_server() is None:
                todo.insert(0, kind)  # not up yet
            else:
                detail = training.kill_policy() if kind == "policy" else training.kill()
                done.append(Fault(round(time.monotonic() - t0, 1), kind, detail))
                if kind == "trainer":
                    training.start()
                next_at = training.episodes() + rng.randint(2, 6)
        time.sleep(0.5)
