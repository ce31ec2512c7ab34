"""What per-client tokens and request body limits cost per farm request (issue 13).

The farm's auth middleware used to compare one token; it now hashes the presented token and looks
the digest up among the clients' (osfarm/http/principals.py), and a body-limit middleware counts
the request body as it streams. Both run on every request, so this measures them alone, as ASGI
calls in-process (no network: loopback noise would hide microseconds), on a step-sized POST
(2 KB JSON body) to a route that reads its body and answers 200:

* bare app (no middleware);
* the old auth (one token, ``check_authorization``: constant-time compare of the raw token);
* the new auth with 1, 100 and 1000 tokens in the table;
* the new auth (100 tokens) + the body limit, as ``create_app`` stacks them.

Prints microseconds per request (median of rounds) and the added cost over the old auth; the
step itself (bench/step_latency.py) takes ~130 ms. Usage: python bench/api_overhead.py [N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from osfarm.http.auth import BearerAuth, check_authorization
from osfarm.http.body_limit import BodyLimit, BodyRule
from osfarm.http.principals import Principal, TokenTable

TOKEN = "x" * 43  # the length of osfarm's generated tokens
BODY = b'{"actions": [{"action_type": "CLICK", "parameters": {"x": 10, "y": 20}}], "pad": "' + b"p" * 1900 + b'"}'


async def bare(scope: dict, receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


class OldAuth:
    """The farm's middleware before issue 13: one token, compared as is."""

    def __init__(self, app: Any, token: str):
        self.app, self.token = app, token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if check_authorization(header, self.token, True) is None:
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def table(n: int) -> TokenTable:
    t = TokenTable()
    for i in range(n - 1):
        t.add_token(f"client-token-{i:06d}-" + "y" * 30, Principal(f"c{i}", "client"))
    t.add_token(TOKEN, Principal("admin", "admin"))  # the caller's token is the last one added
    return t


async def per_request_us(app: Any, n: int) -> float:
    scope = {"type": "http", "method": "POST", "path": "/v1/desktops/abc/step", "headers": [
        (b"authorization", f"Bearer {TOKEN}".encode()), (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode())]}
    status: list[int] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    t0 = time.perf_counter()
    for _ in range(n):
        await app(dict(scope, state={}), receive, send)
    elapsed = time.perf_counter() - t0
    assert set(status) == {200}, set(status)
    return elapsed / n * 1e6


def main(n: int = 20000) -> None:
    apps = {
        "bare app": bare,
        "old auth (1 token)": OldAuth(bare, TOKEN),
        "new auth, 1 token": BearerAuth(bare, tokens=table(1), basic=True),
        "new auth, 100 tokens": BearerAuth(bare, tokens=table(100), basic=True),
        "new auth, 1000 tokens": BearerAuth(bare, tokens=table(1000), basic=True),
        "new auth (100 tokens) + body limit": BearerAuth(
            BodyLimit(bare, 16 << 20, rules=[BodyRule(r"/v1/desktops/[^/]+/guest(/|$)", 1 << 30, "x")]),
            tokens=table(100), basic=True),
    }
    rounds = 5
    results = {name: statistics.median(asyncio.run(per_request_us(app, n)) for _ in range(rounds))
               for name, app in apps.items()}
    old = results["old auth (1 token)"]
    out = Table(title=f"farm middleware per request ({n} requests x {rounds} rounds, in-process ASGI)")
    for col in ("stack", "us / request", "added vs old auth"):
        out.add_column(col, justify="left" if col == "stack" else "right")
    for name, us in results.items():
        out.add_row(name, f"{us:.2f}", "-" if name == "bare app" else f"{us - old:+.2f} us")
    Console().print(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("requests", nargs="?", type=int, default=20000, help="requests per setting")
    main(ap.parse_args().requests)
