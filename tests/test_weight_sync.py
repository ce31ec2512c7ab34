"""Weight sync against real policy server processes (``osfarm policy serve``).

* ``vllm_lora``: our server started with ``--enable-lora`` speaks vLLM's runtime LoRA API
  (load/unload adapter, adapter requests without a version), so the path the trainer takes
  with vLLM runs for real here: one adapter per version, the route an episode takes, unloading
  what no episode uses, the in-place mode; then a short ``osfarm train`` run on it whose every
  step carries the version of the adapter that produced it.
* a trainer that restarts while its vLLM keeps running finds the adapters already loaded: it
  takes them over and goes on (before, "already loaded" failed the sync and the run stalled);
* interruptible rollouts: an episode moves to the newest adapter at its next step, each step
  tagged with the version that answered it; a non-interruptible one keeps its first adapter.
* ``command``: a restart script that stops the server and starts it on the new checkpoint (the
  vLLM restart path), followed by the health check.
* failures: a server that does not answer, a command that fails or hangs, a junk checkpoint —
  each is reported for its server and the sync goes on with the next; servers are synced in
  parallel waves, and no call reaches a server while it swaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from osfarm.testing.ports import free_port

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from osfarm.policy.client import PolicyServer
from osfarm.policy.process import PolicyProcess
from osfarm.trainer.learner import Learner, LearnerOptions, LoraOptions
from osfarm.trainer.weight_sync import WeightSync

pytestmark = pytest.mark.timeout(600)

CHAT = [{"role": "user", "content": "Click the Save button."}]


@pytest.fixture(scope="module")
def tiny() -> Path:
    from osfarm.policy.tiny import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture(scope="module")
def checkpoints(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Versions 1 and 2 of a LoRA learner: different adapters (and their merged models)."""
    out = tmp_path_factory.mktemp("ckpts")
    learner = Learner(tiny, LearnerOptions(lora=LoraOptions(r=4, alpha=8, save_merged=True), device="cpu", seed=3))
    ckpts = {}
    gen = torch.Generator().manual_seed(7)
    for version in (1, 2):
        with torch.no_grad():
            for name, p in learner.model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.5)
        learner.version = version
        ckpts[version] = learner.save(out / f"v{version}")
    return ckpts


def _start(tiny: Path, log: Path, *args: str) -> PolicyProcess:
    proc = PolicyProcess(tiny, 0, "policy", log, extra_args=args)
    try:
        asyncio.run(proc.wait_ready(120))
    except BaseException:
        proc.stop()
        raise
    return proc


@pytest.fixture(scope="module")
def lora_server(tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    proc = _start(tiny, tmp_path_factory.mktemp("lora") / "server.log", "--enable-lora")
    yield proc
    proc.stop()


def _chat(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": CHAT, "max_tokens": 4, "temperature": 0, "logprobs": True})


def _served(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def test_vllm_lora_one_adapter_per_version_and_prune(lora_server: PolicyProcess, checkpoints: dict[int, Path]) -> None:
    url = lora_server.url
    sync = WeightSync([PolicyServer(url=url, kind="vllm_lora", lora_name="policy")], base_model="policy")
    server = sync.servers[0]
    assert sync.route(server) == ("policy", 0)  # before any adapter: the base model is version 0
    base = _chat(url, "policy").json()

    [r1] = asyncio.run(sync.sync(checkpoints[1], 1))
    assert r1.ok, r1.error
    assert sync.route(server) == ("policy-v1", 1)
    ans = _chat(url, "policy-v1")
    assert ans.status_code == 200, ans.text
    body = ans.json()
    assert "policy_version" not in body and "x-policy-version" not in ans.headers  # like vLLM: no version
    lp_base = [t["logprob"] for t in base["choices"][0]["logprobs"]["content"]]
    lp_v1 = [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]]
    assert lp_base != lp_v1  # the adapter's weights answered

    [r2] = asyncio.run(sync.sync(checkpoints[2], 2))
    assert r2.ok, r2.error
    assert sync.route(server) == ("policy-v2", 2)
    assert {"policy", "policy-v1", "policy-v2"} <= _served(url)
    assert asyncio.run(sync.prune({1})) == []  # an episode still runs on v1: kept
    assert "policy-v1" in _served(url)
    assert asyncio.run(sync.prune(set())) == []
    served = _served(url)
    assert "policy-v1" not in served and {"policy", "policy-v2"} <= served
    assert _chat(url, "policy-v1").status_code == 404
    assert sync.adapters[url] == {2: "policy-v2"}


def test_vllm_lora_in_place_keeps_one_name(lora_server: PolicyProcess, checkpoints: dict[int, Path]) -> None:
    url = lora_server.url
    sync = WeightSync([PolicyServer(url=url, kind="vllm_lora", lora_name="live", lora_versioned=False)])
    server = sync.servers[0]
    answers = []
    for v in (1, 2):
        [r] = asyncio.run(sync.sync(checkpoints[v], v))
        assert r.ok, r.error
        assert sync.route(server) == ("live", v)
        answers.append([t["logprob"] for t in _chat(url, "live").json()["choices"][0]["logprobs"]["content"]])
    assert answers[0] != answers[1]  # replaced in place
    assert sum(1 for m in _served(url) if m.startswith("live")) == 1


def test_vllm_lora_without_adapter_dir_is_reported(lora_server: PolicyProcess, tmp_path: Path) -> None:
    sync = WeightSync([PolicyServer(url=lora_server.url, kind="vllm_lora")])
    [r] = asyncio.run(sync.sync(tmp_path, 1))
    assert not r.ok and "adapter/" in (r.error or "")
    assert sync.versions[lora_server.url] is None


RESTART = """\
#!/bin/bash
# stop the server on this port (if any), start it on the checkpoint: the vLLM restart path
set -e
ckpt=$1; version=$2; port=$3; dir=$(dirname "$0")
if [ -f "$dir/pid" ]; then
  pid=$(cat "$dir/pid"); kill "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
fi
setsid {python} -c "from osfarm.cli import app; app()" policy serve --model "$ckpt" --port "$port" \\
  --version "$version" --served-model-name policy --log-level warning >> "$dir/server.log" 2>&1 < /dev/null &
echo $! > "$dir/pid"
"""


def test_command_restarts_the_server_on_the_checkpoint(
    checkpoints: dict[int, Path], tiny: Path, tmp_path: Path
) -> None:
    script = tmp_path / "restart.sh"
    script.write_text(RESTART.format(python=sys.executable))
    script.chmod(0o755)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = PolicyServer(url=url, kind="command", command=f"{script} {{path}} {{version}} {port}",
                          health_timeout_s=120)
    try:
        os.system(f"{script} {tiny} 0 {port}")  # the initial server
        sync = WeightSync([server])
        for v in (1, 2):
            [r] = asyncio.run(sync.sync(checkpoints[v], v))
            assert r.ok, r.error + (tmp_path / "server.log").read_text()[-2000:]
            health = httpx.get(f"{url}/health", timeout=10).json()
            assert health["policy_version"] == v
            assert sync.route(server) == ("policy", v)
    finally:
        pid = (tmp_path / "pid").read_text().strip() if (tmp_path / "pid").is_file() else None
        if pid:
            os.kill(int(pid), signal.SIGTERM)


@pytest.fixture
def health_urls():
    """Three plain HTTP servers answering ``GET /health`` (what a command's server is checked with)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Health) for _ in range(3)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def test_failures_are_reported_per_server_and_the_sync_goes_on(lora_server: PolicyProcess, health_urls: list[str],
                                                              tmp_path: Path) -> None:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]  # nothing listens there
    servers = [
        PolicyServer(url=dead[0], kind="osfarm", health_timeout_s=1),
        PolicyServer(url=dead[1], kind="command", command="echo broken checkpoint >&2; exit 3"),
        PolicyServer(url=dead[2], kind="command", command="sleep 30", timeout_s=1),
        PolicyServer(url=lora_server.url, kind="osfarm"),  # a real reload of a junk path
        PolicyServer(url=health_urls[0], kind="command", command="true"),
    ]
    sync = WeightSync(servers)
    results = asyncio.run(sync.sync(tmp_path / "missing", 1))
    errors = [r.error or "" for r in results]
    assert [r.ok for r in results] == [False, False, False, False, True], errors
    assert "not healthy" in errors[0]
    assert "exited 3" in errors[1] and "broken checkpoint" in errors[1]
    assert "ran past 1 s" in errors[2]
    assert "HTTP 400" in errors[3] and "path" in errors[3]
    assert sync.failures == 4
    assert [sync.versions[s.url] for s in servers] == [None, None, None, None, 1]
    assert httpx.get(f"{lora_server.url}/health", timeout=10).json()["policy_version"] == 0  # kept its weights


def test_servers_are_synced_in_parallel_waves(health_urls: list[str], tmp_path: Path) -> None:
    """Default waves are half the servers (rounded up): the first two reload together, the third
    after them (while a wave reloads, the others serve); ``wave: 1`` is one at a time."""
    log = tmp_path / "order.log"
    cmd = f"echo start {{url}} >> {log}; sleep 0.5; echo end {{url}} >> {log}"
    servers = [PolicyServer(url=u, kind="command", command=cmd) for u in health_urls]
    sync = WeightSync(servers)
    assert sync.wave == 2
    results = asyncio.run(sync.sync(tmp_path, 1))
    assert [r.url for r in results] == health_urls and all(r.ok for r in results), [r.error for r in results]
    words = log.read_text().split()
    assert words[0::2] == ["start", "start", "end", "end", "start", "end"], words
    assert set(words[1:4:2]) == set(health_urls[:2]) and words[9] == words[11] == health_urls[2]
    log.unlink()
    asyncio.run(WeightSync(servers, wave=1).sync(tmp_path, 2))
    words = log.read_text().split()
    assert words[0::2] == ["start", "end"] * 3  # never two at once
    assert words[1::4] == words[3::4] == health_urls
    with pytest.raises(ValueError, match="wave"):
        WeightSync(servers, wave=0)


def test_no_call_reaches_a_server_while_it_swaps(health_urls: list[str], tmp_path: Path) -> None:
    """A reload starts once the calls already sent to that server are back; calls that arrive
    during the reload wait for it; the other servers' calls go on meanwhile."""
    log = tmp_path / "order.log"
    cmd = f"echo reload-start >> {log}; sleep 0.5; echo reload-end >> {log}"
    server, other = PolicyServer(url=health_urls[0], kind="command", command=cmd), health_urls[1]
    sync = WeightSync([server, PolicyServer(url=other, kind="command", command="true")], wave=1)

    async def call(url: str, name: str, delay: float, hold: float) -> None:
        await asyncio.sleep(delay)
        async with sync.serving(url):
            with log.open("a") as f:
                f.write(f"{name}-start\n")
            await asyncio.sleep(hold)
            with log.open("a") as f:
                f.write(f"{name}-end\n")

    async def main() -> None:
        async def swap() -> None:
            await asyncio.sleep(0.1)
            await sync.sync(tmp_path, 1)

        await asyncio.gather(call(server.url, "early", 0, 0.4), swap(), call(server.url, "late", 0.3, 0),
                             call(other, "other", 0.3, 0))

    asyncio.run(main())
    lines = log.read_text().split()
    assert lines.index("early-end") < lines.index("reload-start")  # the call in flight came back first
    assert lines.index("reload-end") < lines.index("late-start")  # the new call waited for the swap
    assert lines.index("other-end") < lines.index("reload-end")  # another server's calls went on
    assert sync.versions[server.url] == 1 and not sync.swapping(server.url)


# ---- a short training run on the vllm_lora path --------------------------------------------------

TRAIN = """\
run_dir: {run}
updates: 2
max_episodes: 80
rollout:
  envs: 2
  eta: 1
  batch_size: 4
  max_steps: 1
agent:
  kind: choice
  temperature: 1.0
policy:
  model_name: policy
  servers:
    - url: {url}
      kind: vllm_lora
      lora_name: policy
learner:
  lr: 0.01
  temperature: 1.0
  lora:
    r: 4
    alpha: 8
    save_merged: false
data:
  options:
    drop_no_signal: false
metrics:
  plot: false
{cpus}"""


def test_train_on_vllm_lora_tags_every_step(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from osfarm.trainer.config import load_train_config
    from osfarm.trainer.loop import train

    monkeypatch.setenv("OSFARM_STATE_DIR", str(tmp_path / "state"))  # its own farm (one farm per state dir)
    proc = _start(tiny, tmp_path / "server.log", "--enable-lora")
    try:
        cfg_file = tmp_path / "train.yaml"
        cpus = sorted(os.sched_getaffinity(0))
        # the learner on its own core where there are two (the rest, and what it starts, on the others)
        pin = f"learner_cpus: [{cpus[0]}]\n" if len(cpus) > 1 else ""
        cfg_file.write_text(TRAIN.format(run=tmp_path / "run", url=proc.url, cpus=pin))
        summary = train(load_train_config(cfg_file))
        served = _served(proc.url)
    finally:
        proc.stop()
    assert sorted(os.sched_getaffinity(0)) == cpus  # given back
    assert summary["version"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["sync_ok"] for r in rows)
    assert all(r["staleness_max"] <= 1 for r in rows)
    episodes = [json.loads(x) for x in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    steps: list[dict[str, Any]] = [s for e in episodes for s in e["steps"]]
    assert steps and all(s["model"]["policy_version"] is not None for s in steps)
    assert {s["model"]["policy_version"] for s in steps} >= {0, 1}  # the base, then adapter v1
    # what stays loaded: the base, the current adapter and any an episode still ran on at the last prune
    assert {"policy", "policy-v2"} <= served <= {"policy", "policy-v1", "policy-v2"}


def test_resume_against_a_server_that_kept_its_adapters(tiny: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer dies, its vLLM keeps running with policy-v1 loaded; the resumed trainer must
    not fail on "already loaded", route to base-model v0 and stall: it takes policy-v1 over and
    its next episodes run on it (then on v2)."""
    from osfarm.trainer.config import load_train_config
    from osfarm.trainer.loop import train

    monkeypatch.setenv("OSFARM_STATE_DIR", str(tmp_path / "state"))
    proc = _start(tiny, tmp_path / "server.log", "--enable-lora")
    try:
        cfg_file = tmp_path / "train.yaml"
        cfg_file.write_text(
            TRAIN.format(run=tmp_path / "run", url=proc.url, cpus="").replace("updates: 2", "updates: 1")
        )
        assert train(load_train_config(cfg_file))["version"] == 1
        assert "policy-v1" in _served(proc.url)
        first = {e["episode_id"] for e in _episodes(tmp_path / "run")}
        summary = train(load_train_config(cfg_file, updates=2))  # a new trainer process would do the same
        served = _served(proc.url)
    finally:
        proc.stop()
    assert summary["start_version"] == 1 and summary["version"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2] and all(r["sync_ok"] for r in rows)
    resumed = [s for e in _episodes(tmp_path / "run") if e["episode_id"] not in first for s in e["steps"]]
    assert resumed and {s["model"]["policy_version"] for s in resumed} <= {1, 2}  # never the base model's 0
    assert "policy-v2" in served


def _episodes(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "episodes.jsonl").read_text().splitlines()]


def test_interruptible_rollouts_move_to_the_new_adapter(lora_server: PolicyProcess,
                                                        checkpoints: dict[int, Path]) -> None:
    from osfarm.agents import make_agent
    from osfarm.trainer.routing import RoutedAgent

    async def episode(interruptible: bool, name: str) -> tuple[list[int | None], list[str]]:
        sync = WeightSync([PolicyServer(url=lora_server.url, kind="vllm_lora", lora_name=name)])
        server = sync.servers[0]
        assert all(r.ok for r in await sync.sync(checkpoints[1], 1))
        agent = RoutedAgent(make_agent("choice", base_url=lora_server.url, model="policy", choices=["a", "b"],
                                       temperature=1.0, seed=1),
                            lambda: sync.route(server), interruptible=interruptible)
        agent.reset(None)
        models = []
        try:
            for step in range(2):
                await agent.apredict("Pick one.", {})
                models.append(agent.agent.client.model)
                if step == 0:  # a weight sync lands while the episode runs
                    assert all(r.ok for r in await sync.sync(checkpoints[2], 2))
        finally:
            await agent.aclose()
            for _ in (1, 2):
                with contextlib.suppress(Exception):
                    await sync.prune(set())
        return agent.step_versions, models

    got = asyncio.run(episode(True, "intr"))
    assert got == ([1, 2], ["intr-v1", "intr-v2"])  # AReaL: the next step runs on the new weights
    got = asyncio.run(episode(False, "keep"))
    assert got == ([1, 1], ["keep-v1", "keep-v1"])  # the episode keeps the adapter it started with


def test_vllm_lora_config_needs_learner_lora(tmp_path: Path) -> None:
    from osfarm.trainer.config import TrainConfigError, load_train_config

    cfg = tmp_path / "train.yaml"
    cfg.write_text(textwrap.dedent("""\
        policy:
          servers:
            - url: http://127.0.0.1:1
              kind: vllm_lora
        """))
    with pytest.raises(TrainConfigError, match="learner.lora"):
        load_train_config(cfg)
    cfg.write_text(textwrap.dedent("""\
        learner: {lora: {r: 4}, temperature: 0.1}
        policy:
          servers:
            - url: http://127.0.0.1:1
              kind: vllm_lora
              lora_name: policy
              lora_versioned: false
        """))
    with pytest.raises(TrainConfigError, match="lora_name"):
        load_train_config(cfg)


def test_learner_cpus_must_leave_cpus_for_the_rollouts() -> None:
    from osfarm.trainer.config import TrainConfig
    from osfarm.trainer.loop import Trainer, TrainError

    every = sorted(os.sched_getaffinity(0))
    trainer = Trainer(TrainConfig(learner_cpus=every))
    with pytest.raises(TrainError, match="proper subset"):
        trainer.split_cpus()
    assert sorted(os.sched_getaffinity(0)) == every
