"""Real servers for the VLM agent tests: the CPU policy server with the tiny model, and a fault
injecting HTTP proxy in front of it.

``policy_server()`` starts ``osfarm policy serve --model tiny`` on a free loopback port as a
subprocess and waits for ``/health``. ``FaultProxy`` is a small threaded HTTP server that answers
the first N requests with a fault (an HTTP status, or a connection closed without a reply) and
forwards the rest, byte for byte, to the real server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

import httpx

from osfarm.testing.ports import free_port


@contextmanager
def policy_server(start_timeout_s: float = 240.0, extra: tuple[str, ...] = (), model: str = "tiny") -> Iterator[str]:
    """``osfarm policy serve --model MODEL`` (the tiny model unless told) on 127.0.0.1; yields its base URL."""
    port = free_port()
    cmd = [sys.executable, "-c", "from osfarm.policy.cli import policy_app; policy_app(prog_name='osfarm policy')",
           "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
           "--log-level", "warning", *extra]
    log = open(os.environ.get("OSFARM_TEST_POLICY_LOG", os.devnull), "ab")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"policy server exited with {proc.returncode} "
                                   "(set OSFARM_TEST_POLICY_LOG to see why)")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"policy server not healthy after {start_timeout_s:g} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class FaultProxy:
    """Fails the first ``fail_first`` requests (and, with ``fail_after``, every request after that
    many) with ``fault`` ("503", "429", "400", ... or "drop": close the connection without
    answering); forwards the others to ``upstream``."""

    def __init__(self, upstream: str, fail_first: int = 0, fault: str = "503", retry_after: str | None = None,
                 fail_after: int | None = None):
        self.upstream = upstream.rstrip("/")
        self.fail_first = fail_first
        self.fail_after = fail_after
        self.fault = fault
        self.retry_after = retry_after
        self.requests = 0
        self.forwarded = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with proxy._lock:
                    proxy.requests += 1
                    n = proxy.requests
                    failing = n <= proxy.fail_first or (proxy.fail_after is not None and n > proxy.fail_after)
                if failing and proxy.fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if failing:
                    msg = b'{"error": {"message": "injected fault"}}'
                    self.send_response(int(proxy.fault))
                    if proxy.retry_after is not None:
                        self.send_header("Retry-After", proxy.retry_after)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                r = httpx.post(proxy.upstream + self.path, content=body, timeout=300,
                               headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
                with proxy._lock:
                    proxy.forwarded += 1
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)


def closed_port_url() -> str:
    """A loopback URL nobody listens on (connections are refused)."""
    return f"http://127.0.0.1:{free_port()}"
