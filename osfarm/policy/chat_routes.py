"""``POST /v1/chat/completions``: an OpenAI chat completion, or with ``stream: true`` server-sent
events of ``chat.completion.chunk`` objects as vLLM sends them (``_stream``).

Generation runs on the server's one generation thread (requests queue for it; the event loop
never blocks). A request naming a loaded LoRA adapter is answered by its weights and carries no
policy version (as vLLM's); the base model's answers carry it (JSON ``policy_version`` and the
``X-Policy-Version`` header).

``router`` is included by :func:`osfarm.policy.server.create_app`; the route gets the engine, the
metrics, the latency model and the generation thread through :mod:`osfarm.policy.state`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from osfarm.policy.engine import Choice, Generation, PolicyEngine, Prepared, RequestError
from osfarm.policy.processing import MessageError
from osfarm.policy.replies import VERSION_HEADER, error_response
from osfarm.policy.sampling import SamplingParams
from osfarm.policy.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    ChunkChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    error_body,
)
from osfarm.policy.state import ServerState, State
from osfarm.policy.streaming import ChoiceDelta

DEFAULT_MAX_TOKENS = 256
log = logging.getLogger(__name__)
router = APIRouter()

# The streamed answer, in the OpenAPI document beside the JSON one.
STREAM_DOC: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": {
    "description": "with stream=true: `data: <ChatCompletionChunk JSON>` events, then `data: [DONE]`"}}}}}


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAM_DOC)
async def chat_completions(req: ChatCompletionRequest, server: State):
    engine, metrics = server.engine, server.metrics
    route = "/v1/chat/completions"
    # a LoRA adapter's name: its weights, and no version in the answer (as vLLM)
    adapter = None if req.model == engine.served_name else req.model
    if adapter is not None and adapter not in engine.adapters:
        metrics.requests.labels(route, "404").inc()
        served = ", ".join(f"`{n}`" for n in engine.served_names())
        return error_response(
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
        if server.latency is not None:
            delay = server.latency.sample_ms() / 1000.0
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
            prepared = await loop.run_in_executor(server.gen_pool, prepare_job)
            return _stream(server, req, prepared)
        result = await loop.run_in_executor(server.gen_pool, job)
    except MessageError as e:
        metrics.requests.labels(route, "400").inc()
        return error_response(400, str(e), e.field, version())
    except RequestError as e:
        metrics.requests.labels(route, str(e.status)).inc()
        return error_response(e.status, str(e), e.field, version())
    except Exception as e:  # one failed generation must not look like a crash to the agent
        log.exception("generation failed")
        metrics.requests.labels(route, "500").inc()
        return error_response(500, f"generation failed: {type(e).__name__}: {e}", None, version())
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
        finish_reason=c.finish_reason,
        logprobs=None if c.logprobs is None else _logprobs(engine, req, c.token_ids, c.logprobs, c.top_logprobs),
        token_ids=c.token_ids,
    )


# ---- streaming: server-sent events of chat.completion.chunk objects, as vLLM sends them ----------

_END = object()


def _sse(chunk: ChatCompletionChunk | dict) -> str:
    data = chunk.model_dump_json(exclude_unset=True) if isinstance(chunk, ChatCompletionChunk) else json.dumps(chunk)
    return f"data: {data}\n\n"


def _stream(server: ServerState, req: ChatCompletionRequest, prepared: Prepared) -> StreamingResponse:
    """The answer to a ``stream: true`` request (its prompt already encoded).

    The generation thread hands each step's deltas to the event loop; they go out as chunks as
    they come: first every choice's role, then one chunk per choice and token (its text delta,
    token id, log-probs; ``finish_reason`` on its last), a usage chunk with
    ``stream_options.include_usage``, ``data: [DONE]``. A failure after the first byte can only be
    told in the stream: an ``{"error": ...}`` event, then ``[DONE]`` (vLLM's way). A client that
    goes away cancels the generation at its next step.
    """
    engine, metrics = server.engine, server.metrics
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
                             finish_reason=d.finish_reason, token_ids=d.token_ids)
        return chunk([choice], completion)

    async def body() -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()

        def emit(deltas: list[ChoiceDelta]) -> None:  # on the generation thread
            loop.call_soon_threadsafe(queue.put_nowait, deltas)

        metrics.inflight.inc()
        future = loop.run_in_executor(server.gen_pool, engine.run, prepared, emit, cancel)

        # the end of the deltas; and the outcome of a generation nobody reads any more (client
        # gone) is still retrieved, so no "exception was never retrieved" noise
        def generation_done(f: asyncio.Future[Any]) -> None:
            queue.put_nowait(_END)
            if not f.cancelled():
                f.exception()

        future.add_done_callback(generation_done)
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
