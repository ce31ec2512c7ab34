"""An episode as one sequence: the whole conversation encoded once, every reply trained in place.

Step samples encode each turn's prompt on its own: a 15-step episode is 15 forward passes over
ever longer prefixes (system prompt, task, every earlier observation and reply). The last turn's
prompt already holds all of them, so here it is encoded once with the last reply appended, and
the loss mask covers the reply tokens of every turn (observations, screenshots and the system
prompt stay 0): one forward pass scores every turn, the shared prefix computed once.

That sequence is the policy's own only where each turn's prompt, as the policy server encoded
it, is a token prefix of the sequence and its sampled reply ids follow it there. A history the
agent cut (its last K turns, its last M screenshots) or a reply whose text re-tokenises to other
ids breaks it; :func:`reply_spans` checks it on the text alone (one placeholder per image, no
image decoded) and says where each reply lies, or why the episode is not one sequence. A reply
that re-tokenises differently spoils only its own turn (the later turns were prompted with the
re-tokenised text, which is what the sequence holds): that turn trains apart, on its own prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from osfarm.trainer.batching import VISION_PLACEHOLDERS, Encoded, encode_sample

# why an episode is not one sequence (the learner then trains it as step samples, counted)
CONTEXT_DIFFERS = "context_differs"  # a turn's prompt is not a prefix of the episode's sequence
REPLY_RETOKENIZED = "reply_retokenized"  # the history's reply text encodes to other ids than were sampled
PLACEHOLDER_IN_REPLY = "placeholder_in_reply"  # an earlier reply holds a vision placeholder token


@dataclass(frozen=True)
class EpisodeTurn:
    """A trained reply: ``messages[message_index]`` of the episode, ``messages[:message_index]``
    its prompt, ``token_ids`` the ids the policy sampled."""

    message_index: int
    token_ids: Sequence[int]


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat template's messages for OpenAI ones, images as bare placeholders (not decoded)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if content is None or isinstance(content, str):
            out.append({"role": m.get("role"), "content": content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
            elif kind == "image_url":
                parts.append({"type": "image"})
            else:
                raise ValueError(f"messages[{i}].content[{j}].type: unsupported content part {kind!r}")
        out.append({"role": m.get("role"), "content": parts})
    return out


def template_ids(processor: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """The prompt's token ids with one image placeholder per image (the processor expands each
    to the image's patch count; nothing else differs)."""
    text = processor.apply_chat_template(template_messages(messages), tokenize=False, add_generation_prompt=True)
    return list(processor.tokenizer(text)["input_ids"])


def _placeholder_ids(tokenizer: Any) -> set[int]:
    ids = (tokenizer.convert_tokens_to_ids(t) for t in VISION_PLACEHOLDERS)
    return {i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}


def reply_spans(processor: Any, messages: Sequence[dict[str, Any]],
                turns: Sequence[EpisodeTurn]) -> list[tuple[int, int] | str] | str:
    """Each turn's reply as it lies in the episode's sequence with one placeholder per image:
    (start, length), or ``REPLY_RETOKENIZED`` for an earlier turn whose text encodes to other ids
    than the policy sampled (the later turns saw the text's ids: that turn alone cannot train in
    place); or the reason the episode is not one sequence at all (``CONTEXT_DIFFERS`` etc.)."""
    if not turns:
        raise ValueError("an episode sample needs at least one turn")
    if any(b.message_index <= a.message_index for a, b in zip(turns, turns[1:], strict=False)):
        raise ValueError("an episode's turns must be in message order")
    last = turns[-1]
    prompt = template_ids(processor, messages[:last.message_index])
    placeholders = _placeholder_ids(processor.tokenizer)
    spans: list[tuple[int, int] | str] = []
    for t in turns[:-1]:
        if placeholders & set(t.token_ids):  # rendered as text it would be an image slot
            return PLACEHOLDER_IN_REPLY
        own = template_ids(processor, messages[:t.message_index])
        if prompt[:len(own)] != own:
            return CONTEXT_DIFFERS
        in_place = prompt[len(own):len(own) + len(t.token_ids)] == list(t.token_ids)
        spans.append((len(own), len(t.token_ids)) if in_place else REPLY_RETOKENIZED)
    spans.append((len(prompt), len(last.token_ids)))  # the sampled ids themselves: always in place
    return spans


def episode_layout(processor: Any, messages: Sequence[dict[str, Any]],
                   turns: Sequence[EpisodeTurn]) -> list[tuple[int, int]] | str:
    """(start, length) of each turn's reply in the episode's sequence with one placeholder per
    image, or the reason the episode is not one sequence with every turn in place."""
    spans = reply_spans(processor, messages, turns)
    if isinstance(spans, str):
        return spans
    placed = [s for s in spans if not isinstance(s, str)]
    return placed if len(placed) == len(spans) else REPLY_RETOKENIZED


def _collapsed_positions(ids: torch.Tensor, placeholders: set[int]) -> torch.Tensor:
    """Positions of ``ids`` [L] that remain when each run of an image's placeholders is one token."""
    is_ph = torch.isin(ids, torch.tensor(sorted(placeholders), dtype=ids.dtype)) if placeholders else (
        torch.zeros_like(ids, dtype=torch.bool))
    repeat = torch.zeros_like(is_ph)
    repeat[1:] = is_ph[1:] & (ids[1:] == ids[:-1])
    return torch.nonzero(~repeat).reshape(-1)


def encode_episode(processor: Any, messages: Sequence[dict[str, Any]], turns: Sequence[EpisodeTurn]) -> Encoded:
    """The last turn's prompt + its reply, encoded once (``encode_sample``), scored from the first
    turn's reply on, with ``train_mask`` 1 on every turn's reply tokens only. Raises ValueError
    when the episode is not one sequence (:func:`episode_layout`)."""
    spans = episode_layout(processor, messages, turns)
    if isinstance(spans, str):
        raise ValueError(f"the episode is not one sequence ({spans}): train it as step samples")
    last = turns[-1]
    enc = encode_sample(processor, messages[:last.message_index], last.token_ids)
    ids = enc.inputs["input_ids"][0]
    keep = _collapsed_positions(ids[:enc.prompt_len], _placeholder_ids(processor.tokenizer))
    if ids[:enc.prompt_len][keep].tolist() != template_ids(processor, messages[:last.message_index]):
        raise ValueError("the episode's prompt encodes differently with its images than without: "
                         "reply spans cannot be placed")
    starts = [int(keep[s]) for s, _ in spans[:-1]] + [enc.prompt_len]
    first = starts[0]
    scored = (enc.target_ids if enc.target_ids is not None else enc.inputs["input_ids"])[0, first:]
    mask = torch.zeros(scored.numel())
    for start, (_, n) in zip(starts, spans, strict=True):
        mask[start - first:start - first + n] = 1.0
    return Encoded(inputs=enc.inputs, prompt_len=first, response_ids=scored, target_ids=enc.target_ids,
                   train_mask=mask)
