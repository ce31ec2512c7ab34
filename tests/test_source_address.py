"""``osfarm worker --bind-address`` piece by piece, each against a real server that reports the
peer address it saw: the farm client and the policy client (httpx), the Redis client the worker's
episodes use, and Celery's broker channel and result backend (redis-py through kombu and Celery)
connect from the address given; without one the kernel picks 127.0.0.1, which is what makes each
check able to fail. tests/test_train_cluster.py runs it end to end on two worker "hosts"."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis
from typer.testing import CliRunner

from osfarm.agents.chat_client import ChatClient, PolicyRequestRejected
from osfarm.cli import app
from osfarm.client import AsyncFarm, Farm, UnknownDesktopError
from osfarm.http.source_address import ENV, SourceAddressError, check_source_address
from osfarm.runner.executors.celery_app import make_app
from osfarm.stream.redis_stream import connect
from osfarm.testing.redis_server import RedisServer


@pytest.mark.parametrize(("address", "why"), [
    ("192.0.2.1", "192.0.2.1: not an address of this machine"),  # TEST-NET-1: bound to no interface here
    ("0.0.0.0", "0.0.0.0 is the wildcard address"),
    ("farm-b", "'farm-b' is not an IP address"),
])
def test_an_address_that_is_not_this_machines_is_refused(address: str, why: str) -> None:
    with pytest.raises(SourceAddressError, match=f"^--bind-address: {why}"):
        check_source_address(address, "--bind-address")
    assert check_source_address("127.0.0.2", "--bind-address") == "127.0.0.2"


def test_osfarm_worker_refuses_a_bind_address_not_of_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    r = CliRunner().invoke(app, ["worker", "--farm", "http://127.0.0.1:1", "--token", "t", "--bind-address",
                                 "192.0.2.1"])
    assert r.exit_code == 2, r.output
    assert "--bind-address: 192.0.2.1: not an address of this machine" in " ".join(r.output.split()), r.output
    assert ENV not in os.environ  # refused before anything was set up


class _PeerServer(ThreadingHTTPServer):
    """Answers every request 404 and keeps the peer address each came from."""

    def __init__(self) -> None:
        self.peers: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                server.peers.append(self.client_address[0])
                self.rfile.read(int(self.headers.get("content-length") or 0))
                body = b'{"detail": "no such route"}'
                self.send_response(404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def peer_server() -> Iterator[_PeerServer]:
    server = _PeerServer()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_the_farm_and_policy_clients_connect_from_the_source_address(peer_server: _PeerServer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    url = peer_server.url

    async def farm_health(local_address: str | None = None) -> None:
        async with AsyncFarm(url, "t", retry_s=0, local_address=local_address) as farm:
            with pytest.raises(UnknownDesktopError):
                await farm.healthz()

    async def chat() -> None:
        async with ChatClient(url + "/v1", "m", retries=0) as client:
            with pytest.raises(PolicyRequestRejected):
                await client.complete([{"role": "user", "content": "hi"}])

    monkeypatch.delenv(ENV, raising=False)
    asyncio.run(farm_health())  # the kernel's choice
    asyncio.run(farm_health("127.0.0.2"))  # the client's own option
    monkeypatch.setenv(ENV, "127.0.0.3")  # the process's source address, as `osfarm worker` sets it
    asyncio.run(farm_health())
    asyncio.run(chat())
    with Farm(url, "t", retry_s=0) as farm, pytest.raises(UnknownDesktopError):
        farm.healthz()
    assert peer_server.peers == ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.3", "127.0.0.3"]


def test_redis_and_celery_connections_leave_from_the_source_address() -> None:
    # a password: without one, Redis's protected mode refuses any loopback client but 127.0.0.1
    with RedisServer(password=secrets.token_hex(8)) as server:
        observer = redis.Redis.from_url(server.url, decode_responses=True)
        me = observer.client_id()

        def peers() -> list[str]:
            return sorted(c["addr"].rsplit(":", 1)[0] for c in observer.client_list() if int(c["id"]) != me)

        episodes = connect(server.url, source_address="127.0.0.2")  # the worker's stream and claim client
        assert episodes.ping()
        assert peers() == ["127.0.0.2"]
        app = make_app(server.url, source_address="127.0.0.3")
        try:
            assert app.backend.client.ping()  # results and started states
            assert peers() == ["127.0.0.2", "127.0.0.3"]
            with app.connection_for_write() as conn:  # the broker: kombu's channel
                assert conn.default_channel.client.ping()
                assert peers() == ["127.0.0.2", "127.0.0.3", "127.0.0.3"]
        finally:
            app.close()
        episodes.close()
        unbound = make_app(server.url)  # the trainer's side: no address, the kernel's choice
        try:
            assert unbound.backend.client.ping()
            assert "127.0.0.1" in peers()
        finally:
            unbound.close()
