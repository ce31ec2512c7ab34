"""``vlm``: an agent that asks a vision-language model served over an OpenAI-compatible API.

Each step builds the chat (prompt format head + the last ``history_turns`` turns, screenshots on
the last ``history_images`` of them), calls the model (:mod:`chat_client`: retries on the model
call only, logprobs and token ids when ``capture_logprobs``), and parses the reply with the
prompt format. ``last_model_call`` holds what the runner records for the step:
``{"model", "request", "response_text", "response_token_ids", "response_logprobs",
"policy_version", "t_ms", "error", "parse_error", "finish_reason", "usage"}`` (``request`` is the
messages sent, images as data URLs; the runner stores it as a blob).

A reply that does not parse yields no action (``parse_error`` says why; the episode goes on, as
in OSWorld). A policy server that stays unreachable raises :class:`PolicyUnavailable`
(an :class:`~osfarm.errors.InfraError`): the runner ends the episode as an infra error.

``apredict`` is the native form (the runner awaits it, no thread); ``predict`` wraps it for
callers without an event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from osfarm.agents.base import ActionSpace, BaseAgent
from osfarm.agents.chat_client import ChatClient, PolicyError
from osfarm.agents.prompts import ObservationKind, ParseError, StepContext, make_format
from osfarm.agents.prompts.a11y import linearize
from osfarm.agents.prompts.geometry import (
    MAX_PIXELS,
    MIN_PIXELS,
    GeometryError,
    png_size,
)
from osfarm.agents.prompts.messages import Turn, build_messages
from osfarm.schema.actions import AgentAction
from osfarm.schema.episode import ModelCall

DEFAULT_SCREEN = (1920, 1080)  # OSWorld's screen, for a11y-only observations without a screenshot


class VLMOptions(BaseModel):
    """Options of ``make_agent("vlm", ...)`` (and ``--agent-opt key=value``)."""

    model_config = ConfigDict(extra="forbid")
    base_url: str = Field(min_length=1, description="policy server root or its /v1 URL")
    model: str = Field(min_length=1, description="model name sent in each request")
    prompt_format: Literal["pyautogui", "computer_13", "uitars"] | None = None  # default: follows action_space
    action_space: Literal["pyautogui", "computer_13"] | None = None
    observation: Literal["screenshot", "a11y", "screenshot_a11y"] = "screenshot"
    history_turns: int = Field(3, ge=0, description="earlier turns kept in the prompt")
    history_images: int = Field(2, ge=1, description="screenshots in the prompt, the current one included")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(512, ge=1)
    seed: int | None = None
    timeout_s: float = Field(120.0, gt=0)
    retries: int = Field(3, ge=0, description="extra tries of a failed model call")
    backoff_s: float = Field(1.0, ge=0)
    backoff_max_s: float = Field(30.0, ge=0)
    capture_logprobs: bool = True
    top_logprobs: int = Field(0, ge=0, le=20, description="with capture_logprobs: also record each token's k "
                              "likeliest log-probs (the trainer's entropy selection ranks steps by their top-k "
                              "entropy; 0: the sampled token's only)")
    api_key: str | None = Field(default_factory=lambda: os.environ.get("OSFARM_POLICY_TOKEN") or None,
                                description="bearer token of the policy server (default: $OSFARM_POLICY_TOKEN)")
    a11y_max_chars: int = Field(20_000, ge=100)
    # uitars only: the model's coordinate space and its processor's resize budget
    coordinates: Literal["absolute", "relative"] = "absolute"
    min_pixels: int = Field(MIN_PIXELS, ge=1)
    max_pixels: int = Field(MAX_PIXELS, ge=1)
    language: str = "English"


def parse_options(kw: dict[str, Any]) -> VLMOptions:
    """Validate options; a bad one raises ValueError naming it (never a pydantic traceback)."""
    try:
        return VLMOptions.model_validate(kw)
    except ValidationError as e:
        err = e.errors()[0]
        name = ".".join(str(p) for p in err["loc"]) or "(options)"
        if err["type"] == "extra_forbidden":
            known = ", ".join(VLMOptions.model_fields)
            raise ValueError(f"vlm agent: unknown option {name!r}; known options: {known}") from None
        if err["type"] == "missing":
            flag = {"base_url": "--model-url", "model": "--model"}.get(name, f"--agent-opt {name}=...")
            raise ValueError(f"vlm agent: option {name!r} is required ({flag})") from None
        raise ValueError(f"vlm agent: option {name!r}: {err['msg']} (got {err.get('input')!r})") from None


def parse_agent_opts(pairs: list[str]) -> dict[str, Any]:
    """``["k=v", ...]`` from the command line -> {k: v}; values are read as JSON when they are
    JSON (numbers, true/false, null), else kept as strings."""
    out: dict[str, Any] = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--agent-opt {p!r}: expected key=value")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


class VLMAgent(BaseAgent):
    name = "vlm"

    def __init__(self, **options: Any) -> None:
        o = parse_options(options)
        fmt_name = o.prompt_format or o.action_space or "pyautogui"
        space: ActionSpace
        if o.prompt_format == "uitars":
            space = o.action_space or "pyautogui"
            self.format = make_format("uitars", coordinates=o.coordinates, min_pixels=o.min_pixels,
                                      max_pixels=o.max_pixels, language=o.language)
        else:
            space = o.prompt_format or o.action_space or "pyautogui"  # the format writes its own space
            self.format = make_format(space)
            if o.action_space is not None and o.action_space != space:
                raise ValueError(f"vlm agent: prompt format {fmt_name!r} writes {space} actions, not "
                                 f"{o.action_space}; use --action-space {space}")
        if o.observation not in self.format.observations:
            raise ValueError(f"vlm agent: prompt format {fmt_name!r} shows only "
                             f"{', '.join(self.format.observations)}, not observation {o.observation!r}")
        self.options = o
        self.action_space: ActionSpace = space
        self.observation: ObservationKind = o.observation
        self.wants_a11y = "a11y" in o.observation
        self.wants_screenshot = "screenshot" in o.observation
        self.client = ChatClient(o.base_url, o.model, api_key=o.api_key, timeout_s=o.timeout_s, retries=o.retries,
                                 backoff_s=o.backoff_s, backoff_max_s=o.backoff_max_s)
        self.turns: list[Turn] = []
        self.taken = 0  # model calls this episode: step i samples with seed + i
        self.last_model_call: ModelCall | None = None

    def reset(self, task: Any = None) -> None:
        self.turns = []
        self.taken = 0
        self.last_model_call = None

    def _screen(self, png: bytes | None) -> tuple[int, int]:
        if not png:
            if self.wants_screenshot:
                raise ValueError("the observation has no screenshot")
            return DEFAULT_SCREEN
        try:
            return png_size(png)
        except GeometryError as e:
            raise ValueError(str(e)) from None

    async def apredict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        o = self.options
        png = obs.get("screenshot") or None
        ctx = StepContext(screen=self._screen(png), action_space=self.action_space)
        table = linearize(obs.get("accessibility_tree"), o.a11y_max_chars) if self.wants_a11y else None
        current = Turn(screenshot=png if self.wants_screenshot else None,
                       text=self.format.turn_text(table, self.observation))
        messages = build_messages(self.format.head(instruction, self.observation, ctx), self.turns, current,
                                  o.history_turns, o.history_images)
        call = ModelCall(model=o.model, request=messages)
        self.last_model_call = call
        try:
            res = await self.client.complete(messages, temperature=o.temperature, top_p=o.top_p,
                                             max_tokens=o.max_tokens, logprobs=o.capture_logprobs,
                                             # one seed for every step would draw the same random numbers at each
                                             seed=None if o.seed is None else o.seed + self.taken,
                                             top_logprobs=o.top_logprobs if o.capture_logprobs else 0)
        except PolicyError as e:
            call.error = str(e)
            raise
        call.response_text, call.response_token_ids, call.response_logprobs = res.text, res.token_ids, res.logprobs
        if res.logprobs is not None and res.top_logprobs is not None:  # the record's {logprob, top_logprobs} shape
            call.response_logprobs = [{"logprob": lp, "top_logprobs": [{"logprob": x} for x in top]}
                                      for lp, top in zip(res.logprobs, res.top_logprobs, strict=True)]
        call.policy_version, call.t_ms, call.finish_reason, call.usage = (res.policy_version, res.t_ms,
                                                                          res.finish_reason, res.usage)
        current.response = res.text
        self.taken += 1
        self.turns.append(current)
        del self.turns[:-max(1, o.history_turns)]  # only the window is ever sent again
        try:
            parsed = self.format.parse(res.text, ctx)
        except ParseError as e:
            cut = f" (the reply was cut at max_tokens={o.max_tokens})" if res.finish_reason == "length" else ""
            call.parse_error = f"{e}{cut}"
            return res.text, []
        return res.text, parsed.actions

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        async def once() -> tuple[str, list[AgentAction]]:
            try:
                return await self.apredict(instruction, obs)
            finally:
                await self.client.aclose()

        return asyncio.run(once())

    async def aclose(self) -> None:
        await self.client.aclose()
