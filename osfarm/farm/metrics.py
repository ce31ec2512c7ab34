"""Prometheus metrics of the farm, on one module-level registry the API serves at ``/metrics``.

A private registry (not prometheus_client's global one) keeps the exposition to osfarm's own
series and lets tests import this module any number of times without duplicate-series errors.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

# Desktop counts per pool state (starting, ready, leased, resetting, failed, stopping).
DESKTOPS = Gauge("osfarm_desktops", "desktops by state", ["state"], registry=REGISTRY)

# Bookkeeping is sub-millisecond when a desktop is warm; seconds mean a cold start or a queue.
LEASE_WAIT = Histogram(
    "osfarm_lease_wait_seconds",
    "time a lease request waited for a desktop",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
    registry=REGISTRY,
)
_BOX_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60)
RESET_SECONDS = Histogram(
    "osfarm_reset_seconds", "time to reset a released desktop to ready", buckets=_BOX_BUCKETS, registry=REGISTRY
)
START_SECONDS = Histogram(
    "osfarm_start_seconds", "time to start a new desktop to ready", buckets=_BOX_BUCKETS, registry=REGISTRY
)
# Observed by the API around each step request (actions + observation).
STEP_SECONDS = Histogram(
    "osfarm_step_seconds",
    "time of one step request",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
# reason is a small fixed set: start_failed, reset_failed, crashed, unreachable.
DESKTOP_FAILURES = Counter(
    "osfarm_desktop_failures_total", "desktops that failed, by reason", ["reason"], registry=REGISTRY
)

# CPU accounting per desktop (its cgroup, else its process tree): the cost that grows with every
# episode. phase: start (a new box to ready), reset (a released box to ready again), episode
# (a lease, from grant to release or expiry).
DESKTOP_CPU = Counter(
    "osfarm_desktop_cpu_seconds_total", "CPU-seconds desktops used, by phase", ["phase"], registry=REGISTRY
)
_CPU_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 30, 60, 300)
RESET_CPU = Histogram(
    "osfarm_reset_cpu_seconds", "CPU-seconds of one reset, by mode (warm, cold)", ["mode"],
    buckets=_CPU_BUCKETS, registry=REGISTRY,
)
EPISODE_CPU = Histogram(
    "osfarm_episode_cpu_seconds", "CPU-seconds a desktop used during one lease", buckets=_CPU_BUCKETS,
    registry=REGISTRY,
)
RESETS = Counter("osfarm_resets_total", "desktop resets, by mode (warm, cold)", ["mode"], registry=REGISTRY)
# A warm reset that could not prove a clean desktop (fingerprint differs from the cold start's,
# an error, its deadline, a dead box) and ended in a cold restart; reason: mismatch, error, timeout, every_n, dead.
WARM_FALLBACKS = Counter(
    "osfarm_warm_reset_fallbacks_total", "warm resets that fell back to a cold restart, by reason", ["reason"],
    registry=REGISTRY,
)
# Lease requests whose client hung up while they waited: their wait was cancelled (or the lease
# granted in that instant released) instead of holding a desktop for nobody until its TTL.
LEASES_ABANDONED = Counter(
    "osfarm_leases_abandoned_total", "lease requests whose client went away before the lease", registry=REGISTRY
)
