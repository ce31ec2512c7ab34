"""What of a sample trains, turn by turn: a step sample's one reply, an episode sample's every reply.

An update works on turns: each has its reply's token ids, the behaviour log-probs of the policy
that sampled that very turn (an episode's turns may come from different policy versions; the
importance weight π_prox/π_b of a token uses its own turn's π_b) and its advantage, which episode
weighting scales per turn as it scales step samples: an episode trained as one sequence has the
loss its step samples would have.

An episode sample whose sequence is not the policy's own on the token level (``reply_spans``: a
prompt that is no prefix) is trained as its step samples instead, each with its true prompt, and
counted; a turn whose reply re-tokenises to other ids than were sampled trains apart, on its own
prompt, and the rest of the episode stays one sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from osfarm.trainer.episode_encoding import REPLY_RETOKENIZED, EpisodeTurn, reply_spans
from osfarm.trainer.samples import Sample

# a turn of a joined episode trained apart, as a step sample (its reply re-tokenises to other ids): counted
# per turn, as ``episode_fallback_turn_retokenized``, while the rest of its episode stays one sequence
TURN_RETOKENIZED = "turn_retokenized"


@dataclass
class Turn:
    ids: list[int]
    behav: list[float] | None  # None: π_b taken as π_prox (not recorded, or an experience-pool replay)
    advantage: float
    episode_id: str
    label: str  # episode#step, for errors


def reply_ids(tokenizer: Any, token_ids: Sequence[int] | None, text: str) -> list[int]:
    """A reply's token ids; an experience-pool episode recorded without ids has its text
    tokenised (plus the end-of-turn token the server would have sampled)."""
    if token_ids:
        return list(token_ids)
    out = list(tokenizer(text or "", add_special_tokens=False)["input_ids"])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end, int) and end != tokenizer.unk_token_id:
        out.append(end)
    return out


def _reply_text(sample: Sample, message_index: int) -> str:
    content = sample.messages[message_index].get("content")
    return content if isinstance(content, str) else ""


def sample_turns(sample: Sample, tokenizer: Any) -> list[Turn]:
    """The turns of ``sample`` that train, in order."""
    if not sample.whole_episode:
        behav = None if sample.behav_logprobs is None or sample.from_pool else list(sample.behav_logprobs)
        return [Turn(reply_ids(tokenizer, sample.response_token_ids, sample.response_text), behav,
                     float(sample.advantage), sample.episode_id, f"{sample.episode_id}#{sample.step_index}")]
    out = []
    for t in sample.turns or []:
        lps = t.get("logprobs")
        out.append(Turn(reply_ids(tokenizer, t.get("token_ids"), _reply_text(sample, int(t["message_index"]))),
                        None if lps is None or sample.from_pool else list(lps), float(sample.advantage),
                        sample.episode_id, f"{sample.episode_id}#{t.get('step_index')}"))
    if not out:
        raise ValueError(f"episode sample {sample.episode_id}: no turns")
    return out


def episode_turns(sample: Sample, turns: Sequence[Turn]) -> list[EpisodeTurn]:
    """An episode sample's turns as the episode encoder takes them."""
    return [EpisodeTurn(int(t["message_index"]), tt.ids) for t, tt in zip(sample.turns or [], turns, strict=True)]


def prompt_messages(sample: Sample) -> list[dict[str, Any]]:
    """The chat the sample's (last) response continues. A trajectory or episode sample (``turns``)
    carries every assistant turn, its last reply included, in ``messages``: that reply is the
    response, so it is cut off here (encoded twice, the model would be trained on a sequence the
    policy never produced). A trajectory's earlier turns are context; an episode's train too."""
    if not sample.turns:
        return sample.messages
    last = int(sample.turns[-1]["message_index"])
    if not (0 < last < len(sample.messages)) or sample.messages[last].get("role") != "assistant":
        raise ValueError(f"sample {sample.episode_id}: turns[-1].message_index {last} is not an assistant message "
                         f"of its {len(sample.messages)} messages")
    return sample.messages[:last]


def as_step_samples(sample: Sample) -> list[Sample]:
    """An episode sample's turns as step samples, each with its own prompt (the conversation up to it)."""
    out = []
    for t in sample.turns or []:
        k = int(t["message_index"])
        out.append(replace(sample, messages=sample.messages[:k], response_token_ids=t.get("token_ids"),
                           behav_logprobs=t.get("logprobs"), policy_version=t.get("policy_version"),
                           step_index=int(t.get("step_index") or 0), response_text=_reply_text(sample, k),
                           turns=None, whole_episode=False))
    return out


def steps_where_not_one_sequence(samples: Sequence[Sample], processor: Any) -> tuple[list[Sample], dict[str, int]]:
    """``samples`` with each episode sample that is not one sequence on the token level replaced
    by its step samples, and each turn of a joined episode whose reply re-tokenises differently
    split off as a step sample of its own (the rest still one sequence: that reply stays in it as
    context, as the later turns saw it); the count of each reason, and of the turns split off
    (``TURN_RETOKENIZED``). Text only: no image is decoded."""
    out: list[Sample] = []
    why: dict[str, int] = {}
    for s in samples:
        if not s.whole_episode:
            out.append(s)
            continue
        spans = reply_spans(processor, s.messages, episode_turns(s, sample_turns(s, processor.tokenizer)))
        apart = [] if isinstance(spans, str) else [i for i, x in enumerate(spans) if isinstance(x, str)]
        if isinstance(spans, str) or len(spans) - len(apart) < 2:  # one turn left in place: a step sample
            reason = spans if isinstance(spans, str) else REPLY_RETOKENIZED
            why[reason] = why.get(reason, 0) + 1
            out += as_step_samples(s)
            continue
        if apart:
            steps = as_step_samples(s)
            out += [steps[i] for i in apart]
            s = replace(s, turns=[t for i, t in enumerate(s.turns or []) if i not in apart])
            why[TURN_RETOKENIZED] = why.get(TURN_RETOKENIZED, 0) + len(apart)
        out.append(s)
    return out, why
