"""The compose cluster: `docker compose -f compose.yaml -f compose.host.yaml up -d` (redis + farm
on Docker desktops, host networking on 127.0.0.1), a task run through the farm API on a Docker
desktop, then `docker compose down` leaves no container behind."""

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

from docker_env import containers, ensure_images

ROOT = Path(__file__).resolve().parent.parent
MINI = ROOT / "tasks" / "mini" / "os"
TASK = "5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0a02"
TOKEN = "compose-test-token-1234"
# The first test to need the images builds them when missing (about 10-15 min on a fresh 2-core
# machine; CI builds them before pytest with `osfarm image build`).
pytestmark = pytest.mark.timeout(3600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compose(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = ["docker", "compose", "-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "compose.host.yaml"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    ensure_images("desktop")
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.fail("`docker compose` is missing: run scripts/setup-docker.sh")
    shared = tempfile.mkdtemp(prefix="ofcs", dir="/tmp")
    project = f"oftest{os.getpid()}"
    env = {
        **os.environ,
        "OSFARM_PROJECT": project,
        "OSFARM_TOKEN": TOKEN,
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
            subprocess.run(["docker", "rm", "-f", *left], capture_output=True)
        shutil.rmtree(shared, ignore_errors=True)


def test_compose_cluster_runs_a_task_on_a_docker_desktop(cluster: dict[str, Any]) -> None:
    # redis answers on its loopback port
    with socket.create_connection(("127.0.0.1", int(cluster["env"]["OSFARM_REDIS_PORT"])), timeout=5) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(64).startswith(b"+PONG")
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
