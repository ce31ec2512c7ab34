"""What the policy server's routes share, and how a route gets it: ``ServerState`` plus FastAPI
dependencies.

``create_app`` puts one ``ServerState`` on ``app.state.policy``; routes ask for what they use with
the typed aliases below::

    @router.post("/v1/thing")
    async def thing(engine: Engine, metrics: Metrics, server: State) -> ...: ...

The token (``--api-key``) is not a dependency: the auth middleware checks it before any route.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from osfarm.policy.engine import PolicyEngine
from osfarm.policy.sampling import LatencyModel


class PolicyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("osfarm_policy_requests", "HTTP requests", ["route", "status"], registry=r)
        self.queue_s = Histogram(
            "osfarm_policy_queue_seconds", "wait for the generation thread", registry=r,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.generate_s = Histogram(
            "osfarm_policy_generate_seconds", "generation time per request", registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
        )
        self.delay_s = Histogram("osfarm_policy_artificial_delay_seconds", "added latency (--delay-ms)", registry=r)
        self.prompt_tokens = Counter("osfarm_policy_prompt_tokens", "prompt tokens", registry=r)
        self.completion_tokens = Counter("osfarm_policy_completion_tokens", "generated tokens", registry=r)
        self.inflight = Gauge("osfarm_policy_inflight_requests", "chat requests being served", registry=r)
        self.streams = Counter("osfarm_policy_streams", "streamed answers, by how they ended "
                               "(completed, error, disconnected)", ["result"], registry=r)
        self.version = Gauge("osfarm_policy_version", "served policy version", registry=r)
        self.reloads = Counter("osfarm_policy_reloads", "weight reloads", ["result"], registry=r)
        self.reload_s = Histogram("osfarm_policy_reload_seconds", "weight reload time", registry=r)
        self.lora_adapters = Gauge("osfarm_policy_lora_adapters", "LoRA adapters loaded", registry=r)
        self.lora_loads = Counter("osfarm_policy_lora_loads", "LoRA adapter loads", ["result"], registry=r)
        self.lora_load_s = Histogram("osfarm_policy_lora_load_seconds", "LoRA adapter load time", registry=r)


@dataclass
class ServerState:
    """The engine, its metrics, the added latency (``--delay-ms``) and the one generation thread
    (requests queue for it; the event loop never blocks)."""

    engine: PolicyEngine
    latency: LatencyModel | None = None
    metrics: PolicyMetrics = field(default_factory=PolicyMetrics)
    gen_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-generate"))

    def version_of(self, model: str | None) -> int | None:
        """The version an answer about ``model`` carries: none for a LoRA adapter (as vLLM)."""
        return None if model in self.engine.adapters else self.engine.current.version


# -- dependencies ---------------------------------------------------------------------------------


async def get_server_state(request: Request) -> ServerState:
    """The app's ServerState (set by ``create_app``)."""
    state: ServerState = request.app.state.policy
    return state


State = Annotated[ServerState, Depends(get_server_state)]


async def get_engine(state: State) -> PolicyEngine:
    """The model being served (its weights swap under it on a reload)."""
    return state.engine


Engine = Annotated[PolicyEngine, Depends(get_engine)]


async def get_metrics(state: State) -> PolicyMetrics:
    """The server's Prometheus metrics (``GET /metrics``)."""
    return state.metrics


Metrics = Annotated[PolicyMetrics, Depends(get_metrics)]
