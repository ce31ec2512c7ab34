"""One image and length budget per run (``budget:`` in train.yaml).

The screenshot's resize bounds and the token limits are set here once and handed to everything
that must agree: the policy server's processor (vLLM's command line, ``osfarm policy serve``'s
flags: both resize the screenshots the model sees), the agent (UI-TARS coordinates are in that
resized image) and the learner (its processor must rebuild the very prompt the server saw, or
every importance weight is skewed). It is a schema because the policy side and the trainer side
both read it (``osfarm policy vllm-command --train-config``, ``osfarm policy serve``; the
trainer), and neither may import the other. A sample over the token limits is left out of the
update and counted (``overlong_samples``), never truncated: a cut reply is not what the policy
produced.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_pixels: int | None = Field(default=None, ge=1, description="screenshot resize lower bound in pixels "
                                   "(None: the model processor's own)")
    max_pixels: int | None = Field(default=None, ge=1, description="screenshot resize upper bound in pixels "
                                   "(None: the model processor's own)")
    max_prompt_tokens: int | None = Field(default=None, ge=1, description="a longer prompt's sample is not "
                                          "trained (counted as overlong); None: no limit")
    max_response_tokens: int | None = Field(default=None, ge=1, description="the agent's reply budget and the "
                                            "learner's limit (None: agent.max_tokens or the prompt format's)")

    @model_validator(mode="after")
    def _bounds(self) -> Budget:
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) is over max_pixels ({self.max_pixels})")
        return self

    @property
    def max_model_len(self) -> int | None:
        """A policy server's context limit: prompt + response tokens (None unless both are set)."""
        if self.max_prompt_tokens is None or self.max_response_tokens is None:
            return None
        return self.max_prompt_tokens + self.max_response_tokens

    def agent_options(self) -> dict[str, int]:
        """The VLM agent's options this budget sets."""
        names = ("min_pixels", "max_pixels")
        out = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.max_response_tokens is not None:
            out["max_tokens"] = self.max_response_tokens
        return out

    def apply_to_processor(self, processor: Any) -> None:
        """Set the resize bounds on a Qwen2-VL-style processor's image processor (its attributes
        and its ``size`` dict, which newer transformers read)."""
        ip = getattr(processor, "image_processor", None)
        if ip is None:
            return
        for name, key, value in (("min_pixels", "shortest_edge", self.min_pixels),
                                 ("max_pixels", "longest_edge", self.max_pixels)):
            if value is None:
                continue
            size = getattr(ip, "size", None)  # a dict, or transformers' SizeDict (the attributes are deprecated)
            if isinstance(size, dict) and key in size:
                size[key] = value
            elif size is not None and hasattr(size, key):
                setattr(size, key, value)
            else:
                setattr(ip, name, value)

    def overlong(self, prompt_tokens: int | None, response_tokens: int) -> str | None:
        """Why a sample is over the budget (None: it is not); ``prompt_tokens`` None: not measured."""
        if self.max_response_tokens is not None and response_tokens > self.max_response_tokens:
            return f"response of {response_tokens} tokens over max_response_tokens {self.max_response_tokens}"
        if self.max_prompt_tokens is not None and prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return f"prompt of {prompt_tokens} tokens over max_prompt_tokens {self.max_prompt_tokens}"
        return None
