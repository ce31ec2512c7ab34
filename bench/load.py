"""Load on the farm API: N concurrent clients leasing, observing, heartbeating and releasing for
D seconds on loopback; latency per route (p50/p99), answers by status, farm memory and open
files over time.

The farm is a real ``osfarm`` farm process (API, auth, pool, leases, registry on disk, guest
links) over the in-memory provider of osfarm/testing/memory_provider.py: its boxes are small HTTP servers
inside the farm process answering the guest's health and observation routes. Real desktops are
not an option at this scale on a small machine (500 desktops need ~100 GB and hundreds of
cores); what is measured is the farm itself, which is what 500 clients load. The clients run in
``--procs`` processes (asyncio, one ``AsyncFarm`` each), on the same machine as the farm: on a
2-core host they compete with it for CPU, so the latencies are an upper bound.

Each client loops: lease (wait up to 10 s), then 3-8 rounds of observe + heartbeat with a think
time between rounds (``--think``, default 0.05-0.3 s: far more aggressive than an agent, whose
model call takes seconds), release.
With ``--pool-max`` below ``--clients`` some lease requests wait and some get the documented
429 (every desktop leased, Retry-After); any other error is a failure (exit 1).

Where a lease's time goes, per phase (p50, p99, and the median among the slowest 1%): waiting
for a connection of the client's own pool, the TCP connect of a new connection, writing the
request, the answer (network, the farm's listen queue, its handling), the farm's handling (its
``Server-Timing`` header) and its wait for a free desktop (the lease's ``wait_s``). The farm's
event loop is ``--server-loop`` (its ``server_loop`` setting); ``both`` runs uvloop then asyncio
and prints their lease latencies side by side (docs/farm.md: why the farm runs on asyncio's).

    python bench/load.py                          # 500 clients, 60 s
    python bench/load.py --clients 100 --duration 20
    python bench/load.py --clients 500 --duration 25 --server-loop both
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import random
import ssl
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

from osfarm.client import AsyncFarm, FarmAPIError
from osfarm.http.server_timing import server_ms
from osfarm.testing.farm_process import FarmProcess

DOCUMENTED = {429, 503}  # every desktop leased / the farm cannot start desktops: retry after Retry-After
# where a lease's time goes, in order: the client's own pool, TCP connect, writing the request,
# the answer (network + the farm's accept queue + its handling), the farm's handling (Server-Timing),
# the farm's wait for a free desktop (the lease's wait_s, part of its handling); "outside the farm"
# is the answer less the farm's handling: the network, the listen queue, a request not yet read
PHASES = ("pool", "connect", "sent", "answer", "server", "outside the farm", "desktop wait")


class PhaseTimer(httpx.AsyncBaseTransport):
    """A transport that splits each request's time into phases, with httpcore's trace events.

    ``last`` holds the phases of the latest request (a client sends one at a time): ``pool``
    (waiting for a connection of the client's own pool), ``connect`` (TCP connect of a new
    connection), ``sent`` (request headers and body written), ``answer`` (from the request sent
    to the response's headers: the network, the farm's accept queue and its handling), and
    ``server`` (the farm's own handling, from its ``Server-Timing: app;dur=`` header)."""

    def __init__(self, inner: httpx.AsyncBaseTransport):
        self.inner = inner
        self.last: dict[str, float] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        marks: dict[str, float] = {"start": time.perf_counter()}

        async def trace(event: str, info: dict[str, Any]) -> None:
            marks.setdefault(event, time.perf_counter())

        request.extensions = {**request.extensions, "trace": trace}
        response = await self.inner.handle_async_request(request)
        done = time.perf_counter()
        conn0 = marks.get("connection.connect_tcp.started")
        conn1 = marks.get("connection.connect_tcp.complete")
        send0 = marks.get("http11.send_request_headers.started", done)
        sent = marks.get("http11.send_request_body.complete", send0)
        first = conn0 if conn0 is not None else send0
        self.last = {"pool": first - marks["start"],
                     "connect": (conn1 or first) - first,
                     "sent": sent - send0,
                     "answer": done - sent,
                     "server": (server_ms(response.headers.get("server-timing")) or 0.0) / 1000}
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()



def _client_proc(url: str, token: str, clients: int, duration: float, seed: int, out: Any,
                 think: tuple[float, float] = (0.05, 0.3)) -> None:
    lat: dict[str, list[float]] = defaultdict(list)
    status: Counter[str] = Counter()
    errors: list[str] = []
    lease_phases: list[dict[str, float]] = []  # one per granted lease, with its "total"

    # one SSL context for every client of this process: httpx builds one per client otherwise
    # (~100 ms each, blocking this process's loop while hundreds of clients start)
    ctx = ssl.create_default_context()

    async def one(i: int) -> None:
        rng = random.Random(seed * 100_000 + i)
        transport = PhaseTimer(httpx.AsyncHTTPTransport(verify=ctx, limits=httpx.Limits(max_connections=4)))
        async with AsyncFarm(url, token, timeout=60.0, retry_s=0, transport=transport) as farm:
            end = time.monotonic() + duration
            await asyncio.sleep(rng.uniform(0, 2.0))  # spread the start
            while time.monotonic() < end:
                t = time.perf_counter()
                try:
                    desk = await farm.lease(wait_s=10, ttl_s=60)
                except FarmAPIError as e:
                    lat["POST /v1/desktops"].append(time.perf_counter() - t)
                    status[f"POST /v1/desktops {e.status}"] += 1
                    if e.status not in DOCUMENTED:
                        errors.append(f"lease: {e}")
                    await asyncio.sleep(e.retry_after_s or 1.0)
                    continue
                lat["POST /v1/desktops"].append(time.perf_counter() - t)
                phases = transport.last
                lease_phases.append({**phases, "outside the farm": max(0.0, phases["answer"] - phases["server"]),
                                     "desktop wait": desk.info.wait_s,
                                     "total": lat["POST /v1/desktops"][-1]})
                status["POST /v1/desktops 201"] += 1
                for _ in range(rng.randint(3, 8)):
                    observe = functools.partial(desk.observe, screenshot=True)
                    for route, call in (("GET /v1/desktops/{id}/observation", observe),
                                        ("POST /v1/desktops/{id}/heartbeat", desk.heartbeat)):
                        t = time.perf_counter()
                        try:
                            await call()
                            status[f"{route.split()[0]} {route.split()[1]} 200"] += 1
                        except FarmAPIError as e:
                            status[f"{route} {e.status}"] += 1
                            errors.append(f"{route}: {e}")
                        lat[route].append(time.perf_counter() - t)
                    await asyncio.sleep(rng.uniform(*think))  # the agent thinks
                t = time.perf_counter()
                try:
                    await desk.close()
                    status["DELETE /v1/desktops/{id} 204"] += 1
                except FarmAPIError as e:
                    status[f"DELETE /v1/desktops/{{id}} {e.status}"] += 1
                    errors.append(f"release: {e}")
                lat["DELETE /v1/desktops/{id}"].append(time.perf_counter() - t)

    lag: list[float] = []

    async def probe(end: float) -> None:
        """How late this process's own event loop wakes up: client-side delay inside every latency."""
        while time.monotonic() < end:
            t = time.perf_counter()
            await asyncio.sleep(0.1)
            lag.append(time.perf_counter() - t - 0.1)

    async def main() -> None:
        await asyncio.gather(probe(time.monotonic() + duration), *(one(i) for i in range(clients)))

    asyncio.run(main())
    out.put({"lat": dict(lat), "lease_phases": lease_phases, "status": dict(status), "errors": errors[:50],
             "n_errors": len(errors), "lag": lag})


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))] * 1000 if s else float("nan")


def phase_table(leases: list[dict[str, float]]) -> list[str]:
    """Where a lease's time goes: each phase's p50 and p99 over every lease, and its median
    among the slowest 1% of leases (the tail the p99 measures)."""
    if not leases:
        return []
    cut = sorted(x["total"] for x in leases)[int(0.99 * len(leases))] if len(leases) > 1 else 0.0
    tail = [x for x in leases if x["total"] >= cut]
    lines = [f"where a lease's time goes ({len(leases)} leases; tail = the {len(tail)} at or over p99 "
             f"{cut * 1000:.0f} ms)",
             f"  {'phase':<16} {'p50 ms':>8} {'p99 ms':>8} {'tail median ms':>15}"]
    for phase in (*PHASES, "total"):
        xs = [x.get(phase, 0.0) for x in leases]
        lines.append(f"  {phase:<16} {pct(xs, 0.5):>8.1f} {pct(xs, 0.99):>8.1f} "
                     f"{pct([x.get(phase, 0.0) for x in tail], 0.5):>15.1f}")
    return lines


def lease_wait_buckets(text: str) -> list[tuple[str, int]]:
    """The farm's lease-wait histogram (cumulative counts per bucket) from its /metrics."""
    out = []
    for line in text.splitlines():
        if line.startswith("osfarm_lease_wait_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out.append((le, int(float(line.rsplit(" ", 1)[1]))))
    return out


def run(a: argparse.Namespace, server_loop: str) -> dict[str, Any]:
    """One load run against a fresh farm whose API runs on ``server_loop``; prints its report and
    returns its figures."""
    state = Path(tempfile.mkdtemp(prefix="osfl", dir="/tmp"))
    # health checks every 5 s (the tests' farms check every second: 450 boxes x 1/s is load of its own)
    farm = FarmProcess(state, provider="memory", pool_min=min(a.pool_max, a.clients // 2), pool_max=a.pool_max,
                       env={"OSFARM_HEALTH_INTERVAL_S": "5", "OSFARM_SERVER_LOOP": server_loop})
    farm.start(timeout=300)
    samples: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        t0 = time.monotonic()
        while not stop.wait(1.0):
            samples.append((time.monotonic() - t0, farm.rss_bytes(), farm.open_fds()))

    try:
        threading.Thread(target=sample, daemon=True).start()
        q: mp.Queue[dict[str, Any]] = mp.Queue()
        per = [a.clients // a.procs + (1 if i < a.clients % a.procs else 0) for i in range(a.procs)]
        think = tuple(float(x) for x in a.think.split(","))
        procs = [mp.Process(target=_client_proc, args=(farm.url, farm.token, n, a.duration, i, q, think))
                 for i, n in enumerate(per)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        results = [q.get(timeout=a.duration + 600) for _ in procs]
        for p in procs:
            p.join(60)
        wall = time.monotonic() - t0
        with farm.client() as c:
            metrics_text = c.get("/metrics").text
    finally:
        stop.set()
        farm.stop()
    lat: dict[str, list[float]] = defaultdict(list)
    status: Counter[str] = Counter()
    errors: list[str] = []
    leases = [x for r in results for x in r["lease_phases"]]
    for r in results:
        for k, v in r["lat"].items():
            lat[k] += v
        status.update(r["status"])
        errors += r["errors"]
    n_err = sum(r["n_errors"] for r in results)
    print(f"\n{a.clients} clients for {a.duration:g} s ({a.procs} client processes, think {a.think} s) on a "
          f"memory-provider farm ({server_loop} loop), pool_max {a.pool_max}; wall {wall:.0f} s; "
          f"{sum(len(x) for x in lat.values()) / wall:.0f} requests/s")
    print(f"{'route':<38} {'calls':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for route in sorted(lat):
        xs = lat[route]
        print(f"{route:<38} {len(xs):>7} {pct(xs, 0.5):>8.1f} {pct(xs, 0.99):>8.1f} {max(xs) * 1000:>8.1f}")
    print("\n".join(phase_table(leases)))
    print("answers:", ", ".join(f"{k}: {v}" for k, v in sorted(status.items())))
    warm = [s for s in samples if s[0] >= 10] or samples
    if warm:
        first, last = warm[0], warm[-1]
        rss = [s[1] for s in warm]
        print(f"farm RSS at {first[0]:.0f} s {first[1] / 2**20:.0f} MiB, at {last[0]:.0f} s {last[1] / 2**20:.0f} MiB "
              f"(min {min(rss) / 2**20:.0f}, max {max(rss) / 2**20:.0f}); open files {first[2]} -> {last[2]} "
              f"(max {max(s[2] for s in warm)})")
    lag = sorted(x for r in results for x in r["lag"])
    if lag:
        print(f"client event-loop lag (part of every latency above): p50 {pct(lag, 0.5):.0f} ms, "
              f"p99 {pct(lag, 0.99):.0f} ms, max {lag[-1] * 1000:.0f} ms")
    waits = lease_wait_buckets(metrics_text)
    if waits:
        print("server-side wait for a desktop (osfarm_lease_wait_seconds):",
              ", ".join(f"<= {le}: {n}" for le, n in waits))
    print(f"errors other than documented 429/503: {n_err}")
    for e in errors[:10]:
        print("  ", e)
    leasing = lat.get("POST /v1/desktops", [])
    return {"server_loop": server_loop, "clients": a.clients, "duration_s": a.duration, "pool_max": a.pool_max,
            "wall_s": wall, "requests_per_s": sum(len(x) for x in lat.values()) / wall,
            "routes": {r: {"calls": len(x), "p50_ms": pct(x, 0.5), "p99_ms": pct(x, 0.99), "max_ms": max(x) * 1000}
                       for r, x in lat.items()},
            "lease_ms": {"p50": pct(leasing, 0.5), "p99": pct(leasing, 0.99),
                         "max": max(leasing, default=float("nan")) * 1000},
            "lease_phases_p99_ms": {ph: pct([x.get(ph, 0.0) for x in leases], 0.99) for ph in PHASES},
            "status": dict(status), "errors": n_err, "samples": samples,
            "client_lag_ms": {"p50": pct(lag, 0.5), "p99": pct(lag, 0.99)} if lag else None,
            "lease_wait_buckets": waits}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--pool-max", type=int, default=450, help="desktops at most (below --clients: some 429s)")
    ap.add_argument("--think", default="0.05,0.3",
                    help="seconds a client waits between rounds, 'lo,hi' (an agent's model call takes 1-5 s)")
    ap.add_argument("--server-loop", default="asyncio", choices=("asyncio", "uvloop", "both"),
                    help="the farm API's event loop (the farm's server_loop); both: one run on each, uvloop first, "
                         "and a side-by-side lease table")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    runs = [run(a, loop) for loop in (("uvloop", "asyncio") if a.server_loop == "both" else (a.server_loop,))]
    if len(runs) > 1:
        base = runs[0]["lease_ms"]
        print(f"\nPOST /v1/desktops, {a.clients} clients, same machine, one after the other (not a quiet machine)")
        print(f"  {'farm loop':<10} {'p50 ms':>8} {'p99 ms':>9} {'max ms':>9} {'p99 vs uvloop':>14} "
              f"{'outside farm p99':>17} {'farm p99':>9} {'requests/s':>11}")
        for r in runs:
            m, ph = r["lease_ms"], r["lease_phases_p99_ms"]
            print(f"  {r['server_loop']:<10} {m['p50']:>8.1f} {m['p99']:>9.1f} {m['max']:>9.1f} "
                  f"{m['p99'] / base['p99']:>13.2f}x {ph['outside the farm']:>17.1f} {ph['server']:>9.1f} "
                  f"{r['requests_per_s']:>11.0f}")
    if a.json:
        a.json.write_text(json.dumps(runs if len(runs) > 1 else runs[0], indent=1))
    return 1 if any(r["errors"] for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
