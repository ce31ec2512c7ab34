"""osfarm.http: the bearer-auth middleware (as the farm and the guest server configure it) on a
real ASGI app, and reading the message of an error reply."""

from __future__ import annotations

import base64

import httpx
import pytest
from fastapi import FastAPI

from osfarm.http.auth import BearerAuth
from osfarm.http.errors import error_detail

TOKEN = "s3cret-token"


def app(**auth: object) -> FastAPI:
    a = FastAPI()

    @a.get("/open")
    async def open_route() -> dict[str, str]:
        return {"ok": "open"}

    @a.get("/closed")
    async def closed_route() -> dict[str, str]:
        return {"ok": "closed"}

    a.add_middleware(BearerAuth, token=TOKEN, **auth)
    return a


async def get(a: FastAPI, path: str, authorization: str | None = None) -> httpx.Response:
    headers = {"Authorization": authorization} if authorization is not None else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://t") as c:
        return await c.get(path, headers=headers)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


async def test_guest_style_bearer_only() -> None:
    a = app()
    assert (await get(a, "/closed", f"Bearer {TOKEN}")).json() == {"ok": "closed"}
    for header, why in [(None, "missing bearer token"), ("Bearer nope", "invalid token"),
                        (basic("u", TOKEN), "unsupported auth scheme 'basic'"), ("Token x", "unsupported auth scheme")]:
        r = await get(a, "/closed", header)
        assert r.status_code == 401 and why in r.json()["detail"], (header, r.text)
        assert r.headers.get_list("www-authenticate") == ["Bearer"]
    assert (await get(a, "/no/such/route")).status_code == 401  # unknown paths too: nothing before the token
    assert "Basic" not in (await get(a, "/closed")).json()["detail"]


async def test_farm_style_basic_and_public_paths() -> None:
    a = app(public=("/open",), basic=True, realm="osfarm")
    assert (await get(a, "/open")).json() == {"ok": "open"}
    assert (await get(a, "/closed", basic("anyone", TOKEN))).status_code == 200
    r = await get(a, "/closed")
    assert r.status_code == 401 and "HTTP Basic" in r.json()["detail"]
    assert r.headers.get_list("www-authenticate") == ['Bearer realm="osfarm"', 'Basic realm="osfarm"']
    for header, why in [(basic("anyone", "wrong"), "invalid token"), ("Basic !!", "malformed Basic credentials"),
                        ("Basic " + base64.b64encode(b"no-colon").decode(), "expected user:token")]:
        r = await get(a, "/closed", header)
        assert r.status_code == 401 and why in r.json()["detail"], (header, r.text)


def test_an_empty_token_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        BearerAuth(FastAPI(), token="")


@pytest.mark.parametrize(("body", "expected"), [
    (b'{"detail": "pool_max: too small"}', "pool_max: too small"),
    (b'{"status": "error", "message": "no such file"}', "no such file"),  # OSWorld's guest
    (b'{"error": "boom", "detail": ""}', "boom"),
    (b'["not", "an", "object"]', '["not", "an", "object"]'),
    (b"plain text failure\n", "plain text failure"),
    (b"", "Bad Gateway"),
    ("x" * 1000, "x" * 500),
])
def test_error_detail(body: bytes | str, expected: str) -> None:
    assert error_detail(body, fallback="Bad Gateway") == expected
