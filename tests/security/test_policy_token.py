"""The policy server with a token (issue 13): `osfarm policy serve --token` (or OSFARM_POLICY_TOKEN)
answers only callers that send it, as vLLM's --api-key does, and osfarm's own clients (the
trainer's PolicyServer, the VLM agent's chat client) send $OSFARM_POLICY_TOKEN by default."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from osfarm.agents.chat_client import ChatClient
from osfarm.agents.vlm import parse_options
from osfarm.policy.client import PolicyServer, wait_healthy
from osfarm.policy.tiny import tiny_model_dir

TOKEN = "policy-token-0123456789"
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-c", "from osfarm.cli import app; app(prog_name='osfarm')", "policy", "serve",
           "--model", str(tiny_model_dir()), "--served-model-name", "tiny", "--port", str(port), "--threads", "1",
           "--log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OSFARM_POLICY_TOKEN": TOKEN}  # the --token's variable
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, "policy server exited"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:  # public, as vLLM's
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "policy server not healthy in 240 s"
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_routes_need_the_token(url: str) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/weights/reload"),
                         ("GET", "/metrics"), ("GET", "/docs")):
        r = httpx.request(method, url + path, json={}, timeout=30)
        assert r.status_code == 401 and "bearer token" in r.json()["detail"], (path, r.text)
        r = httpx.request(method, url + path, json={}, headers={"Authorization": "Bearer wrong"}, timeout=30)
        assert r.status_code == 401 and r.json()["detail"] == "invalid token", (path, r.text)
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny", r.text


def test_osfarm_clients_send_the_token_from_the_environment(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OSFARM_POLICY_TOKEN", TOKEN)
    server = PolicyServer(url=url)
    assert server.headers() == {"Authorization": f"Bearer {TOKEN}"}
    opts = parse_options({"base_url": url, "model": "tiny"})
    assert opts.api_key == TOKEN

    async def go() -> None:
        async with httpx.AsyncClient() as c:
            await wait_healthy(c, server, timeout_s=30)
            r = await c.get(f"{url}/v1/models", headers=server.headers())
            assert r.status_code == 200, r.text
        chat = ChatClient(url, "tiny", api_key=opts.api_key, timeout_s=60, retries=0)
        try:
            reply = await chat.complete([{"role": "user", "content": "hi"}], max_tokens=2, temperature=1.0)
        finally:
            await chat.aclose()
        assert reply is not None

    asyncio.run(go())
