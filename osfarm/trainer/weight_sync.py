"""Weight sync: a new checkpoint reaches every policy server, in parallel waves.

The servers are updated in waves of ``wave`` servers at once (default: half of them, rounded up;
DART's rolling per-worker sync is ``wave: 1``): a wave's reloads run concurrently, so a sync takes
about as long as (servers / wave) reloads rather than one per server, while the servers of the
other waves keep answering and the farm's episodes go on. No request is sent to a server while it
swaps: episodes reach their server through :meth:`WeightSync.serving` (``RoutedAgent`` holds it
around each model call), which makes new calls wait while that server reloads, and the reload
starts once the calls already sent to it have come back (or after the server's timeout).

Each server has an adapter for its kind:

* ``osfarm``: our CPU policy server: ``POST /v1/weights/reload {"path", "version"}`` (the
  checkpoint's ``model/`` dir) answers ``{"version"}``.
* ``vllm_lora``: vLLM with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``:
  ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` with the checkpoint's ``adapter/``
  dir (``learner.lora`` must be set). vLLM's responses carry no policy version, so by default
  every version is its own adapter, ``<lora_name>-v<N>``: an episode requests the newest name when
  it starts and keeps it, so each of its steps was produced by exactly version N. Adapters no
  episode uses any more are unloaded (``prune``). ``lora_versioned: false`` instead reloads one
  name in place (``load_inplace``); steps are then tagged with a lower bound of their version.
  A server that kept running while the trainer restarted still has its adapters: :meth:`adopt`
  reads them from ``GET /v1/models`` (an adapter already loaded from the same path is taken as
  is, one of that name from another path is replaced in place), so a resumed run goes on with
  them instead of failing on "already loaded".
* ``command``: anything else (a vLLM restart, a ``/collective_rpc`` reload, a k8s rollout): a
  shell command template run with ``{path}`` (the served weights, ``model/``), ``{checkpoint}``,
  ``{version}`` and ``{url}`` filled in; when it exits 0 the server is waited on until healthy.

Over the queue (``rollout.executor: celery``) the calls come from workers on other hosts, which
the in-process gate cannot hold: ``fence`` (osfarm/trainer/swap_fence.py) marks the server swapping
in Redis for the swap's duration and waits for the workers' calls in flight, and the workers wait
or go to another server that serves what they need. The versions that queued or running jobs keep
(``pinned``) are never unloaded: a job ending gives its adapter back and the queue prunes it then.
``max_adapters`` (vLLM's ``--max-loras``) caps the adapters a server keeps over the queue: before
a load that would pass it, the oldest versions some job still keeps are evicted, their jobs
aborted (``on_evict``: the controller retries them on the new version) and counted in ``evicted``.

Every call has a timeout and is followed by a health check (``GET /health``; one before it too,
except for a command, which may be what revives a dead server); a server that fails keeps its
old version (its answers keep saying so, or keep the old adapter's name), the failure is reported
and logged, and the sync goes on with the next server (weight syncs that hang forever are the most
reported failure of RL trainers).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from osfarm.errors import OsfarmError
from osfarm.policy.client import PolicyNotHealthy, PolicyServer, wait_healthy
from osfarm.trainer.checkpoint import ADAPTER_DIR, model_dir


@dataclass
class SyncResult:
    url: str
    version: int
    ok: bool
    seconds: float
    error: str | None = None


class SyncError(OsfarmError, RuntimeError):
    pass


class SwapFence(Protocol):
    """Holds the calls of callers the in-process gate cannot see (workers of other hosts)."""

    async def begin(self, url: str, hold_s: float) -> None: ...  # mark, then wait out the calls in flight

    async def end(self, url: str, route: tuple[str, int | None], held: Sequence[str]) -> None: ...


async def _reload_osfarm(client: httpx.AsyncClient, server: PolicyServer, path: Path, version: int) -> None:
    r = await client.post(f"{server.url}/v1/weights/reload", json={"path": str(model_dir(path)), "version": version},
                          headers=server.headers(), timeout=server.timeout_s)
    if r.status_code != 200:
        raise SyncError(f"{server.url}/v1/weights/reload: HTTP {r.status_code}: {r.text[:300]}")
    got = r.json().get("version")
    if got != version:
        raise SyncError(f"{server.url} reports version {got} after reloading version {version}")


def adapter_name(server: PolicyServer, version: int) -> str:
    """The adapter name a vllm_lora server serves ``version`` under."""
    return f"{server.lora_name}-v{version}" if server.lora_versioned else server.lora_name


async def served_adapters(client: httpx.AsyncClient, server: PolicyServer) -> dict[str, str | None]:
    """The LoRA adapters a server has loaded: name -> path (``GET /v1/models``: vLLM lists each
    adapter with ``parent`` set and its path as ``root``)."""
    r = await client.get(f"{server.url}/v1/models", headers=server.headers(), timeout=server.health_timeout_s)
    if r.status_code != 200:
        raise SyncError(f"{server.url}/v1/models: HTTP {r.status_code}: {r.text[:300]}")
    return {str(m["id"]): m.get("root") for m in r.json().get("data", []) if m.get("parent")}


async def _reload_vllm_lora(client: httpx.AsyncClient, server: PolicyServer, path: Path, version: int) -> None:
    adapter = path / ADAPTER_DIR
    if not adapter.is_dir():
        raise SyncError(f"{path}: no {ADAPTER_DIR}/ (vllm_lora needs learner.lora)")
    name = adapter_name(server, version)
    loaded = await served_adapters(client, server)
    if name in loaded and loaded[name] is not None and Path(str(loaded[name])).resolve() == adapter.resolve():
        return  # still loaded from a run that went on from this checkpoint: nothing to do
    # a name loaded from elsewhere (another run) is replaced in place, never trusted
    body = {"lora_name": name, "lora_path": str(adapter),
            "load_inplace": (not server.lora_versioned) or name in loaded}
    r = await client.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=server.headers(),
                          timeout=server.timeout_s)
    if r.status_code != 200:
        raise SyncError(f"{server.url}/v1/load_lora_adapter: HTTP {r.status_code}: {r.text[:300]}")


async def _unload_vllm_lora(client: httpx.AsyncClient, server: PolicyServer, name: str) -> None:
    r = await client.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name},
                          headers=server.headers(), timeout=server.timeout_s)
    if r.status_code != 200:
        raise SyncError(f"{server.url}/v1/unload_lora_adapter {name}: HTTP {r.status_code}: {r.text[:300]}")


async def _reload_command(server: PolicyServer, path: Path, version: int) -> None:
    if not server.command:
        raise SyncError(f"{server.url}: kind 'command' needs a command template")
    cmd = server.command.format(path=shlex.quote(str(model_dir(path))), checkpoint=shlex.quote(str(path)),
                                version=version, url=shlex.quote(server.url))
    proc = await asyncio.create_subprocess_shell(cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), server.timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise SyncError(f"{server.url}: reload command ran past {server.timeout_s:g} s: {cmd}") from None
    if proc.returncode != 0:
        raise SyncError(f"{server.url}: reload command exited {proc.returncode}: {out.decode(errors='replace')[-300:]}")


class _Gate:
    """One server's traffic light: calls in flight, and whether new ones may start."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()


class WeightSync:
    """Pushes checkpoints to ``servers`` in waves and remembers each one's version."""

    def __init__(self, servers: Sequence[PolicyServer], base_model: str = "policy", *, wave: int | None = None,
                 max_adapters: int | None = None):
        if wave is not None and wave < 1:
            raise ValueError(f"wave must be >= 1 (servers reloaded at once), got {wave}")
        if max_adapters is not None and max_adapters < 2:
            raise ValueError(f"max_adapters must be >= 2 (the new adapter and one in use), got {max_adapters}")
        self.servers = list(servers)
        self.base_model = base_model  # what a server serves before its first adapter (vllm_lora)
        self.wave = wave or max(1, (len(self.servers) + 1) // 2)
        self.versions: dict[str, int | None] = {s.url: None for s in self.servers}
        self.adapters: dict[str, dict[int, str]] = {s.url: {} for s in self.servers}  # versioned adapters loaded
        self.failures = 0
        self._gates: dict[str, _Gate] = {}
        self._swaps: dict[str, asyncio.Lock] = {}  # one swap (sync or prune) of a server at a time
        self.fence: SwapFence | None = None  # over the queue: the workers' calls (swap_fence.py)
        self.pinned: Callable[[], set[int]] = set  # versions queued or running jobs keep (never unloaded)
        self.max_adapters = max_adapters  # vllm_lora, versioned: adapters a server keeps at most
        self.on_evict: Callable[[set[int]], Awaitable[int]] | None = None  # aborts the jobs of evicted versions
        self.evicted = 0  # jobs aborted because their adapter had to make room

    def _gate(self, url: str) -> _Gate:
        return self._gates.setdefault(url, _Gate())

    @contextlib.asynccontextmanager
    async def serving(self, url: str) -> AsyncIterator[None]:
        """Around one model call to the server at ``url``: waits while it reloads."""
        gate = self._gate(url)
        await gate.open.wait()
        gate.in_flight += 1
        gate.idle.clear()
        try:
            yield
        finally:
            gate.in_flight -= 1
            if gate.in_flight == 0:
                gate.idle.set()

    def swapping(self, url: str) -> bool:
        """The server is reloading (new calls to it wait)."""
        return not self._gate(url).open.is_set()

    def held(self, server: PolicyServer) -> list[str]:
        """Every model name ``server`` serves: the base model's and its adapters'."""
        return [self.base_model, *self.adapters.get(server.url, {}).values()]

    @contextlib.asynccontextmanager
    async def _swap(self, server: PolicyServer) -> AsyncIterator[None]:
        """Around a change of ``server``'s weights or adapters: no call reaches it meanwhile (the
        calls in flight come back first, or the server's timeout passes)."""
        async with self._swaps.setdefault(server.url, asyncio.Lock()):
            gate = self._gate(server.url)
            gate.open.clear()  # new calls wait from here on
            try:
                if self.fence is not None:
                    await self.fence.begin(server.url, server.timeout_s)
                try:
                    with contextlib.suppress(TimeoutError):  # a call that hangs does not hold the sync forever
                        await asyncio.wait_for(gate.idle.wait(), server.timeout_s)
                    yield
                finally:
                    if self.fence is not None:
                        await self.fence.end(server.url, self.route(server), self.held(server))
            finally:
                gate.open.set()

    def route(self, server: PolicyServer) -> tuple[str, int | None]:
        """The model name an episode starting now requests from ``server``, and the version it
        stands for when the server's answers do not say (None: they do, or it is unknown)."""
        version = self.versions.get(server.url)
        if server.kind == "osfarm":
            return self.base_model, None
        if server.kind == "vllm_lora":
            loaded = self.adapters[server.url]
            if not loaded:  # no adapter yet: the base model, the run's version 0
                return self.base_model, 0
            v = version if version in loaded else max(loaded)
            return loaded[v], v
        return self.base_model, version

    async def adopt(self, versions: set[int] | None = None) -> list[str]:
        """Take over the versioned adapters the vllm_lora servers already serve (a server that kept
        running while the trainer restarted): they are routed to and pruned like our own.
        ``versions``: only these (None: every ``<lora_name>-v<N>``). Returns what failed."""
        errors: list[str] = []
        async with httpx.AsyncClient() as client:
            for server in self.servers:
                if server.kind != "vllm_lora" or not server.lora_versioned:
                    continue
                pattern = re.compile(re.escape(server.lora_name) + r"-v(\d+)")
                try:
                    loaded = await served_adapters(client, server)
                except (SyncError, httpx.HTTPError, ValueError) as e:
                    errors.append(str(e) if isinstance(e, SyncError) else f"{server.url}: {type(e).__name__}: {e}")
                    continue
                for name in loaded:
                    m = pattern.fullmatch(name)
                    if m and (versions is None or int(m.group(1)) in versions):
                        self.adapters[server.url][int(m.group(1))] = name
        return errors

    async def sync_one(self, client: httpx.AsyncClient, server: PolicyServer, path: Path, version: int) -> SyncResult:
        async with self._swap(server):
            room = await self._make_room(client, server, version)
            result = await self._reload(client, server, path, version)
            if room and result.error:
                result.error += f" (making room: {'; '.join(room)})"
            return result

    async def _make_room(self, client: httpx.AsyncClient, server: PolicyServer, version: int) -> list[str]:
        """``max_adapters``: unload what loading ``version`` would put past it, first the adapters
        no job keeps, then the oldest kept ones, whose jobs are aborted (``on_evict``). Returns what
        failed to unload (the load then reports the server full)."""
        loaded = self.adapters[server.url]
        if (self.max_adapters is None or self.on_evict is None or server.kind != "vllm_lora"
                or not server.lora_versioned or version in loaded or len(loaded) < self.max_adapters):
            return []  # on_evict: over the queue, where every job's version is known (pinned)
        excess = len(loaded) + 1 - self.max_adapters
        keep = self.pinned() | {v for v in [self.versions[server.url]] if v is not None}
        drop = [v for v in sorted(loaded) if v not in keep][:excess]
        evict = {v for v in sorted(loaded) if v not in drop}
        evict = set(sorted(evict)[:excess - len(drop)])
        if evict and self.on_evict is not None:
            self.evicted += await self.on_evict(evict)
            drop += sorted(evict)
        return await self._unload(client, server, drop)

    async def _unload(self, client: httpx.AsyncClient, server: PolicyServer, versions: list[int]) -> list[str]:
        errors: list[str] = []
        loaded = self.adapters[server.url]
        for v in versions:
            try:
                await _unload_vllm_lora(client, server, loaded[v])
            except (SyncError, httpx.HTTPError) as e:
                errors.append(str(e) if isinstance(e, SyncError) else f"{server.url}: {type(e).__name__}: {e}")
                continue
            del loaded[v]
        return errors

    async def _reload(self, client: httpx.AsyncClient, server: PolicyServer, path: Path, version: int) -> SyncResult:
        t0 = time.perf_counter()
        try:
            if server.kind != "command":  # a restart command may be what revives a dead server
                await wait_healthy(client, server, server.health_timeout_s)
            if server.kind == "osfarm":
                await _reload_osfarm(client, server, path, version)
            elif server.kind == "vllm_lora":
                await _reload_vllm_lora(client, server, path, version)
            else:
                await _reload_command(server, path, version)
            await wait_healthy(client, server, server.health_timeout_s)
        except (SyncError, PolicyNotHealthy, httpx.HTTPError, OSError, ValueError) as e:
            self.failures += 1
            msg = str(e) if isinstance(e, SyncError | PolicyNotHealthy) else f"{server.url}: {type(e).__name__}: {e}"
            return SyncResult(server.url, version, False, time.perf_counter() - t0, msg)
        self.versions[server.url] = version
        if server.kind == "vllm_lora":
            if not server.lora_versioned:  # one name, replaced in place
                self.adapters[server.url].clear()
            self.adapters[server.url][version] = adapter_name(server, version)
        return SyncResult(server.url, version, True, time.perf_counter() - t0)

    async def sync(self, path: Path, version: int) -> list[SyncResult]:
        """Reload every server, ``wave`` at a time (the others keep serving); results in the
        servers' order; never raises for a server's failure."""
        results: list[SyncResult] = []
        target = Path(path).resolve()
        async with httpx.AsyncClient() as client:
            for i in range(0, len(self.servers), self.wave):
                wave = self.servers[i:i + self.wave]
                results += await asyncio.gather(*(self.sync_one(client, s, target, version) for s in wave))
        return results

    def _unused(self, server: PolicyServer, in_use: set[int]) -> list[int]:
        keep = in_use | self.pinned()
        return [v for v in sorted(self.adapters[server.url]) if v != self.versions[server.url] and v not in keep]

    async def prune(self, in_use: set[int]) -> list[str]:
        """Unload the versioned adapters that are neither a server's current one nor in ``in_use``
        (versions episodes still run on) nor ``pinned`` (versions queued or running jobs keep), with
        no call reaching the server meanwhile; returns what failed (an adapter left loaded only
        costs memory, so a failure is reported, never raised)."""
        errors: list[str] = []
        async with httpx.AsyncClient() as client:
            for server in self.servers:
                if server.kind != "vllm_lora" or not server.lora_versioned or not self._unused(server, in_use):
                    continue
                async with self._swap(server):
                    errors += await self._unload(client, server, self._unused(server, in_use))
        return errors

    def min_version(self) -> int | None:
        """The oldest version any server holds (None while one has never been synced)."""
        vs = list(self.versions.values())
        return None if not vs or any(v is None for v in vs) else min(v for v in vs if v is not None)
