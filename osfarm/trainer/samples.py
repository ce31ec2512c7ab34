"""Training samples: what an episode of a GRPO group becomes for the learner.

Each episode of a group becomes samples carrying its group advantage: one per assistant turn
(step-level GRPO: the context is the request the agent actually sent at that step — system
prompt, instruction, its last K turns with the last M screenshots — optionally cut shorter with
``context_turns``/``context_images``), or one per trajectory. High-entropy selection (DART, on by
default: the top 80%) then keeps the top fraction of a batch's samples: the forking tokens carry
most of the learning, and the rest only costs learner time. Experience-pool episodes train with
the group (their old policy version does not make them stale: they are replayed as successes,
π_b taken as π_prox).

Granularity ``episode``: after selection, an episode's step samples are joined into one sample
of the whole conversation, which the learner encodes once, every kept reply trained in place
(``episode_encoding.py``) instead of each step's prompt encoded anew. The join is only sound when
each step's prompt, as the agent sent it, is the conversation up to that turn with its reply
following verbatim: the policy was conditioned on exactly that prefix, so the turn's behaviour
log-probs still belong to its tokens. Otherwise the episode stays as its step samples (each with
its true prompt) and the reason is counted (``episode_fallback_<reason>``); it is never joined
into a sequence the policy did not see. Steps left out (selection, the version window, no
recorded ids) stay in the conversation as context and do not train.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from osfarm.stream.blobs import BlobMissing
from osfarm.trainer.data_config import DataConfig
from osfarm.trainer.episodes import Episode
from osfarm.trainer.grouping import Group
from osfarm.trainer.request_context import RequestResolver, trim_context
from osfarm.trainer.selection import (
    logprobs_as_floats,
    select_high_entropy,
    surprisal_entropy,
    topk_entropy,
)
from osfarm.trainer.staleness import in_version_window

log = logging.getLogger("osfarm.trainer.data")


@dataclass
class Sample:
    """One training example for the learner.

    ``messages``: the chat the policy was prompted with (OpenAI format; image parts are
    ``{"type": "image_url", "image_url": {"url": U}}`` with U an absolute file path or a data
    URL: :func:`osfarm.trainer.request_context.image_bytes` reads either). The response is
    ``response_token_ids`` (None for an experience-pool episode recorded without ids: tokenise
    ``response_text``) with the behaviour log-probs ``behav_logprobs`` (None when not recorded:
    use π_prox as π_b, weight 1).
    Trajectory samples (``step_index`` 0) put every assistant turn in ``messages`` and list the
    trained ones in ``turns``: ``{"message_index", "step_index", "token_ids", "logprobs",
    "policy_version"}``; their ``response_*`` fields are those of the last turn. An episode sample
    (``whole_episode``) is laid out alike and every turn in ``turns`` trains on its own reply.
    ``context_trimmed``: ``messages`` is shorter than the prompt the agent sent.
    """

    messages: list[dict[str, Any]]
    response_token_ids: list[int] | None
    behav_logprobs: list[float] | None
    policy_version: int | None
    advantage: float
    reward: float
    task_id: str
    group_id: str
    episode_id: str
    step_index: int
    response_text: str = ""
    entropy: float | None = None
    from_pool: bool = False
    turns: list[dict[str, Any]] | None = None
    whole_episode: bool = False
    context_trimmed: bool = False


@dataclass
class Batch:
    samples: list[Sample]
    groups: list[Group] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # what building this batch skipped

    @property
    def episodes(self) -> int:
        """Rollouts this batch consumed (experience-pool replays are not rollouts)."""
        return sum(1 for g in self.groups for e in g.episodes if not e.from_pool)

    @property
    def size(self) -> int:
        """Episodes in its groups (what ``batch_size`` counts), pool replays included."""
        return sum(len(g.episodes) for g in self.groups)


EntropyFn = Callable[[Sample], float | None]


def _version_of(model: dict[str, Any], ep: Episode) -> int | None:
    v = model.get("policy_version")
    return int(v) if v is not None else ep.version


@dataclass
class SampleBuilder:
    """Builds a batch's samples with the data manager's settings (``entropy_fn``: a sample's
    entropy for the high-entropy selection, in place of the one read off its log-probs)."""

    config: DataConfig
    entropy_fn: EntropyFn | None = None

    def build(self, groups: list[Group], version: int) -> Batch:
        """Samples of the groups (reads blobs: call from a worker thread in async code), with
        high-entropy selection applied over the whole batch; ``version``: the learner's, for the
        version window."""
        samples: list[Sample] = []
        counts: dict[str, int] = {"steps_skipped": 0, "stale_steps": 0}
        window = self.config.version_window
        for g in groups:
            for ep, adv in zip(g.episodes, g.advantages, strict=True):
                got, skipped = self._episode_samples(ep, adv, g.group_id)
                if window is not None:  # a step of an interrupted episode may be older than its episode's version
                    fresh = [s for s in got if s.from_pool or s.policy_version is None
                             or in_version_window(s.policy_version, version, window)]
                    counts["stale_steps"] += len(got) - len(fresh)
                    got = fresh
                samples += got
                counts["steps_skipped"] += skipped
        if self.config.entropy_fraction < 1.0 and samples:
            keep = select_high_entropy([s.entropy for s in samples], self.config.entropy_fraction)
            counts["entropy_filtered"] = sum(1 for k in keep if not k)
            samples = [s for s, k in zip(samples, keep, strict=True) if k]
        if self.config.granularity == "episode":
            samples = join_episodes(samples, counts)
        counts["samples"] = len(samples)
        counts["pool_samples"] = sum(1 for s in samples if s.from_pool)
        return Batch(samples, groups, counts)

    def _entropy(self, s: Sample, raw_logprobs: list[Any] | None) -> float | None:
        if self.entropy_fn is not None:
            return self.entropy_fn(s)
        if not raw_logprobs:
            return None
        return topk_entropy(raw_logprobs) if isinstance(raw_logprobs[0], dict) and raw_logprobs[0].get(
            "top_logprobs") else surprisal_entropy(raw_logprobs)

    def _episode_samples(self, ep: Episode, adv: float, group_id: str) -> tuple[list[Sample], int]:
        rec = ep.record
        res = RequestResolver(ep.blob_root, self.config.image_mode)
        steps = [s for s in rec["steps"] if s.get("model")]
        skipped = len(rec["steps"]) - len(steps)
        if self.config.granularity == "trajectory":
            sample = self._trajectory_sample(ep, adv, group_id, steps, res)
            return ([sample] if sample else []), (0 if sample else 1)
        out = []
        for st in steps:
            m = st["model"]
            ids = m.get("response_token_ids")
            if not ids and not ep.from_pool:
                skipped += 1
                continue
            try:
                msgs = res.request(m.get("request"))
            except (BlobMissing, ValueError) as e:
                log.warning("episode %s step %s skipped: %s", rec["episode_id"], st["index"], e)
                msgs = None
            if msgs is None:
                skipped += 1
                continue
            sent = msgs
            msgs = trim_context(msgs, self.config.context_turns, self.config.context_images)
            raw = m.get("response_logprobs")
            # the recorded log-probs are π_b given the prompt the agent sent: of a trimmed prompt
            # π_b is unknown, so none is given and the learner takes π_prox for it (weight 1)
            lps = logprobs_as_floats(raw) if raw and msgs == sent else None
            if lps is not None and ids and len(lps) != len(ids):
                log.warning("episode %s step %s: %d log-probs for %d tokens; step skipped", rec["episode_id"],
                            st["index"], len(lps), len(ids))
                skipped += 1
                continue
            s = Sample(messages=msgs, response_token_ids=list(ids) if ids else None, behav_logprobs=lps,
                       policy_version=_version_of(m, ep), advantage=adv, reward=ep.reward,
                       task_id=rec["task_id"], group_id=group_id, episode_id=rec["episode_id"],
                       step_index=st["index"], response_text=m.get("response_text") or "", from_pool=ep.from_pool,
                       context_trimmed=msgs != sent)
            s.entropy = self._entropy(s, raw)
            out.append(s)
        return out, skipped

    def _trajectory_sample(self, ep: Episode, adv: float, group_id: str, steps: list[dict[str, Any]],
                           res: RequestResolver) -> Sample | None:
        """The last step's request + its reply; the assistant turns in it map back to the steps
        (from the end), so the agent must have run with history_turns ≥ the episode's length
        for the whole trajectory to train."""
        rec = ep.record
        if not steps:
            return None
        last = steps[-1]["model"]
        try:
            msgs = res.request(last.get("request"))
        except (BlobMissing, ValueError) as e:
            log.warning("episode %s skipped: %s", rec["episode_id"], e)
            return None
        if msgs is None:
            return None
        msgs = trim_context(msgs, self.config.context_turns, self.config.context_images)
        msgs.append({"role": "assistant", "content": last.get("response_text") or ""})
        asst = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
        turns = []
        all_lps: list[Any] = []
        for mi, st in zip(reversed(asst), reversed(steps), strict=False):
            m = st["model"]
            ids = m.get("response_token_ids")
            if not ids and not ep.from_pool:
                continue
            raw = m.get("response_logprobs")
            all_lps += raw or []
            turns.append({"message_index": mi, "step_index": st["index"], "token_ids": list(ids) if ids else None,
                          "logprobs": logprobs_as_floats(raw) if raw else None,
                          "policy_version": _version_of(m, ep)})
        if not turns:
            return None
        turns.reverse()
        lps = logprobs_as_floats(last["response_logprobs"]) if last.get("response_logprobs") else None
        ids = last.get("response_token_ids")
        s = Sample(messages=msgs, response_token_ids=list(ids) if ids else None, behav_logprobs=lps,
                   policy_version=_version_of(last, ep), advantage=adv, reward=ep.reward,
                   task_id=rec["task_id"], group_id=group_id, episode_id=rec["episode_id"], step_index=0,
                   response_text=last.get("response_text") or "", from_pool=ep.from_pool, turns=turns)
        s.entropy = self._entropy(s, all_lps)
        return s



# why an episode's steps were not joined (counted as ``episode_fallback_<reason>``)
CONTEXT_TRIMMED = "context_trimmed"  # context_turns / context_images cut a step's prompt for the learner
HISTORY_CUT = "history_cut"  # a step's prompt is not the conversation so far (the agent cut its history)
REPLY_REWRITTEN = "reply_rewritten"  # the history holds another text than the step's reply


def join_episode(steps: list[Sample]) -> Sample | str:
    """One sample for an episode's step samples (in step order, two or more), or why they
    cannot be one (``HISTORY_CUT`` etc.)."""
    if len(steps) < 2:
        raise ValueError("joining an episode needs two or more step samples")
    if any(s.context_trimmed for s in steps):
        return CONTEXT_TRIMMED
    last = steps[-1]
    messages: list[dict[str, Any]] = [*last.messages, {"role": "assistant", "content": last.response_text}]
    turns: list[dict[str, Any]] = []
    for s in steps:
        k = len(s.messages)
        # a prompt no longer than the one before holds no earlier reply: an agent without history
        # asks each step afresh (equal prompts would otherwise put every turn on one message)
        if k >= len(messages) or messages[:k] != s.messages or (turns and k <= turns[-1]["message_index"]):
            return HISTORY_CUT
        reply = messages[k]
        if reply.get("role") != "assistant" or reply.get("content") != s.response_text:
            return REPLY_REWRITTEN
        turns.append({"message_index": k, "step_index": s.step_index, "token_ids": s.response_token_ids,
                      "logprobs": s.behav_logprobs, "policy_version": s.policy_version})
    known = [s.entropy for s in steps if s.entropy is not None]
    return replace(last, messages=messages, turns=turns, whole_episode=True,
                   entropy=sum(known) / len(known) if known else None)


def join_episodes(samples: list[Sample], counts: dict[str, int]) -> list[Sample]:
    """``samples`` with each episode's steps joined where they can be (episodes in their
    order); ``counts`` gains ``episode_samples`` and ``episode_fallback_<reason>``."""
    by_episode: dict[tuple[str, str, bool], list[Sample]] = {}
    for s in samples:  # an experience-pool replay may share its episode id with the original
        by_episode.setdefault((s.group_id, s.episode_id, s.from_pool), []).append(s)
    counts.setdefault("episode_samples", 0)
    out: list[Sample] = []
    for steps in by_episode.values():
        steps.sort(key=lambda s: s.step_index)
        joined = join_episode(steps) if len(steps) > 1 else steps[0]
        if isinstance(joined, str):
            key = f"episode_fallback_{joined}"
            counts[key] = counts.get(key, 0) + 1
            out += steps
            continue
        counts["episode_samples"] += 1
        out.append(joined)
    return out
