"""High-entropy step selection (DART): train only on the steps where the policy was unsure.

Steps are ranked by the mean token entropy of their response and the top ``fraction`` is kept;
the rest are left out of the loss. Low-entropy steps (the model was already sure) carry little
gradient signal and dominate long trajectories.

When only the sampled tokens' log-probs were recorded (what a rollout server returns), the
entropy proxy is the mean surprisal −log π(a_t): its expectation under the policy is the
entropy. When top-k log-probs were recorded, :func:`topk_entropy` gives the entropy of the
renormalised top-k distribution (a lower bound's shape, good enough to rank steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def _logprob_of(x: Any) -> float:
    """A per-token log-prob as recorded: a number, or {"logprob": ...} (the OpenAI shape)."""
    if isinstance(x, dict):
        x = x.get("logprob")
    v = float(x)
    if math.isnan(v):
        raise ValueError("a recorded log-prob is NaN")
    return v


def logprobs_as_floats(logprobs: Sequence[Any]) -> list[float]:
    return [_logprob_of(x) for x in logprobs]


def surprisal_entropy(logprobs: Sequence[Any]) -> float | None:
    """Mean −log π over a response's sampled tokens; None when nothing was recorded."""
    if not logprobs:
        return None
    vals = logprobs_as_floats(logprobs)
    return -sum(vals) / len(vals)


def topk_entropy(logprobs: Sequence[Any]) -> float | None:
    """Mean per-token entropy of the renormalised top-k distributions (needs ``top_logprobs``)."""
    hs = []
    for tok in logprobs:
        top = tok.get("top_logprobs") if isinstance(tok, dict) else None
        if not top:
            return None
        lps = [_logprob_of(t) for t in top]
        m = max(lps)
        ws = [math.exp(lp - m) for lp in lps]
        z = sum(ws)
        hs.append(-sum(w / z * math.log(w / z) for w in ws if w > 0))
    return sum(hs) / len(hs) if hs else None


def select_high_entropy(entropies: Sequence[float | None], fraction: float) -> list[bool]:
    """Keep-flags for the top ``fraction`` of steps by entropy.

    Keeps ceil(fraction · n_known) of the steps whose entropy is known (at least one when
    fraction > 0); ties go to the earlier step, so the choice is deterministic. Steps with an
    unknown entropy (None) cannot be ranked and are always kept. fraction ≥ 1 keeps everything.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"entropy selection fraction must be in [0, 1], got {fraction}")
    known = [(i, h) for i, h in enumerate(entropies) if h is not None]
    keep = [h is None for h in entropies]
    if fraction >= 1.0:
        return [True] * len(entropies)
    n_keep = math.ceil(fraction * len(known) - 1e-9)
    ranked = sorted(known, key=lambda ih: (-float(ih[1]), ih[0]))
    for i, _ in ranked[:n_keep]:
        keep[i] = True
    return keep
