"""The policy server: FastAPI app over a PolicyEngine.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/weights/reload``,
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's runtime LoRA API, with
``--enable-lora``), ``GET /health``, ``GET /metrics`` (Prometheus), OpenAPI at ``/docs``.
``stream: true`` answers with server-sent events of ``chat.completion.chunk`` objects as vLLM
sends them (``_stream``). Generation runs on one dedicated thread (requests queue for it; the
event loop never blocks); a reload or an adapter load runs in another thread and swaps the
weights between requests. Every
response carries the policy version (JSON ``policy_version`` and the ``X-Policy-Version``
header), except those of LoRA adapters and of the adapter routes: as from vLLM, none there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from osfarm.http.auth import BearerAuth
from osfarm.http.openapi import allowed_methods, document_responses
from osfarm.policy.engine import Choice, Generation, PolicyEngine, Prepared, RequestError
from osfarm.policy.processing import MessageError
from osfarm.policy.sampling import LatencyModel, SamplingParams
from osfarm.policy.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    ChunkChoice,
    DeltaMessage,
    Health,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ReloadRequest,
    ReloadResponse,
    TokenLogprob,
    TopLogprob,
    UnloadLoRAAdapterRequest,
    Usage,
    error_body,
)
from osfarm.policy.streaming import ChoiceDelta

DEFAULT_MAX_TOKENS = 256
VERSION_HEADER = "X-Policy-Version"
LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
log = logging.getLogger(__name__)


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


def _error(status: int, message: str, param: str | None, version: int | None = None, detail=None) -> JSONResponse:
    headers = {VERSION_HEADER: str(version)} if version is not None else None
    return JSONResponse(error_body(message, param, status, detail), status_code=status, headers=headers)


def _loc(loc: tuple) -> str:
    """pydantic's error location -> a JSON path (``messages[0].content``), without the 'body' prefix
    and without the names pydantic gives union members (``str``, ``list[...]``)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _UNION_TAGS:
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def create_app(engine: PolicyEngine, latency: LatencyModel | None = None, token: str | None = None) -> FastAPI:
    """The server's app; with ``token`` every route but ``/health`` needs ``Authorization: Bearer
    <token>`` (vLLM's ``--api-key`` semantics, so the same clients work against both)."""
    gen_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-generate")

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        gen_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        lifespan=lifespan,
        title="osfarm policy server",
        description="OpenAI-compatible chat completions (a subset) on a transformers VLM, with policy versions.",
        version="1",
    )
    if token:
        app.add_middleware(BearerAuth, token=token, public=("/health",))
    metrics = PolicyMetrics()
    metrics.version.set(engine.current.version)
    app.state.engine = engine
    app.state.metrics = metrics

    def version_of(model: str | None) -> int | None:
        """The version an answer about ``model`` carries: none for a LoRA adapter (as vLLM)."""
        return None if model in engine.adapters else engine.current.version

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        parts = []
        for e in errors[:5]:
            parts.append(f"{_loc(tuple(e.get('loc', ())))}: {e.get('msg')}")
        param = _loc(tuple(errors[0].get("loc", ()))) if errors else None
        metrics.requests.labels(request.url.path, "400").inc()
        detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors]
        body = exc.body if isinstance(exc.body, dict) else {}
        model = body.get("model") if isinstance(body.get("model"), str) else None
        version = None if request.url.path in LORA_ROUTES else version_of(model)
        return _error(400, "; ".join(parts), param, version, detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # the OpenAI error shape for what Starlette refuses itself (an undecodable body, a method
        # or path the server does not have); a 405 names every method of the path
        response = _error(exc.status_code, str(exc.detail), None)
        if exc.status_code == 405:
            response.headers["Allow"] = ", ".join(allowed_methods(request.app, request.url.path))
        return response

    @app.get("/health", response_model=Health)
    async def health(response: Response) -> Health:
        response.headers[VERSION_HEADER] = str(engine.current.version)
        return Health(model=engine.served_name, policy_version=engine.current.version, reloading=engine.reloading)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models(response: Response) -> ModelList:
        policy = engine.current
        response.headers[VERSION_HEADER] = str(policy.version)
        card = ModelCard(
            id=engine.served_name,
            created=int(policy.loaded_at),
            root=policy.source,
            max_model_len=engine.max_model_len,
            policy_version=policy.version,
        )
        adapters = [
            ModelCard(
                id=a.name, created=int(a.loaded_at), root=a.path, parent=engine.served_name,
                max_model_len=engine.max_model_len,
            )
            for a in engine.adapters.values()
        ]
        return ModelList(data=[card, *adapters])

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAM_DOC)
    async def chat_completions(req: ChatCompletionRequest):
        route = "/v1/chat/completions"
        # a LoRA adapter's name: its weights, and no version in the answer (as vLLM)
        adapter = None if req.model == engine.served_name else req.model
        if adapter is not None and adapter not in engine.adapters:
            metrics.requests.labels(route, "404").inc()
            served = ", ".join(f"`{n}`" for n in engine.served_names())
            return _error(
                404, f"model: the model `{req.model}` does not exist; this server serves {served}",
                "model", engine.current.version,
            )

        def version() -> int | None:
            return None if adapter is not None else engine.current.version

        params = SamplingParams(
            max_tokens=req.max_tokens or req.max_completion_tokens or DEFAULT_MAX_TOKENS,
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),
            seed=req.seed,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs or 0,
            stop=tuple(req.stop or ()),
        )
        messages = [m.model_dump() for m in req.messages]
        loop = asyncio.get_running_loop()
        metrics.inflight.inc()
        try:
            if latency is not None:
                delay = latency.sample_ms() / 1000.0
                metrics.delay_s.observe(delay)
                await asyncio.sleep(delay)  # outside the generation thread: delays overlap like a batched GPU server
            queued = time.perf_counter()

            def job() -> Generation:
                metrics.queue_s.observe(time.perf_counter() - queued)
                return engine.generate(messages, params, adapter)

            def prepare_job() -> Prepared:
                metrics.queue_s.observe(time.perf_counter() - queued)
                return engine.prepare(messages, params, adapter)

            if req.stream:  # a bad request is still a JSON error: the prompt is encoded before the stream starts
                prepared = await loop.run_in_executor(gen_pool, prepare_job)
                return _stream(engine, metrics, gen_pool, req, prepared)
            result = await loop.run_in_executor(gen_pool, job)
        except MessageError as e:
            metrics.requests.labels(route, "400").inc()
            return _error(400, str(e), e.field, version())
        except RequestError as e:
            metrics.requests.labels(route, str(e.status)).inc()
            return _error(e.status, str(e), e.field, version())
        except Exception as e:  # one failed generation must not look like a crash to the agent
            log.exception("generation failed")
            metrics.requests.labels(route, "500").inc()
            return _error(500, f"generation failed: {type(e).__name__}: {e}", None, version())
        finally:
            metrics.inflight.dec()
        metrics.generate_s.observe(result.t_generate_s)
        metrics.prompt_tokens.inc(len(result.prompt_token_ids))
        completion_tokens = sum(len(c.token_ids) for c in result.choices)
        metrics.completion_tokens.inc(completion_tokens)
        metrics.requests.labels(route, "200").inc()
        body = ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=req.model,
            choices=[_choice(engine, c, req) for c in result.choices],
            usage=_usage(len(result.prompt_token_ids), completion_tokens),
            policy_version=result.policy_version,
            logprobs_mode=engine.logprobs_mode,
            prompt_token_ids=result.prompt_token_ids if req.return_token_ids else None,
        )
        headers = {VERSION_HEADER: str(result.policy_version)} if result.policy_version is not None else None
        return JSONResponse(body.model_dump(exclude_none=True), headers=headers)

    @app.post("/v1/weights/reload", response_model=ReloadResponse)
    async def reload(req: ReloadRequest):
        route = "/v1/weights/reload"
        previous = engine.current.version
        t0 = time.perf_counter()
        try:
            new = await asyncio.to_thread(engine.reload, Path(req.path), req.version, req.force)
        except RequestError as e:
            metrics.reloads.labels("refused").inc()
            metrics.requests.labels(route, str(e.status)).inc()
            return _error(e.status, str(e), e.field, engine.current.version)
        except Exception as e:  # noqa: BLE001 -- a broken checkpoint must not take the server down: old weights stay
            metrics.reloads.labels("failed").inc()
            metrics.requests.labels(route, "400").inc()
            return _error(400, f"path: could not load {req.path}: {type(e).__name__}: {e}", "path",
                          engine.current.version)
        load_s = time.perf_counter() - t0
        metrics.reloads.labels("ok").inc()
        metrics.reload_s.observe(load_s)
        metrics.version.set(new.version)
        metrics.requests.labels(route, "200").inc()
        return JSONResponse(
            ReloadResponse(version=new.version, previous_version=previous, load_s=round(load_s, 3)).model_dump(),
            headers={VERSION_HEADER: str(new.version)},
        )

    # ---- vLLM's runtime LoRA adapter API: plain-text success, no policy version -----------------

    def lora_disabled(route: str) -> JSONResponse:
        metrics.requests.labels(route, "404").inc()
        return _error(404, "LoRA adapters are disabled on this server: start it with --enable-lora", None)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        """Load a PEFT LoRA adapter on top of the base model, served as model ``lora_name``."""
        route = "/v1/load_lora_adapter"
        if not engine.enable_lora:
            return lora_disabled(route)
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(engine.load_adapter, req.lora_name, Path(req.lora_path), req.load_inplace)
        except RequestError as e:
            metrics.lora_loads.labels("refused").inc()
            metrics.requests.labels(route, str(e.status)).inc()
            return _error(e.status, str(e), e.field)
        except Exception as e:  # noqa: BLE001 -- an adapter that does not fit must not take the server down
            log.warning("LoRA adapter %r from %s failed to load: %s: %s", req.lora_name, req.lora_path,
                        type(e).__name__, e)
            metrics.lora_loads.labels("failed").inc()
            metrics.requests.labels(route, "400").inc()
            message = f"lora_path: could not load the LoRA adapter {req.lora_path}: {type(e).__name__}: {e}"
            return _error(400, message, "lora_path")
        metrics.lora_loads.labels("ok").inc()
        metrics.lora_load_s.observe(time.perf_counter() - t0)
        metrics.lora_adapters.set(len(engine.adapters))
        metrics.requests.labels(route, "200").inc()
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        """Stop serving a LoRA adapter (requests already running on it finish)."""
        route = "/v1/unload_lora_adapter"
        if not engine.enable_lora:
            return lora_disabled(route)
        try:
            await asyncio.to_thread(engine.unload_adapter, req.lora_name)  # waits for a load in progress
        except RequestError as e:
            metrics.requests.labels(route, str(e.status)).inc()
            return _error(e.status, str(e), e.field)
        metrics.lora_adapters.set(len(engine.adapters))
        metrics.requests.labels(route, "200").inc()
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    document_responses(app, _documented_errors, ERROR_DOC)
    return app


# What the routes answer besides their success, in the OpenAPI document (tests/test_contract.py
# holds the server to it): the OpenAI-style error body of _error.
ERROR_DOC = {"title": "ErrorBody", "type": "object", "required": ["error"], "properties": {
    "error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": "integer"}}},
    "detail": {"description": "pydantic's errors of an invalid request"}}}


def _documented_errors(path: str, method: str, op: dict[str, Any]) -> dict[int, str]:
    out: dict[int, str] = {}
    if path != "/health":
        out[401] = "missing or wrong token (when the server has one: --api-key)"
    if method == "post":
        out[400] = ("invalid request; error.param names the field (also: the prompt and max_tokens exceed the "
                    "model's context, a weights path that is not a model)")
        out[404] = "no such model or adapter, or LoRA adapters are disabled (--enable-lora)"
        out[409] = "the request conflicts with the server's state (a reload or adapter change in progress)"
    if path == "/v1/chat/completions":
        out[500] = "generation failed (the error says why); the server stays up"
    return out


def _usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _logprobs(engine: PolicyEngine, req: ChatCompletionRequest, ids: list[int], lps: list[float],
              tops: list[list[tuple[int, float]]] | None) -> ChoiceLogprobs:
    """OpenAI's ``logprobs.content``: one entry per token (text or ``token_id:N``, log-prob, UTF-8
    bytes of its text, the top alternatives)."""

    def name(token_id: int) -> str:
        return f"token_id:{token_id}" if req.return_tokens_as_token_ids else engine.token_text(token_id)

    def entry(token_id: int, lp: float) -> dict:
        return {"token": name(token_id), "logprob": lp, "bytes": list(engine.token_text(token_id).encode("utf-8"))}

    content = []
    for t, (tok, lp) in enumerate(zip(ids, lps, strict=True)):
        alternatives = [TopLogprob(**entry(i, v)) for i, v in (tops[t] if tops else [])]
        content.append(TokenLogprob(**entry(tok, lp), top_logprobs=alternatives))
    return ChoiceLogprobs(content=content)


def _choice(engine: PolicyEngine, c: Choice, req: ChatCompletionRequest) -> ChatChoice:
    return ChatChoice(
        index=c.index,
        message=AssistantMessage(content=c.text),
        finish_reason=c.finish_reason,  # type: ignore[arg-type]
        logprobs=None if c.logprobs is None else _logprobs(engine, req, c.token_ids, c.logprobs, c.top_logprobs),
        token_ids=c.token_ids,
    )


# ---- streaming: server-sent events of chat.completion.chunk objects, as vLLM sends them ----------

STREAM_DOC: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": {
    "description": "with stream=true: `data: <ChatCompletionChunk JSON>` events, then `data: [DONE]`"}}}}}
_END = object()


def _sse(chunk: ChatCompletionChunk | dict) -> str:
    data = chunk.model_dump_json(exclude_unset=True) if isinstance(chunk, ChatCompletionChunk) else json.dumps(chunk)
    return f"data: {data}\n\n"


def _stream(engine: PolicyEngine, metrics: PolicyMetrics, gen_pool: ThreadPoolExecutor, req: ChatCompletionRequest,
            prepared: Prepared) -> StreamingResponse:
    """The answer to a ``stream: true`` request (its prompt already encoded).

    The generation thread hands each step's deltas to the event loop; they go out as chunks as
    they come: first every choice's role, then one chunk per choice and token (its text delta,
    token id, log-probs; ``finish_reason`` on its last), a usage chunk with
    ``stream_options.include_usage``, ``data: [DONE]``. A failure after the first byte can only be
    told in the stream: an ``{"error": ...}`` event, then ``[DONE]`` (vLLM's way). A client that
    goes away cancels the generation at its next step.
    """
    route = "/v1/chat/completions"
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats and opts.include_usage)
    prompt_tokens = len(prepared.prompt_token_ids)
    version = prepared.policy_version
    # set explicitly: chunks are serialised without unset fields (as vLLM's), defaults included
    base: dict[str, Any] = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                            "created": int(time.time()), "model": req.model}
    if version is not None:
        base["policy_version"] = version

    def chunk(choices: list[ChunkChoice], completion: int, **extra: Any) -> ChatCompletionChunk:
        c = ChatCompletionChunk(**base, choices=choices, **extra)
        if continuous:
            c.usage = _usage(prompt_tokens, completion)
        return c

    def delta_chunk(d: ChoiceDelta, completion: int) -> ChatCompletionChunk:
        lps = None if d.logprobs is None else _logprobs(engine, req, d.token_ids, d.logprobs, d.top_logprobs)
        choice = ChunkChoice(index=d.index, delta=DeltaMessage(content=d.text), logprobs=lps,
                             finish_reason=d.finish_reason, token_ids=d.token_ids)  # type: ignore[arg-type]
        return chunk([choice], completion)

    async def body() -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()

        def emit(deltas: list[ChoiceDelta]) -> None:  # on the generation thread
            loop.call_soon_threadsafe(queue.put_nowait, deltas)

        metrics.inflight.inc()
        future = loop.run_in_executor(gen_pool, engine.run, prepared, emit, cancel)
        # the end of the deltas; and the outcome of a generation nobody reads any more (client
        # gone) is still retrieved, so no "exception was never retrieved" noise
        future.add_done_callback(lambda f: (queue.put_nowait(_END), None if f.cancelled() else f.exception()))
        outcome = "disconnected"
        completion = 0
        t0 = time.perf_counter()
        try:
            for i in range(req.n):
                first = ChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
                                    finish_reason=None)
                extra = {"prompt_token_ids": prepared.prompt_token_ids} if req.return_token_ids else {}
                yield _sse(chunk([first], 0, **extra))
            while (item := await queue.get()) is not _END:
                for d in item:
                    completion += len(d.token_ids)
                    yield _sse(delta_chunk(d, completion))
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001 -- the status line went out with the first chunk
                log.exception("generation failed while streaming")
                outcome = "error"
                metrics.requests.labels(route, "500").inc()
                yield _sse(error_body(f"generation failed: {type(e).__name__}: {e}", None, 500))
            else:
                outcome = "completed"
                metrics.requests.labels(route, "200").inc()
                metrics.generate_s.observe(result.t_generate_s)
                completion = sum(len(c.token_ids) for c in result.choices)
                if include_usage:
                    yield _sse(ChatCompletionChunk(**base, choices=[], usage=_usage(prompt_tokens, completion)))
            yield "data: [DONE]\n\n"
        finally:
            if outcome == "disconnected":  # (or a failure of this generator itself)
                cancel.set()  # the generation thread stops after its current step
                log.info("stream ended by the client after %d tokens (%.1f s): generation cancelled",
                         completion, time.perf_counter() - t0)
            metrics.streams.labels(outcome).inc()
            metrics.prompt_tokens.inc(prompt_tokens)
            metrics.completion_tokens.inc(completion)
            metrics.inflight.dec()

    headers = {VERSION_HEADER: str(version)} if version is not None else None
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
