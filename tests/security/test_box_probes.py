"""In-box red team (issue 13 item 7): an adversarial agent (adversary.py), run by the normal
runner (``run_episode``) on a leased desktop of each provider, tries every box probe of
probes.py: host secrets, the checkout, suite caches and the farm's state, another desktop's home,
the guest's token and socket, killing or tracing the guest, the host's loopback services,
another desktop's X server, box root versus host root, a full disk, a 100 GB sparse result, a
fork bomb and a memory bomb.

Each probe must be held: it reports HELD from inside the box; the farm keeps serving; a
bystander desktop leased next to it is unaffected (its guest answers, its home is intact); the
episode ends as the agent's failure or as an infra error naming the limit that stopped it, never
as a success. The desktops run with small limits so that the bombs end quickly.

The sandbox and Docker run in ``make test``; libvirt (minutes per boot under TCG) only with
OSFARM_REDTEAM_LIBVIRT=1, non-destructive probes only.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from adversary import AdversaryAgent, verdicts
from docker_env import ensure_images
from farms import running_farm
from probes import BoxContext, box_probes

from osfarm.client import AsyncFarm
from osfarm.farm.server import FarmServer
from osfarm.runner.episode import EpisodeConfig, EpisodeResult, run_episode
from osfarm.tasks.filecache import FileCache
from osfarm.tasks.model import parse_task

ROOT = Path(__file__).resolve().parents[2]
MEMORY, PIDS, HOME, TMP = "768m", 256, "128m", "64m"
PROVIDERS = ["sandbox", "docker"] + (["libvirt"] if os.environ.get("OSFARM_REDTEAM_LIBVIRT") == "1" else [])
pytestmark = pytest.mark.timeout(1800)


def farm_options(name: str) -> dict[str, Any]:
    opts: dict[str, Any] = dict(provider=name, pool_min=1, pool_max=3, health_interval_s=1.0, lease_ttl_s=600,
                                sandbox_memory=MEMORY, sandbox_pids=PIDS, sandbox_home_size=HOME,
                                sandbox_tmp_size=TMP, docker_memory=MEMORY, docker_pids=PIDS)
    if name == "docker":
        ensure_images("desktop")
    if name == "libvirt":
        from test_provider_conformance import provider_options  # the VM disk, built when missing

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


@pytest.fixture(scope="module", params=PROVIDERS)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    name = request.param
    secret_dir = Path(tempfile.mkdtemp(prefix="osfarm-redteam-"))
    secret = secret_dir / "host-secret.txt"
    secret.write_text("host secret " + os.urandom(8).hex())
    secret.chmod(0o644)
    secret_dir.chmod(0o755)
    cache = tmp_path_factory.mktemp("cache")
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
                host_paths=[str(ROOT), str(ROOT / "tasks"), str(server.settings.state_dir), str(cache),
                            str(secret), "/root", "/var/cache/osfarm", "/var/lib/docker", "/work"],
                host_shadow_lines=[hashlib.sha256(line.encode()).hexdigest() for line in shadow],
                loopback_ports=[int(server.url.rsplit(":", 1)[1]), listener.port],
                marker=marker,
                memory_bytes=768 << 20,
                pids=PIDS,
                home_bytes=128 << 20,
            )
            yield {"name": name, "server": server, "api": api, "ctx": ctx, "bystander": lease, "marker": marker,
                   "cache": cache, "listener": listener, "secret": secret}
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
    import asyncio

    async def go() -> EpisodeResult:
        async with AsyncFarm(server.url, server.token, timeout=600) as farm:
            cfg = EpisodeConfig(max_steps=len(codes) + 2, time_limit_s=900, infra_retries=0, lease_wait_s=600,
                                lease_ttl_s=900, code_timeout_s=300, work_dir=work, action_timing="fast")
            return await run_episode(farm, parse_task(TASK, "redteam-box.json"), AdversaryAgent(codes),
                                     FileCache(cache, offline=True), cfg, run_id=f"redteam-{os.urandom(3).hex()}")

    return asyncio.run(go())


def bystander_ok(s: dict[str, Any]) -> None:
    """The farm serves and the desktop next to the attacks is untouched."""
    api, lease = s["api"], s["bystander"]
    assert api.get("/healthz").status_code == 200
    code = f"assert open(__import__('os').path.expanduser('~/marker.txt')).read() == {s['marker']!r}"
    r = api.post(f"/v1/desktops/{lease['id']}/step", json={"actions": [code]})
    assert r.status_code == 200, r.text
    assert all(a["ok"] for a in r.json()["results"]), r.json()


def test_box_probes_are_held(setup: dict[str, Any], tmp_path: Path) -> None:
    probes = box_probes(setup["name"], destructive=False)
    res = run_adversary(setup["server"], [p.code(setup["ctx"]) for p in probes], tmp_path, setup["cache"])
    got = verdicts(res)
    table = {p.name: v for p, v in zip(probes, got, strict=False)}
    print(json.dumps(table, indent=1))
    assert len(got) == len(probes), (res.status, res.error, got)
    broken = {name: v for name, v in table.items() if v[0] != "HELD"}
    assert not broken, broken
    # the sparse "result": the evaluation refuses it, and nothing else failed on the way
    assert res.status in ("failure", "infra_error"), (res.status, res.error)
    if res.status == "infra_error":
        assert "limit" in (res.error or ""), res.error
    assert setup["listener"].accepted == 0
    bystander_ok(setup)


@pytest.mark.parametrize("bomb", ["fork_bomb", "memory_bomb"])
def test_bombs_end_only_their_desktop(setup: dict[str, Any], bomb: str, tmp_path: Path) -> None:
    if setup["name"] == "libvirt":
        pytest.skip("bombs are not run on VMs here (TCG boots take minutes); the VM's own kernel holds them")
    probe = next(p for p in box_probes(setup["name"], destructive=True) if p.name == bomb)
    res = run_adversary(setup["server"], [probe.code(setup["ctx"]), "import time; time.sleep(5)"], tmp_path,
                        setup["cache"])
    got = verdicts(res)
    print(bomb, res.status, res.error, got)
    assert not any(v == "BREACH" for v, _ in got), got
    # the desktop is ended, as an infra error that names the limit it ran into
    assert res.status == "infra_error", (res.status, res.error, got)
    word = "process limit" if bomb == "fork_bomb" else "memory limit"
    assert word in (res.error or ""), res.error
    bystander_ok(setup)
