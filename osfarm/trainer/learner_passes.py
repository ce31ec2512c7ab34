"""The learner's forward passes: samples encoded, log-probs of their trained tokens (current
weights, the KL reference), and the decoupled PPO loss of a micro-batch.

A mix-in of :class:`osfarm.trainer.learner.Learner`, which holds the model, the processor and
the options these read; the update loop, the optimizer and saving stay there. A sample trains
turn by turn (``trained_turns.py``): a step sample's reply, or every reply of an episode encoded
as one sequence (``episode_encoding.py``); per-token values of a micro-batch (log-probs,
behaviour log-probs, advantages) are given for trained tokens only and placed by its mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from osfarm.trainer.batching import Encoded, MicroBatch, collate, encode_sample
from osfarm.trainer.episode_encoding import encode_episode
from osfarm.trainer.learner_options import LearnerOptions
from osfarm.trainer.losses import decoupled_ppo_loss, gather_logprobs, kl_penalty, token_entropy
from osfarm.trainer.samples import Sample
from osfarm.trainer.trained_turns import Turn, episode_turns, prompt_messages, reply_ids, sample_turns


def _per_token(turns: Sequence[Turn], value: Any) -> list[float]:
    """A turn-level value (a function of the turn and its index) spread over each turn's tokens."""
    return [float(value(k, t)) for k, t in enumerate(turns) for _ in t.ids]


class LearnerPasses:
    """Encoding and forward passes over the learner's model (see the module)."""

    opts: LearnerOptions
    processor: Any
    pad_id: int
    model: Any
    ref_model: Any
    lora: bool
    device: torch.device
    ref_device: torch.device
    compute_dtype: torch.dtype
    autocast: bool

    def response_ids(self, sample: Sample) -> list[int]:
        """The sample's (last) response token ids; an experience-pool episode recorded without ids
        has its response text tokenised (plus the end-of-turn token the server would have sampled)."""
        return reply_ids(self.processor.tokenizer, sample.response_token_ids, sample.response_text)

    def turns(self, sample: Sample) -> list[Turn]:
        """The turns of ``sample`` that train (one for a step sample)."""
        return sample_turns(sample, self.processor.tokenizer)

    def encode(self, sample: Sample, turns: Sequence[Turn] | None = None) -> Encoded:
        """The sample's prompt + its response ids; an episode sample's whole conversation, every
        turn's reply in its mask (``turns``: already computed)."""
        turns = self.turns(sample) if turns is None else turns
        if sample.whole_episode:
            return encode_episode(self.processor, sample.messages, episode_turns(sample, turns))
        return encode_sample(self.processor, prompt_messages(sample), turns[-1].ids)

    def _encode_micro(self, samples: Sequence[Sample], turns: Sequence[Sequence[Turn]],
                      idx: Sequence[int]) -> MicroBatch:
        """Samples ``idx`` encoded and collated now; nothing else keeps them, so they are freed
        when the caller drops the micro-batch."""
        return collate([self.encode(samples[i], turns[i]) for i in idx], self.pad_id)

    @contextlib.contextmanager
    def _precision(self) -> Iterator[None]:
        if self.autocast:
            with torch.autocast(self.device.type, dtype=self.compute_dtype):
                yield
        else:
            yield

    def forward(
        self, mb: MicroBatch, *, model: Any = None, full: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [B, T], logits [B, T, V]) of the last T tokens of each sequence (T = the
        micro-batch's longest response; ``mb.mask`` says which are a sample's trained tokens).

        ``full``: compute the logits of every position first (tests; what ``logits_to_keep``
        saves on long VLM prompts), then keep the last T. Both give the same log-probs."""
        full = self.opts.full_logits if full is None else full
        model = model or self.model
        device = self.ref_device if model is self.ref_model else self.device
        inputs = {k: v.to(device) for k, v in mb.inputs.items()}
        if "pixel_values" in inputs and not self.autocast:  # the dtype the vision tower computes in
            inputs["pixel_values"] = inputs["pixel_values"].to(self.compute_dtype)
        with self._precision():
            logits = model(**inputs, use_cache=False, logits_to_keep=0 if full else mb.width + 1).logits
        logits = logits[:, -(mb.width + 1):-1, :]  # the logit at position i predicts token i + 1
        if self.opts.temperature != 1.0:  # the policy is the distribution the server samples from
            logits = logits / self.opts.temperature
        return gather_logprobs(logits, mb.targets.to(logits.device)), logits

    def token_logprobs(self, enc: Encoded, *, full: bool | None = None,
                       model: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sample: (log-probs [1, T], mask [1, T], logits [1, T, V]) of its scored tokens."""
        mb = collate([enc], self.pad_id)
        logp, logits = self.forward(mb, model=model, full=full)
        return logp, mb.mask.to(logp.device), logits

    def response_logprobs(self, enc: Encoded) -> torch.Tensor:
        """Log-probs [1, T] of the scored tokens under the current weights."""
        return self.token_logprobs(enc)[0]

    @torch.no_grad()
    def reference_logprobs(self, enc: Encoded) -> torch.Tensor:
        """Log-probs [1, T] of the scored tokens under the frozen KL reference."""
        return self._reference(collate([enc], self.pad_id))

    def _reference(self, mb: MicroBatch) -> torch.Tensor:
        if self.lora:
            with self.model.disable_adapter():
                return self.forward(mb)[0]
        return self.forward(mb, model=self.ref_model)[0].to(self.device)

    @torch.no_grad()
    def score(self, sample: Sample) -> list[float]:
        """Current log-probs of a sample's trained tokens (every turn's, in order; no grad)."""
        return self.score_many([sample])[0]

    @torch.no_grad()
    def score_many(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Current log-probs of several samples, ``micro_batch_size`` per forward pass."""
        self.model.eval()
        out: list[list[float]] = []
        step = self.opts.micro_batch_size
        for i in range(0, len(samples), step):
            mb = collate([self.encode(s) for s in samples[i:i + step]], self.pad_id)  # freed each round
            logp, _ = self.forward(mb)
            out += [row.float().cpu().tolist() for row in mb.per_sample(logp)]
        return out

    def micro_loss(self, turns: Sequence[Sequence[Turn]], mb: MicroBatch, prox: torch.Tensor,
                   ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """(loss, loss stats, mean entropy) of a micro-batch, each a mean over its trained tokens
        (or turns); ``turns``: each sample's; ``prox`` / ``ref``: [B, T] proximal / reference log-probs."""
        lo = self.opts.loss
        logp, logits = self.forward(mb)
        mask = mb.mask.to(logp.device)
        prox = prox.to(logp.device, logp.dtype)
        # no behaviour log-probs recorded for a turn, or an experience-pool sample (an old success
        # replayed as DART does): π_b = π_prox, importance weight 1
        nan = float("nan")
        behav = mb.rows([None if all(t.behav is None for t in ts) else
                         [x for t in ts for x in (t.behav if t.behav is not None else [nan] * len(t.ids))]
                         for ts in turns], prox)
        behav = torch.where(torch.isnan(behav), prox, behav)
        zeros = torch.zeros_like(prox)
        adv = mb.rows([_per_token(ts, lambda _k, t: t.advantage) for ts in turns], zeros)
        # seq_mean averages per turn: a turn of an episode weighs what its step sample would
        turn_of = mb.rows([_per_token(ts, lambda k, _t: k) for ts in turns], zeros).long()
        loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, clip_low=lo.clip_low, clip_high=lo.clip_high,
                                         behav_cap=lo.behav_cap, behav_reject=lo.behav_reject, dual_clip=lo.dual_clip,
                                         aggregation=lo.aggregation, segments=turn_of)
        if ref is not None and lo.kl_coef > 0:
            kl = kl_penalty(logp, ref.to(logp.device, logp.dtype), mask, kind=lo.kl_kind,
                            aggregation=lo.aggregation, segments=turn_of)
            loss = loss + lo.kl_coef * kl
            stats = {**stats, "kl_ref": float(kl.detach())}
        # with no bonus the entropy is only reported: no graph over the [B, T, V] logits for it
        with contextlib.nullcontext() if lo.entropy_coef else torch.no_grad():
            ent = token_entropy(logits)
            ent_mean = (ent * mask).sum() / mask.sum()
        if lo.entropy_coef:
            loss = loss - lo.entropy_coef * ent_mean
        return loss, stats, ent_mean.detach()

    def sample_loss(self, sample: Sample, enc: Encoded, prox: torch.Tensor,
                    ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """:meth:`micro_loss` of one sample (``prox`` [1, T])."""
        return self.micro_loss([self.turns(sample)], collate([enc], self.pad_id), prox.reshape(1, -1),
                               None if ref is None else ref.reshape(1, -1))
