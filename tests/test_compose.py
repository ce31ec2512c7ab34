"""The compose cluster: `docker compose -f compose.yaml -f compose.host.yaml up -d` (redis + farm
on Docker desktops, host networking on 127.0.0.1), a task run through the farm API on a Docker
desktop, then `docker compose down` leaves no container behind. First, without any image, the
secrets of the resolved compose model (`docker compose config`): Redis's password, vLLM's API key
and loopback bind, the policy token of the trainer and workers."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from osfarm.testing.docker_env import containers, ensure_images

ROOT = Path(__file__).resolve().parent.parent
MINI = ROOT / "suites" / "mini" / "os"
TASK = "5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0a02"
TOKEN = "compose-test-token-1234"
REDIS_PASSWORD = "compose-test-redis-5678"
POLICY_TOKEN = "compose-test-policy-9012"
# The first test to need the images builds them when missing (about 10-15 min on a fresh 2-core
# machine; CI builds them before pytest with `osfarm image build`).
pytestmark = pytest.mark.timeout(3600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compose(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = ["docker", "compose", "-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "compose.host.yaml"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


# ---------------------------------------------------------------- the model, no image needed


def config(*files: str, profile: str = "gpu", **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OSFARM_")}
    args = [a for f in files for a in ("-f", str(ROOT / f))]
    return subprocess.run(["docker", "compose", *args, "--profile", profile, "config", "--format", "json"],
                          env={**base, **env}, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


def model(*files: str, profile: str = "gpu", **env: str) -> dict[str, Any]:
    r = config(*files, profile=profile, **env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["services"]


SECRETS = {"OSFARM_TOKEN": TOKEN, "OSFARM_REDIS_PASSWORD": REDIS_PASSWORD, "OSFARM_POLICY_TOKEN": POLICY_TOKEN}


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.host.yaml")])
def test_compose_secrets_come_from_the_environment(files: tuple[str, ...]) -> None:
    services = model(*files, **SECRETS)
    redis = services["redis"]["command"]
    assert redis[redis.index("--requirepass") + 1] == REDIS_PASSWORD
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == REDIS_PASSWORD  # its healthcheck authenticates
    # every Redis URL carries the password, and no password sits on a command line
    urls = [v for svc in services.values() for v in (svc.get("environment") or {}).values()
            if isinstance(v, str) and v.startswith("redis://")]
    urls += [a for svc in services.values() for a in (svc.get("command") or []) if a.startswith("redis://")]
    assert urls and all(u.startswith(f"redis://:{REDIS_PASSWORD}@") for u in urls), urls
    assert not any(a.startswith("redis://") for svc in services.values() for a in (svc.get("command") or []))
    # vLLM: its API key from the environment, the trainer and the workers send it
    assert services["vllm"]["environment"]["VLLM_API_KEY"] == POLICY_TOKEN
    assert POLICY_TOKEN not in json.dumps(services["vllm"]["command"])
    for name in ("trainer", "worker"):
        assert services[name]["environment"]["OSFARM_POLICY_TOKEN"] == POLICY_TOKEN, name
    assert services["farm"]["environment"]["OSFARM_TOKEN"] == TOKEN


def test_host_mode_binds_vllm_and_everything_to_loopback() -> None:
    from osfarm.policy.vllm import VllmOptions, vllm_args

    services = model("compose.yaml", "compose.host.yaml", **SECRETS)
    assert services["vllm"]["network_mode"] == "host"
    cmd = services["vllm"]["command"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    # the same flags as compose.yaml's generated command, plus the host
    i = cmd.index("--host")
    assert cmd[:i] + cmd[i + 2:] == model("compose.yaml", **SECRETS)["vllm"]["command"]
    loader = type("L", (yaml.SafeLoader,), {})
    loader.add_constructor("!reset", lambda _loader, _node: None)
    raw = yaml.load((ROOT / "compose.host.yaml").read_text(), Loader=loader)["services"]["vllm"]["command"]
    assert raw == vllm_args(VllmOptions(host="127.0.0.1"), compose=True), "regenerate compose.host.yaml's vllm command"
    redis = services["redis"]["command"]
    assert redis[redis.index("--bind") + 1] == "127.0.0.1"
    assert services["farm"]["environment"]["OSFARM_HOST"] == "127.0.0.1"
    # bridge mode publishes ports on loopback only
    bridge = model("compose.yaml", **SECRETS)
    for name in ("farm", "vllm"):
        assert all(p.get("host_ip") == "127.0.0.1" for p in bridge[name]["ports"]), bridge[name]["ports"]


def test_missing_secrets_are_named() -> None:
    r = config("compose.yaml", OSFARM_TOKEN=TOKEN)
    assert r.returncode != 0 and "OSFARM_REDIS_PASSWORD" in r.stderr, r.stderr
    r = config("compose.yaml", OSFARM_REDIS_PASSWORD=REDIS_PASSWORD)
    assert r.returncode != 0 and "OSFARM_TOKEN" in r.stderr, r.stderr


def test_vllm_refuses_to_start_without_an_api_key() -> None:
    """The vllm service's entrypoint guard, run by the same sh without the image."""
    entry = model("compose.yaml", **{**SECRETS, "OSFARM_POLICY_TOKEN": ""})["vllm"]["entrypoint"]
    assert entry[:2] == ["/bin/sh", "-c"]
    entry = [a.replace("$$", "$") for a in entry]  # `config` prints compose's escaped form; the container gets '$'
    r = subprocess.run(entry + ["--model", "x"], env={"PATH": "/usr/bin:/bin", "VLLM_API_KEY": ""},
                       capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 2 and "OSFARM_POLICY_TOKEN" in r.stderr, (r.returncode, r.stderr)
    # with a key it goes on to exec vLLM (not installed here: the exec itself fails, past the guard)
    r = subprocess.run(entry + ["--model", "x"], env={"PATH": "/usr/bin:/bin", "VLLM_API_KEY": "k"},
                       capture_output=True, text=True, timeout=30, check=False)
    assert "OSFARM_POLICY_TOKEN" not in r.stderr and r.returncode != 2, (r.returncode, r.stderr)


def test_the_train_cpu_profile_trains_through_the_queue_without_gpus() -> None:
    """The train profile on CPUs: our policy server on the tiny model for vLLM, a trainer with
    --executor celery and no GPU reservation (bench/compose_train.sh runs it end to end)."""
    for files in (("compose.yaml",), ("compose.yaml", "compose.host.yaml")):
        services = model(*files, profile="train-cpu", **SECRETS)
        assert {"policy-cpu", "trainer-cluster-cpu", "worker"} <= set(services) and "vllm" not in set(services)
        policy, trainer = services["policy-cpu"], services["trainer-cluster-cpu"]
        assert policy["command"][:5] == ["osfarm", "policy", "serve", "--model", "tiny"]
        assert trainer["command"][-2:] == ["--executor", "celery"]
        assert not (trainer.get("deploy") or {}).get("resources", {}).get("reservations"), trainer.get("deploy")
        # the token from the environment, never on a command line; the trainer and the workers send it
        for name in ("policy-cpu", "trainer-cluster-cpu", "worker"):
            assert services[name]["environment"]["OSFARM_POLICY_TOKEN"] == POLICY_TOKEN, name
        assert POLICY_TOKEN not in json.dumps(policy["command"])
        assert trainer["environment"]["OSFARM_BROKER"].startswith(f"redis://:{REDIS_PASSWORD}@")
        # the weight sync hands the server a checkpoint path under the trainer's /runs: the same mount
        runs = {svc: next(v["source"] for v in services[svc]["volumes"] if v["target"] == "/runs")
                for svc in ("policy-cpu", "trainer-cluster-cpu")}
        assert len(set(runs.values())) == 1, runs
        # the suites at the same path for the trainer and the workers (jobs name it)
        suites = {svc: [v["target"] for v in services[svc]["volumes"] if v["target"] == "/etc/osfarm/suites"]
                  for svc in ("trainer-cluster-cpu", "worker")}
        assert all(suites.values()), suites
    host = model("compose.yaml", "compose.host.yaml", profile="train-cpu", **SECRETS)
    cmd = host["policy-cpu"]["command"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--allow-remote" not in cmd
    assert all(host[n]["network_mode"] == "host" for n in ("policy-cpu", "trainer-cluster-cpu"))
    bridge = model("compose.yaml", profile="train-cpu", **SECRETS)["policy-cpu"]["ports"]
    assert all(p.get("host_ip") == "127.0.0.1" for p in bridge), bridge
    # no token, no server: the entrypoint's guard, run by the same sh without the image
    entry = [a.replace("$$", "$") for a in host["policy-cpu"]["entrypoint"]]
    r = subprocess.run(entry + ["true"], env={"PATH": "/usr/bin:/bin", "OSFARM_POLICY_TOKEN": ""},
                       capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 2 and "OSFARM_POLICY_TOKEN" in r.stderr, (r.returncode, r.stderr)
    r = subprocess.run(entry + ["true"], env={"PATH": "/usr/bin:/bin", "OSFARM_POLICY_TOKEN": "k"},
                       capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, (r.returncode, r.stderr)


# ---------------------------------------------------------------- the running cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    ensure_images("desktop")
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode != 0:
        pytest.fail("`docker compose` is missing: run scripts/setup-docker.sh")
    shared = tempfile.mkdtemp(prefix="ofcs", dir="/tmp")
    project = f"oftest{os.getpid()}"
    env = {
        **os.environ,
        "OSFARM_PROJECT": project,
        "OSFARM_TOKEN": TOKEN,
        "OSFARM_REDIS_PASSWORD": REDIS_PASSWORD,
        "OSFARM_API_PORT": str(free_port()),
        "OSFARM_REDIS_PORT": str(free_port()),
        "OSFARM_SHARED_DIR": shared,
        "OSFARM_POOL_MIN": "1",
        "OSFARM_POOL_MAX": "1",
        "OSFARM_WIDTH": "1024",
        "OSFARM_HEIGHT": "768",
        "OSFARM_DOCKER_MEMORY": "2g",
    }
    info = {"env": env, "project": project, "shared": shared,
            "url": f"http://127.0.0.1:{env['OSFARM_API_PORT']}", "down": None}
    try:
        up = compose(env, "up", "-d", "--wait", "--wait-timeout", "240", "redis", "farm", timeout=300)
        if up.returncode != 0:
            logs = compose(env, "logs", "--tail", "40", "farm").stdout
            pytest.fail(f"docker compose up failed:\n{up.stderr[-3000:]}\nfarm logs:\n{logs[-3000:]}")
        yield info
    finally:
        down = compose(env, "down", "--volumes", "--timeout", "60", timeout=180)
        info["down"] = down
        # Whatever happened above, nothing of this test may outlive it.
        left = containers(f"org.osfarm.scope={shared}") + containers(f"com.docker.compose.project={project}")
        if left:
            subprocess.run(["docker", "rm", "-f", *left], capture_output=True, check=False)
        shutil.rmtree(shared, ignore_errors=True)


def test_compose_cluster_runs_a_task_on_a_docker_desktop(cluster: dict[str, Any]) -> None:
    # redis answers on its loopback port, to its password only
    with socket.create_connection(("127.0.0.1", int(cluster["env"]["OSFARM_REDIS_PORT"])), timeout=5) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(64).startswith(b"-NOAUTH")
        s.sendall(b"AUTH " + REDIS_PASSWORD.encode() + b"\r\nPING\r\n")
        got = b""
        while got.count(b"\r\n") < 2:
            got += s.recv(64)
        assert got == b"+OK\r\n+PONG\r\n", got
    task = json.loads((MINI / f"{TASK}.json").read_text())
    solution = json.loads((MINI / task["trajectory"]).read_text())
    with httpx.Client(base_url=cluster["url"], headers={"Authorization": f"Bearer {TOKEN}"}, timeout=180) as api:
        r = api.post("/v1/desktops", json={"ttl_s": 300, "wait_s": 180})
        assert r.status_code == 201, r.text
        lease = r.json()
        assert lease["provider"] == "docker" and lease["image"] == "osfarm/desktop:latest", lease
        lid = lease["id"]
        # the desktop is a sibling container of the farm, labelled with the farm's shared dir
        assert len(containers(f"org.osfarm.scope={cluster['shared']}")) >= 1
        r = api.post(f"/v1/desktops/{lid}/reset", json={"task": task})
        assert r.status_code == 200, r.text
        r = api.post(f"/v1/desktops/{lid}/step", json={"actions": solution[0]})
        assert r.status_code == 200 and all(a["ok"] for a in r.json()["results"]), r.text
        r = api.post(f"/v1/desktops/{lid}/evaluate", json={"task": task})
        assert r.status_code == 200, r.text
        assert r.json()["score"] == 1.0, r.json()
        api.delete(f"/v1/desktops/{lid}")


def test_compose_down_leaves_no_container(cluster: dict[str, Any]) -> None:
    """Runs last in this module: take the cluster down and look for anything left by label."""
    down = compose(cluster["env"], "down", "--volumes", "--timeout", "60", timeout=180)
    assert down.returncode == 0, down.stderr
    assert containers(f"org.osfarm.scope={cluster['shared']}") == []
    assert containers(f"com.docker.compose.project={cluster['project']}") == []
