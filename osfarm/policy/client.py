"""A running policy server as its users (trainer, benches, tests) see it: where it is, how its
weights are updated, and whether it answers.

``PolicyServer`` describes an OpenAI-compatible server (ours, vLLM, anything behind a reload
command); ``wait_healthy`` polls its ``GET /health``. Neither needs torch.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Literal

import httpx
from pydantic import BaseModel, Field

from osfarm.errors import InfraError


class PolicyServer(BaseModel):
    """One policy server: its URL and the way new weights reach it (``kind``, see
    osfarm/trainer/weight_sync.py)."""

    url: str = Field(description="base URL, e.g. http://127.0.0.1:8000 (no /v1)")
    kind: Literal["osfarm", "vllm_lora", "command"] = "osfarm"
    timeout_s: float = Field(default=300.0, gt=0, description="limit for one reload call")
    health_timeout_s: float = Field(default=60.0, gt=0, description="limit for the server to answer /health after it")
    lora_name: str = Field(default="policy", description="vllm_lora: the adapter name (versioned: its prefix)")
    lora_versioned: bool = Field(default=True, description="vllm_lora: one adapter per version, <lora_name>-v<N> "
                                 "(exact version of every step); false: reload lora_name in place")
    command: str | None = Field(default=None, description="command: template with {path} {version} {url}")
    api_key: str | None = Field(default_factory=lambda: os.environ.get("OSFARM_POLICY_TOKEN") or None,
                                description="bearer token of the server (default: $OSFARM_POLICY_TOKEN, as "
                                "`osfarm policy serve --token` and compose's vLLM read it)")

    def headers(self) -> dict[str, str]:
        """The request headers this server wants (its bearer token, if any)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class PolicyNotHealthy(InfraError, RuntimeError):
    """The server did not answer ``GET /health`` with 200 in time (the message says what it did)."""


async def wait_healthy(client: httpx.AsyncClient, server: PolicyServer, timeout_s: float) -> None:
    """Poll ``GET /health`` until it answers 200 (or raise PolicyNotHealthy after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            r = await client.get(f"{server.url}/health", headers=server.headers(), timeout=5.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise PolicyNotHealthy(f"{server.url} not healthy after {timeout_s:g} s ({last})")
        await asyncio.sleep(0.2)
