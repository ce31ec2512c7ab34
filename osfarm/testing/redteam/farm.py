"""The red team's farm, shared by tests/security/test_box_probes.py and bench/redteam.py: a farm
of one provider with small limits (so that bombs end quickly), a bystander desktop next to the
attacks, what the host knows and the box must not reach (:class:`probes.BoxContext`), and one
adversary episode through the normal runner."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from osfarm.client import AsyncFarm
from osfarm.farm.server import FarmServer
from osfarm.runner.episode import EpisodeConfig, EpisodeResult, run_episode
from osfarm.tasks.filecache import FileCache
from osfarm.tasks.model import parse_task
from osfarm.testing.docker_env import ensure_images
from osfarm.testing.farms import running_farm
from osfarm.testing.provider_options import provider_options
from osfarm.testing.redteam.adversary import AdversaryAgent
from osfarm.testing.redteam.probes import BoxContext

# The source checkout: the red team's task may name its folders (the task runs from it).
ROOT = Path(__file__).resolve().parents[3]
MEMORY, PIDS, HOME, TMP = "768m", 256, "128m", "64m"


def farm_options(name: str) -> dict[str, Any]:
    opts: dict[str, Any] = {"provider": name, "pool_min": 1, "pool_max": 3, "health_interval_s": 1.0,
                            "lease_ttl_s": 600, "sandbox_memory": MEMORY, "sandbox_pids": PIDS,
                            "sandbox_home_size": HOME, "sandbox_tmp_size": TMP, "docker_memory": MEMORY,
                            "docker_pids": PIDS}
    if name == "docker":
        ensure_images("desktop")
    if name == "libvirt":
        opts.update(provider_options("libvirt"), pool_min=1, pool_max=2)
    return opts


class Listener:
    """A TCP service on the host's loopback (a stand-in for Redis and the policy server)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def redteam_farm(name: str, cache: Path) -> Iterator[dict[str, Any]]:
    """A farm of provider ``name`` with a bystander desktop (a marker in its home), a loopback
    listener, a world-readable secret file on the host, and the probes' context."""
    secret_dir = Path(tempfile.mkdtemp(prefix="osfarm-redteam-"))
    secret = secret_dir / "host-secret.txt"
    secret.write_text("host secret " + os.urandom(8).hex())
    secret.chmod(0o644)
    secret_dir.chmod(0o755)
    (cache / "answer.txt").write_text("the expected answer")
    listener = Listener()
    try:
        with running_farm(prefix=f"ort{name[:2]}", start_timeout_s=1500 if name == "libvirt" else 180,
                          **farm_options(name)) as server:
            api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=600)
            bystander = api.post("/v1/desktops", json={"ttl_s": 1800, "wait_s": 600})
            assert bystander.status_code == 201, bystander.text
            lease = bystander.json()
            marker = "osfarm-bystander-" + os.urandom(6).hex()
            r = api.post(f"/v1/desktops/{lease['id']}/step", json={"actions": [
                f"open(__import__('os').path.expanduser('~/marker.txt'), 'w').write({marker!r})"]})
            assert r.status_code == 200 and all(a["ok"] for a in r.json()["results"]), r.text
            try:
                shadow = Path("/etc/shadow").read_text().splitlines()
            except OSError:
                shadow = []
            ctx = BoxContext(
                provider=name,
                host_paths=[str(ROOT), str(ROOT / "suites"), str(server.settings.state_dir), str(cache),
                            str(secret), "/root", "/var/cache/osfarm", "/var/lib/docker", "/work"],
                host_shadow_lines=[hashlib.sha256(line.encode()).hexdigest() for line in shadow],
                loopback_ports=[int(server.url.rsplit(":", 1)[1]), listener.port],
                marker=marker,
                memory_bytes=768 << 20,
                pids=PIDS,
                home_bytes=128 << 20,
            )
            try:
                yield {"name": name, "server": server, "api": api, "ctx": ctx, "bystander": lease, "marker": marker,
                       "cache": cache, "listener": listener, "secret": secret}
            finally:
                api.close()
    finally:
        listener.close()
        secret.unlink(missing_ok=True)
        secret_dir.rmdir()


TASK = {
    "id": "redteam-box", "snapshot": "os", "instruction": "Red team: leave the box.", "source": "osfarm tests/security",
    "config": [],
    "evaluator": {"func": "exact_match",
                  "result": {"type": "vm_file", "path": "/home/user/result.bin", "dest": "result.bin"},
                  "expected": {"type": "rule", "rules": {"expected": "forged"}}},
}


def run_adversary(server: FarmServer, codes: list[str], work: Path, cache: Path) -> EpisodeResult:
    """One episode of the adversary playing ``codes`` (then DONE), through the normal runner, paced
    by the default action timing (settle: each code action a child of the pre-imported zygote)."""

    async def go() -> EpisodeResult:
        async with AsyncFarm(server.url, server.token, timeout=600) as farm:
            cfg = EpisodeConfig(max_steps=len(codes) + 2, time_limit_s=900, infra_retries=0, lease_wait_s=600,
                                lease_ttl_s=900, code_timeout_s=300, work_dir=work)  # the default action timing
            return await run_episode(farm, parse_task(TASK, "redteam-box.json"), AdversaryAgent(codes),
                                     FileCache(cache, offline=True), cfg, run_id=f"redteam-{os.urandom(3).hex()}")

    return asyncio.run(go())


def bystander_ok(s: dict[str, Any]) -> str | None:
    """None when the farm serves and the desktop next to the attacks is untouched, else what is wrong."""
    api, lease = s["api"], s["bystander"]
    if api.get("/healthz").status_code != 200:
        return "the farm's /healthz failed"
    code = f"assert open(__import__('os').path.expanduser('~/marker.txt')).read() == {s['marker']!r}"
    r = api.post(f"/v1/desktops/{lease['id']}/step", json={"actions": [code]})
    if r.status_code != 200 or not all(a["ok"] for a in r.json()["results"]):
        return f"the bystander desktop: {r.status_code} {r.text[:300]}"
    return None


def destructive_held(res: EpisodeResult, word: str) -> str | None:
    """None when a bomb's episode ended as it must (an infra error naming the limit), else why not."""
    if res.status != "infra_error":
        return f"episode {res.status}: {res.error}"
    if word not in (res.error or ""):
        return f"the infra error does not name the {word}: {res.error}"
    return None
