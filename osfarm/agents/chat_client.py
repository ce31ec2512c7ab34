"""Async client of an OpenAI-compatible ``/v1/chat/completions`` (vLLM, ``osfarm policy serve``).

Only the model call is retried, never anything that acts on a desktop: connection errors,
timeouts, 429 and 5xx get up to ``retries`` more tries with exponential backoff and jitter
(:func:`backoff_delay`; a ``Retry-After`` header is honoured up to the cap); any other 4xx is
the request's fault and fails at once. When the server stays unreachable the error says
``policy server unreachable: ...`` and is an :class:`~osfarm.errors.InfraError`, so the runner ends
the episode as an infra error instead of blaming the agent.

With ``logprobs=True`` the request asks for ``logprobs`` and ``return_tokens_as_token_ids``; the
token ids come from our server's ``token_ids`` extension on the choice, else from vLLM's
``"token_id:123"`` logprob tokens. The policy version is the top-level ``policy_version`` field
or the ``X-Policy-Version`` header.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any, Self

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from osfarm.errors import InfraError, OsfarmError
from osfarm.http.source_address import async_transport

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
TOKEN_ID_PREFIX = "token_id:"


class PolicyError(OsfarmError):
    """A model call failed. The harness's failures (not the agent's) are also :class:`InfraError`:
    :class:`PolicyUnavailable`, :class:`PolicyBadResponse`."""


class PolicyUnavailable(PolicyError, InfraError):
    """The server could not be reached, or kept failing, through every retry."""


class PolicyBadResponse(PolicyError, InfraError):
    """The server answered 200 with something that is not a chat completion."""


class PolicyRequestRejected(PolicyError):
    """A 4xx other than 429: the request itself is wrong (e.g. the prompt is too long)."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"policy server rejected the request: HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based): half of min(cap, base * 2^(attempt-1))
    fixed plus up to the other half at random ("equal jitter": never zero, never in lockstep)."""
    d = min(cap_s, base_s * (2 ** (attempt - 1)))
    return d / 2 + (rng or random).uniform(0, d / 2)


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (the HTTP-date form is ignored)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def token_ids_from_logprob_tokens(tokens: list[str]) -> list[int] | None:
    """vLLM's ``return_tokens_as_token_ids`` tokens ``"token_id:123"`` -> [123]; None if any is not."""
    ids = []
    for t in tokens:
        if not t.startswith(TOKEN_ID_PREFIX):
            return None
        try:
            ids.append(int(t[len(TOKEN_ID_PREFIX):]))
        except ValueError:
            return None
    return ids


class _TopLogprob(BaseModel):
    model_config = ConfigDict(extra="allow")
    logprob: float


class _TokenLogprob(BaseModel):
    model_config = ConfigDict(extra="allow")
    token: str
    logprob: float
    top_logprobs: list[_TopLogprob] = []


class _Logprobs(BaseModel):
    model_config = ConfigDict(extra="allow")
    content: list[_TokenLogprob] | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = "assistant"
    content: str | None = None


class _Choice(BaseModel):
    model_config = ConfigDict(extra="allow")
    index: int = 0
    message: _Message
    finish_reason: str | None = None
    logprobs: _Logprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    """The part of an OpenAI chat completion we read (unknown fields are kept, never rejected)."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    model: str | None = None
    choices: list[_Choice]
    usage: dict[str, Any] | None = None
    policy_version: int | None = None


@dataclass
class ChatResult:
    text: str
    token_ids: list[int] | None
    logprobs: list[float] | None
    policy_version: int | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    t_ms: float  # wall time of the whole call, retries included
    attempts: int
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    # per token, the log-probs of the k likeliest tokens (asked with ``top_logprobs=k``): the
    # policy's entropy at that token, which the sampled token's log-prob alone does not give
    top_logprobs: list[list[float]] | None = None


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _version(body: ChatCompletion, headers: httpx.Headers) -> int | None:
    if body.policy_version is not None:
        return body.policy_version
    h = headers.get("x-policy-version")
    try:
        return int(h) if h is not None else None
    except ValueError:
        return None


def read_completion(data: Any, headers: httpx.Headers) -> ChatResult:
    """Text, token ids, logprobs and policy version of the first choice; PolicyBadResponse if invalid."""
    try:
        body = ChatCompletion.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise PolicyBadResponse(f"policy server sent an invalid chat completion: {where}: {err['msg']}") from None
    if not body.choices:
        raise PolicyBadResponse("policy server sent a chat completion without choices")
    ch = body.choices[0]
    lp = ch.logprobs.content if ch.logprobs is not None and ch.logprobs.content is not None else None
    logprobs = [t.logprob for t in lp] if lp is not None else None
    tops = [[x.logprob for x in t.top_logprobs] for t in lp] if lp and all(t.top_logprobs for t in lp) else None
    ids = ch.token_ids if ch.token_ids is not None else (
        token_ids_from_logprob_tokens([t.token for t in lp]) if lp else None)
    return ChatResult(text=ch.message.content or "", token_ids=ids, logprobs=logprobs,
                      policy_version=_version(body, headers),
                      finish_reason=ch.finish_reason, usage=body.usage, t_ms=0.0, attempts=1,
                      raw=data if isinstance(data, dict) else {}, top_logprobs=tops)


class ChatClient:
    """One policy endpoint. Use inside one event loop; ``aclose()`` when done (or ``async with``)."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout_s: float = 120.0,
                 retries: int = 3, backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                 rng: random.Random | None = None) -> None:
        self.url = _base(base_url) + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
        self.retries = max(0, retries)
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.rng = rng or random.Random()
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:  # an AsyncClient belongs to one loop
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # from the process's source address when it has one (a worker bound to its host's address)
            self._http = httpx.AsyncClient(timeout=self.timeout, headers=headers, transport=async_transport())
            self._loop = loop
        return self._http

    async def aclose(self) -> None:
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.aclose()
        self._http = None
        self._loop = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def payload(self, messages: list[dict[str, Any]], *, temperature: float = 1.0, top_p: float = 1.0,
                max_tokens: int = 512, seed: int | None = None, logprobs: bool = False, top_logprobs: int = 0,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
        p: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": temperature, "top_p": top_p,
                             "max_tokens": max_tokens, "n": 1}
        if seed is not None:
            p["seed"] = seed
        if logprobs:
            p["logprobs"] = True
            p["return_tokens_as_token_ids"] = True
            if top_logprobs:
                p["top_logprobs"] = top_logprobs
        p.update(extra or {})
        return p

    async def complete(self, messages: list[dict[str, Any]], **kw: Any) -> ChatResult:
        """One chat completion; retries transient failures (see the module docstring)."""
        body = self.payload(messages, **kw)
        t0 = time.perf_counter()
        attempt = 0
        while True:
            attempt += 1
            wait: float | None = None
            try:
                r = await self._client().post(self.url, json=body)
            except httpx.TransportError as e:  # refused, reset, timed out, DNS ...
                reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                if r.status_code == 200:
                    try:
                        data = r.json()
                    except ValueError:
                        raise PolicyBadResponse(f"policy server sent a non-JSON reply: {r.text[:200]!r}") from None
                    res = read_completion(data, r.headers)
                    res.t_ms = round((time.perf_counter() - t0) * 1000, 1)
                    res.attempts = attempt
                    return res
                detail = r.text[:300]
                if r.status_code not in RETRY_STATUSES:
                    raise PolicyRequestRejected(r.status_code, detail)
                reason = f"HTTP {r.status_code}: {detail}"
                wait = retry_after_s(r.headers.get("retry-after"))
            if attempt > self.retries:
                raise PolicyUnavailable(f"policy server unreachable: POST {self.url}: {reason} "
                                        f"(after {attempt} attempt{'s' if attempt > 1 else ''})")
            delay = backoff_delay(attempt, self.backoff_s, self.backoff_max_s, self.rng)
            await asyncio.sleep(min(self.backoff_max_s, wait) if wait is not None else delay)
