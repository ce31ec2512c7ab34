"""Request and response models of the policy server (an OpenAI chat-completions subset).

Unknown request fields are accepted and ignored (OpenAI clients send many); the fields we use
are validated, and a bad one is answered 400 with its JSON path in the message.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str = Field(description="data:image/png;base64,... (or a local file path)")
    detail: str | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


_PART_MODELS: dict[str, type[TextPart] | type[ImagePart]] = {"text": TextPart, "image_url": ImagePart}


def _check_part(j: int, part: Any) -> dict:
    """One content part, with an error that names it (``[j].image_url.url: Field required``)."""
    if not isinstance(part, dict):
        raise ValueError(f"[{j}]: a content part must be an object")  # noqa: TRY004 (pydantic wants ValueError)
    kind = part.get("type")
    # a non-string type (a list: unhashable) is an unsupported type, not a TypeError
    model = _PART_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(f"[{j}].type: unsupported content part type {part.get('type')!r} (text, image_url)")
    try:
        return model.model_validate(part).model_dump(exclude_none=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"])
        raise ValueError(f"[{j}]{where}: {err['msg']}") from None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = Field(
        None, description="a string, or a list of {type: text, text} / {type: image_url, image_url: {url}} parts"
    )

    @field_validator("content")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, list):
            return [_check_part(j, p) for j, p in enumerate(v)]
        return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = Field(False, description="a last chunk (no choices) with the whole request's usage")
    continuous_usage_stats: bool = Field(False, description="vLLM extension: usage so far in every chunk")


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="vLLM extension; -1 or 0 = off")
    max_tokens: int | None = Field(None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, description="torch's seed range")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = Field(False, description="vLLM extension: also return prompt_token_ids")
    stop: str | list[str] | None = None
    stream: bool = Field(False, description="server-sent events of chat.completion.chunk objects, as vLLM sends them")
    stream_options: StreamOptions | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set with stream=true")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, str):
            return [v]
        if v is not None and len(v) > 8:
            raise ValueError("at most 8 stop strings")
        return v


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] = Field(description="osfarm/vLLM extension: the generated token ids, exactly")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    policy_version: int | None = Field(
        None,
        description="osfarm extension: the weights' version that generated this; absent when `model` is a LoRA "
        "adapter (as vLLM: adapters have no version, their name carries it)",
    )
    logprobs_mode: Literal["processed", "raw"] = Field(description="osfarm extension: see docs/policy.md")
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = Field(None, description="osfarm/vLLM extension: the token ids of this delta, exactly")


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed answer (``data: {...}``; the stream ends with
    ``data: [DONE]``). Serialised without the fields left unset, as vLLM does."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    policy_version: int | None = Field(None, description="osfarm extension, in every chunk (see the response's)")
    prompt_token_ids: list[int] | None = Field(None, description="vLLM extension: first chunk, with return_token_ids")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "osfarm"
    root: str = Field(description="the weights' source: the model dir, or a LoRA adapter's lora_path")
    parent: str | None = Field(None, description="a LoRA adapter's base model (its served name); null for the base")
    max_model_len: int
    policy_version: int | None = Field(None, description="the base model's version; null for a LoRA adapter")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ReloadRequest(BaseModel):
    path: str = Field(description="a HF model dir, a LoRA adapter dir or safetensors weights, on the server's disk")
    version: int = Field(ge=0)
    force: bool = Field(False, description="allow a version lower than the served one (rollback)")


class ReloadResponse(BaseModel):
    version: int
    previous_version: int
    load_s: float


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body (other vLLM fields are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, description="the name requests send as `model`")
    lora_path: str = Field(min_length=1, description="a PEFT LoRA adapter dir on the server's disk")
    load_inplace: bool = Field(False, description="replace an adapter of that name (else: 400 if it exists)")


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = Field(None, description="accepted for vLLM compatibility, ignored")


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    policy_version: int
    reloading: bool


def error_body(message: str, param: str | None, status: int, detail: Any = None) -> dict:
    """OpenAI-style error object (``param`` names the offending field)."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}.get(status, "ServerError")
    body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    if detail is not None:
        body["detail"] = detail
    return body
