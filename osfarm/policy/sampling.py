"""Sampling parameters, the log-probs we report, and the latency knob: small pure functions.

Log-probs (``logprobs_mode``):

* ``processed`` (default): log-probs under the distribution the token was actually sampled from,
  i.e. ``log_softmax(top_p(top_k(logits / temperature)))``. This is the behaviour policy pi_b
  of the decoupled PPO loss. With ``temperature = 0`` (greedy) there is no sampling
  distribution; the reported log-probs are then the model's own (temperature 1), as in ``raw``.
* ``raw``: ``log_softmax(logits)``, the model's distribution before temperature and truncation.
  vLLM's default (``--logprobs-mode raw_logprobs``).

vLLM matches ``processed`` with ``--logprobs-mode processed_logprobs`` (docs/policy.md).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

LogprobsMode = Literal["processed", "raw"]
LOGPROBS_MODES: tuple[LogprobsMode, ...] = ("processed", "raw")

# JSON has no -inf: tokens outside the nucleus are reported with this log-prob (as vLLM does).
NEG_INF_LOGPROB = -9999.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def finite_logprob(x: float) -> float:
    """A log-prob JSON can carry: -inf (a token the sampler could not pick) becomes -9999.0."""
    return x if math.isfinite(x) else NEG_INF_LOGPROB


def sequence_end(token_ids: list[int], eos_ids: set[int]) -> tuple[int, bool]:
    """Length of a generated sequence up to and including its first stop token, and whether it stopped.

    ``generate`` pads sequences that finished before the others; the stop token belongs to the
    sequence (the policy chose it, the trainer must learn it), the padding after it does not.
    """
    for i, t in enumerate(token_ids):
        if t in eos_ids:
            return i + 1, True
    return len(token_ids), False


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """Text before the first stop string (OpenAI semantics: the stop string is not returned)."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def lognormal_mu(mean: float, sigma: float) -> float:
    """mu of a lognormal with the given mean and log-space sigma: E[X] = exp(mu + sigma^2 / 2)."""
    if mean <= 0:
        raise ValueError("mean must be > 0")
    return math.log(mean) - sigma * sigma / 2.0


class LatencyModel:
    """Artificial per-request latency (ms): lognormal with a given mean and sigma (heavy tail)."""

    def __init__(self, mean_ms: float, sigma: float = 0.0, seed: int | None = None):
        if mean_ms < 0 or sigma < 0:
            raise ValueError("delay mean and sigma must be >= 0")
        self.mean_ms = mean_ms
        self.sigma = sigma
        self._rng = random.Random(seed)

    def sample_ms(self) -> float:
        if self.mean_ms == 0:
            return 0.0
        if self.sigma == 0:
            return self.mean_ms
        return self._rng.lognormvariate(lognormal_mu(self.mean_ms, self.sigma), self.sigma)
