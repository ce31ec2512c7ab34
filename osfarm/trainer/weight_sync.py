"""Weight sync: a new checkpoint reaches every policy server, one server at a time.

The servers are updated in turn (DART's rolling per-worker sync), so while one reloads the
others keep answering and the farm's episodes go on; a request already being generated on the
reloading server finishes with the old weights (our CPU server swaps weights between requests)
and its response says which version produced it.

Each server has an adapter for its kind:

* ``osfarm``: our CPU policy server: ``POST /v1/weights/reload {"path", "version"}`` answers
  ``{"version"}``.
* ``vllm_lora``: vLLM with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``:
  ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": true}`` with the
  checkpoint's ``adapter/`` dir (``learner.lora`` must be set). Agents request
  ``model = lora_name``. vLLM does not report a version: the sync remembers which version each
  server holds and the trainer tags what it can.
* ``command``: anything else (a vLLM restart, a ``/collective_rpc`` reload, a k8s rollout): a
  shell command template run with ``{path}``, ``{version}`` and ``{url}`` filled in; when it
  exits 0 the server is waited on until healthy.

Every call has a timeout and is followed by a health check (``GET /health``); a server that
fails keeps its old version, the failure is reported and logged, and the sync goes on with the
next server (weight syncs that hang forever are the most reported failure of RL trainers).
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, Field

from osfarm.trainer.learner import ADAPTER_DIR


class PolicyServer(BaseModel):
    """One policy server the trainer keeps up to date."""

    url: str = Field(description="base URL, e.g. http://127.0.0.1:8000 (no /v1)")
    kind: Literal["osfarm", "vllm_lora", "command"] = "osfarm"
    timeout_s: float = Field(default=300.0, gt=0, description="limit for one reload call")
    health_timeout_s: float = Field(default=60.0, gt=0, description="limit for the server to answer /health after it")
    lora_name: str = Field(default="policy", description="vllm_lora: the adapter name agents request")
    command: str | None = Field(default=None, description="command: template with {path} {version} {url}")
    api_key: str | None = None


@dataclass
class SyncResult:
    url: str
    version: int
    ok: bool
    seconds: float
    error: str | None = None


class SyncError(RuntimeError):
    pass


def _headers(server: PolicyServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}


async def wait_healthy(client: httpx.AsyncClient, server: PolicyServer, timeout_s: float) -> None:
    """Poll ``GET /health`` until it answers 200 (or raise SyncError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            r = await client.get(f"{server.url}/health", headers=_headers(server), timeout=5.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise SyncError(f"{server.url} not healthy after {timeout_s:g} s ({last})")
        await asyncio.sleep(0.2)


async def _reload_osfarm(client: httpx.AsyncClient, server: PolicyServer, path: Path, version: int) -> None:
    r = await client.post(f"{server.url}/v1/weights/reload", json={"path": str(path), "version": version},
                          headers=_headers(server), timeout=server.timeout_s)
    if r.status_code != 200:
        raise SyncError(f"{server.url}/v1/weights/reload: HTTP {r.status_code}: {r.text[:300]}")
    got = r.json().get("version")
    if got != version:
        raise SyncError(f"{server.url} reports version {got} after reloading version {version}")


async def _reload_vllm_lora(client: httpx.AsyncClient, server: PolicyServer, path: Path, version: int) -> None:
    adapter = path / ADAPTER_DIR
    if not adapter.is_dir():
        raise SyncError(f"{path}: no {ADAPTER_DIR}/ (vllm_lora needs learner.lora)")
    body = {"lora_name": server.lora_name, "lora_path": str(adapter), "load_inplace": True}
    r = await client.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=_headers(server),
                          timeout=server.timeout_s)
    if r.status_code != 200:
        raise SyncError(f"{server.url}/v1/load_lora_adapter: HTTP {r.status_code}: {r.text[:300]}")


async def _reload_command(server: PolicyServer, path: Path, version: int) -> None:
    if not server.command:
        raise SyncError(f"{server.url}: kind 'command' needs a command template")
    cmd = server.command.format(path=shlex.quote(str(path)), version=version, url=shlex.quote(server.url))
    proc = await asyncio.create_subprocess_shell(cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), server.timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise SyncError(f"{server.url}: reload command ran past {server.timeout_s:g} s: {cmd}") from None
    if proc.returncode != 0:
        raise SyncError(f"{server.url}: reload command exited {proc.returncode}: {out.decode(errors='replace')[-300:]}")


class WeightSync:
    """Pushes checkpoints to ``servers`` one at a time and remembers each one's version."""

    def __init__(self, servers: Sequence[PolicyServer]):
        self.servers = list(servers)
        self.versions: dict[str, int | None] = {s.url: None for s in self.servers}
        self.failures = 0

    async def sync_one(self, client: httpx.AsyncClient, server: PolicyServer, path: Path, version: int) -> SyncResult:
        t0 = time.perf_counter()
        try:
            await wait_healthy(client, server, server.health_timeout_s)
            if server.kind == "osfarm":
                await _reload_osfarm(client, server, path, version)
            elif server.kind == "vllm_lora":
                await _reload_vllm_lora(client, server, path, version)
            else:
                await _reload_command(server, path, version)
            await wait_healthy(client, server, server.health_timeout_s)
        except (SyncError, httpx.HTTPError, OSError, ValueError) as e:
            self.failures += 1
            msg = str(e) if isinstance(e, SyncError) else f"{server.url}: {type(e).__name__}: {e}"
            return SyncResult(server.url, version, False, time.perf_counter() - t0, msg)
        self.versions[server.url] = version
        return SyncResult(server.url, version, True, time.perf_counter() - t0)

    async def sync(self, path: Path, version: int) -> list[SyncResult]:
        """Reload every server in turn (never two at once); never raises for a server's failure."""
        results = []
        async with httpx.AsyncClient() as client:
            for server in self.servers:
                results.append(await self.sync_one(client, server, Path(path).resolve(), version))
        return results

    def min_version(self) -> int | None:
        """The oldest version any server holds (None while one has never been synced)."""
        vs = list(self.versions.values())
        return None if not vs or any(v is None for v in vs) else min(v for v in vs if v is not None)
