"""Request body size limits as a pure ASGI middleware (farm API, guest server).

A body over its limit answers ``413 {"detail": "... limit ..."}`` without being read into
memory: a ``Content-Length`` over the limit is refused before any byte is read, and a body sent
without one (chunked) is counted as it streams and cut off at the limit. A route that reads the
body (``await request.body()``, a multipart form, the guest passthrough's streamed copy) gets a
:class:`BodyTooLarge` from ``receive`` at that point; whatever the route answers then is replaced
by the 413.

Limits are chosen by path: the first :class:`BodyRule` whose regex matches, else the default.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from osfarm.http.auth import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    """Raised from ``receive`` once the body passes its limit."""


@dataclass(frozen=True)
class BodyRule:
    """Bodies of requests whose path matches ``pattern`` (``re.match``) may be ``max_bytes`` long;
    ``setting`` names where the operator changes it (shown in the 413)."""

    pattern: str
    max_bytes: int
    setting: str


def _describe(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, setting: str = "max_body_bytes",
                 rules: Sequence[BodyRule] = ()):
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.app = app
        self.default = BodyRule("", max_bytes, setting)
        self.rules = [(re.compile(r.pattern), r) for r in rules]

    def rule_for(self, path: str) -> BodyRule:
        for regex, rule in self.rules:
            if regex.match(path):
                return rule
        return self.default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rule = self.rule_for(scope.get("path", ""))
        limit = rule.max_bytes
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                if not v.strip().isdigit():
                    await _answer(send, 400, "Content-Length: not a number")
                    return
                if int(v) > limit:
                    await _answer(send, 413, _too_large(scope, rule, f"{int(v)} bytes"))
                    return
                break
        seen = 0
        over = False
        started = False

        async def counted() -> Message:
            nonlocal seen, over
            message = dict(await receive())
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    raise BodyTooLarge(_too_large(scope, rule, f"more than {limit} bytes"))
            return message

        async def guarded(message: Message) -> None:
            nonlocal started
            if over and not started:
                return  # the app's own answer to the cut-off body is replaced by the 413 below
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except BodyTooLarge:
            if started:
                raise  # the answer was already under way: the server aborts the connection
        if over and not started:
            await _answer(send, 413, _too_large(scope, rule, f"more than {limit} bytes"))


def _too_large(scope: Scope, rule: BodyRule, size: str) -> str:
    return (f"request body too large ({size}): the limit for {scope.get('method', '?')} {scope.get('path', '?')} "
            f"is {_describe(rule.max_bytes)} ({rule.setting})")


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


__all__ = ["BodyLimit", "BodyRule", "BodyTooLarge"]
