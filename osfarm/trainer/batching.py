"""Learner inputs: one sample encoded as the policy server encoded it, and micro-batches of them.

A sample is the prompt the server saw (``encode_chat``, the server's own encoder) with the sampled
response token ids appended; the loss covers the response tokens only. A micro-batch stacks
several samples for one forward pass: sequences are **left**-padded, so every response ends at the
last position and the logits of the last ``T + 1`` positions (T = the longest response) are all a
micro-batch needs; images are concatenated in sample order (Qwen2-VL's ``pixel_values`` /
``image_grid_thw`` are per image, not per sample), and the attention mask lets the model compute
each sample's mRoPE positions as if it stood alone.

An episode encoded as one sequence (``episode_encoding.py``) is a sample whose scored tokens run
from its first trained reply to its end with observations in between: its ``train_mask`` says
which of them train, and per-token values (log-probs, advantages) are given for those only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from osfarm.policy.processing import encode_chat

VISION_PLACEHOLDERS = ("<|image_pad|>", "<|video_pad|>")
# per-token inputs that are padded with the sequence (everything else is per image or per batch)
_PER_TOKEN = ("input_ids", "attention_mask", "mm_token_type_ids")


def response_mask(prompt_len: int, response_len: int) -> torch.Tensor:
    """Loss mask over a (prompt + response) sequence: 1 on response tokens, 0 on the prompt."""
    return torch.cat([torch.zeros(prompt_len), torch.ones(response_len)])


@dataclass
class Encoded:
    inputs: dict[str, torch.Tensor]  # input_ids etc. for the whole sequence (batch of 1)
    prompt_len: int
    response_ids: torch.Tensor  # [T]
    target_ids: torch.Tensor | None = None  # [1, L] the tokens to score, when input_ids had to differ
    # [T] 1 on the tokens that train; None: all T (a step's reply). An episode's T tokens hold
    # observations between its replies, which are scored alongside but masked out
    train_mask: torch.Tensor | None = None

    @property
    def response_len(self) -> int:
        return int(self.response_ids.numel())

    @property
    def trained_len(self) -> int:
        """The tokens that train (per-token values are given for these only)."""
        return self.response_len if self.train_mask is None else int(self.train_mask.sum())

    @property
    def length(self) -> int:
        return int(self.inputs["input_ids"].shape[1])


def encode_sample(processor: Any, messages: Sequence[dict[str, Any]], response_ids: Sequence[int]) -> Encoded:
    """Prompt inputs + the response token ids appended (attention over all of them).

    The prompt is encoded by the policy server's own function (``encode_chat``), so its ids are
    the ones the sampled tokens were conditioned on: any difference would skew every importance
    weight (tests/test_policy_server.py checks ids and log-probs against a running server).
    """
    inputs = dict(encode_chat(processor, list(messages)))
    ids = inputs["input_ids"]
    resp = torch.tensor(list(response_ids), dtype=ids.dtype)
    if resp.numel() == 0:
        raise ValueError("a sample needs at least one response token")
    prompt_len = ids.shape[1]
    full = torch.cat([ids, resp[None]], dim=1)
    inputs["input_ids"] = full
    target_ids = None
    # A sampled vision placeholder (a random or early model can emit <|image_pad|>) would be one
    # image token more than the image has features, and the forward pass refuses it: as an input
    # it becomes a plain token; it is still scored as the token the policy sampled.
    tok = processor.tokenizer
    placeholders = [i for i in (tok.convert_tokens_to_ids(t) for t in VISION_PLACEHOLDERS)
                    if isinstance(i, int) and i != tok.unk_token_id]
    if placeholders and bool(torch.isin(resp, torch.tensor(placeholders, dtype=resp.dtype)).any()):
        safe = resp.clone()
        safe[torch.isin(resp, torch.tensor(placeholders, dtype=resp.dtype))] = plain_token(tok)
        inputs["input_ids"] = torch.cat([ids, safe[None]], dim=1)
        target_ids = full
    if "attention_mask" in inputs:
        am = inputs["attention_mask"]
        inputs["attention_mask"] = torch.cat([am, torch.ones(1, resp.numel(), dtype=am.dtype)], dim=1)
    if "mm_token_type_ids" in inputs:  # response tokens are text
        mt = inputs["mm_token_type_ids"]
        inputs["mm_token_type_ids"] = torch.cat([mt, torch.zeros(1, resp.numel(), dtype=mt.dtype)], dim=1)
    inputs.pop("token_type_ids", None)
    return Encoded(inputs=inputs, prompt_len=prompt_len, response_ids=resp, target_ids=target_ids)


def plain_token(tokenizer: Any) -> int:
    """A token id that is plain text to the model (padding, and the stand-in for a sampled placeholder)."""
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


@dataclass
class MicroBatch:
    """Several encoded samples, left-padded into one forward pass."""

    inputs: dict[str, torch.Tensor]  # [B, L] per-token tensors; images concatenated
    targets: torch.Tensor  # [B, T] the token each of the last T logits scores
    mask: torch.Tensor  # [B, T] 1 where that token is one of the sample's trained response tokens
    response_lens: list[int]  # each sample's scored tokens (its trained ones and, in an episode, the rest)

    @property
    def size(self) -> int:
        return len(self.response_lens)

    @property
    def width(self) -> int:
        """T: the longest response (the logits kept per sequence)."""
        return int(self.targets.shape[1])

    def rows(self, values: Sequence[Sequence[float] | torch.Tensor | None], fill: torch.Tensor) -> torch.Tensor:
        """[B, T] tensor of per-trained-token values (a sample's values in its mask's positions,
        in order); rows given as None take ``fill``'s row."""
        out = fill.detach().clone()
        on = self.mask.to(out.device) > 0
        for i, v in enumerate(values):
            if v is None:
                continue
            t = torch.as_tensor(v, dtype=out.dtype, device=out.device).reshape(-1)
            n = int(on[i].sum())
            if t.numel() != n:
                raise ValueError(f"row {i}: {t.numel()} values for {n} response tokens")
            out[i, on[i]] = t
        return out

    def per_sample(self, values: torch.Tensor) -> list[torch.Tensor]:
        """The trained tokens' values of each row of a [B, T] tensor."""
        on = self.mask.to(values.device) > 0
        return [values[i, on[i]] for i in range(self.size)]


def collate(encs: Sequence[Encoded], pad_id: int) -> MicroBatch:
    """Left-pad ``encs`` into one micro-batch (a single sample is passed through unpadded)."""
    if not encs:
        raise ValueError("a micro-batch needs at least one sample")
    length = max(e.length for e in encs)
    width = max(e.response_len for e in encs)
    keys = sorted({k for e in encs for k in e.inputs})
    inputs: dict[str, torch.Tensor] = {}
    for k in keys:
        if k in _PER_TOKEN:  # a sample without it (no image: no mm_token_type_ids) has zeros there
            value = pad_id if k == "input_ids" else 0
            parts = [e.inputs[k] if k in e.inputs else torch.zeros_like(e.inputs["input_ids"]) for e in encs]
            inputs[k] = torch.cat([_left_pad(p, length, value) for p in parts], dim=0)
        else:  # per image (pixel_values, image_grid_thw): in sample order; a text-only sample has none
            inputs[k] = torch.cat([e.inputs[k] for e in encs if k in e.inputs], dim=0)
    if "attention_mask" not in inputs:
        inputs["attention_mask"] = torch.cat([_left_pad(torch.ones_like(e.inputs["input_ids"]), length, 0)
                                              for e in encs], dim=0)
    scored = torch.cat([_left_pad(e.target_ids if e.target_ids is not None else e.inputs["input_ids"], length, pad_id)
                        for e in encs], dim=0)
    mask = torch.zeros(len(encs), width)
    for i, e in enumerate(encs):
        mask[i, width - e.response_len:] = 1.0 if e.train_mask is None else e.train_mask.to(mask.dtype)
    return MicroBatch(inputs=inputs, targets=scored[:, -width:], mask=mask,
                      response_lens=[e.response_len for e in encs])


def _left_pad(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    n = length - t.shape[1]
    if n <= 0:
        return t
    return torch.cat([torch.full((t.shape[0], n), value, dtype=t.dtype), t], dim=1)
