"""Group-relative advantages (GRPO, and Dr.GRPO without the std division).

A group is the set of rollouts of one task (rl.md, "GRPO / multi-turn batching"):

    A_i = (R_i − mean_g) / (std_g + eps)      GRPO
    A_i =  R_i − mean_g                       Dr.GRPO (``std_normalize=False``)

Which std: the *population* std (divide by n) by default. The group is the whole set being
normalised, not a sample used to estimate a wider population; it is defined for a group of one
(std 0, advantage 0) and gives the textbook example [1, 0, 0, 1] → [1, −1, −1, 1]. verl and TRL
(and so DART, built on verl) call ``torch.std``, the sample std (divide by n − 1); pass
``unbiased=True`` to match them. For n = 8 the two differ by a constant factor √(8/7) ≈ 1.07,
which the learning rate absorbs.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def _check_rewards(rewards: Sequence[float]) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        try:
            v = float(r)
        except (TypeError, ValueError):
            raise ValueError(f"rewards[{i}] = {r!r} is not a number") from None
        if not math.isfinite(v):
            raise ValueError(f"rewards[{i}] = {v} is not finite")
        out.append(v)
    return out


def group_std(rewards: Sequence[float], *, unbiased: bool = False) -> float:
    """Population std (default) or sample std (``unbiased``; 0 for a group of one)."""
    rs = _check_rewards(rewards)
    n = len(rs)
    if n == 0:
        raise ValueError("an empty group has no std")
    mean = sum(rs) / n
    ss = sum((r - mean) ** 2 for r in rs)
    denom = n - 1 if unbiased else n
    return math.sqrt(ss / denom) if denom > 0 else 0.0


def grpo_advantages(rewards: Sequence[float], *, std_normalize: bool = True, eps: float = 1e-6,
                    unbiased: bool = False) -> list[float]:
    """Advantages of one group's rewards; ``std_normalize=False`` is Dr.GRPO."""
    rs = _check_rewards(rewards)
    if not rs:
        return []
    mean = sum(rs) / len(rs)
    centred = [r - mean for r in rs]
    if not std_normalize:
        return centred
    std = group_std(rs, unbiased=unbiased)
    return [c / (std + eps) for c in centred]


def grouped_advantages(rewards: Sequence[float], group_ids: Sequence[Hashable], *, std_normalize: bool = True,
                       eps: float = 1e-6, unbiased: bool = False) -> list[float]:
    """Advantages for a flat list whose items belong to groups (``group_ids[i]`` is item i's group)."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        adv = grpo_advantages([rewards[i] for i in idx], std_normalize=std_normalize, eps=eps, unbiased=unbiased)
        for i, a in zip(idx, adv, strict=True):
            out[i] = a
    return out


def sharpen_advantages(advantages: Sequence[float], successes: Sequence[bool], likelihoods: Sequence[float | None],
                       lam: float) -> list[float]:
    """XRPO's exploitation half: amplify the successes the policy found unlikely.

    A success's novelty is how far its sequence likelihood ℓ_i (mean log-prob per response token)
    lies below the group's mean ℓ̄; its positive advantage grows by up to a factor 1 + λ:

        A_i ← A_i · (1 + λ · tanh(max(0, ℓ̄ − ℓ_i)))       for successes with A_i > 0

    Failures, successes at least as likely as the group, and episodes without recorded log-probs
    keep their advantage. Group-relative (ℓ̄ over the group's episodes with a likelihood), bounded
    (tanh < 1), and 0 sharpening leaves GRPO unchanged.
    """
    if lam < 0:
        raise ValueError(f"sharpening lambda must be >= 0, got {lam}")
    if not len(advantages) == len(successes) == len(likelihoods):
        raise ValueError("advantages, successes and likelihoods must have one entry per episode")
    known = [ll for ll in likelihoods if ll is not None]
    if not known or lam == 0:
        return [float(a) for a in advantages]
    mean = sum(known) / len(known)
    out = []
    for a, ok, ll in zip(advantages, successes, likelihoods, strict=True):
        if ok and a > 0 and ll is not None:
            a = a * (1.0 + lam * math.tanh(max(0.0, mean - ll)))
        out.append(float(a))
    return out


def episode_weights(episode_ids: Sequence[Hashable]) -> list[float]:
    """Per-sample weights under which every episode of an update counts the same.

    With one sample per step, a 15-step failure has 15 samples to a 3-step success's 3 and would
    dominate the update's gradient; each sample instead gets ``N / (E · n_e)`` (N samples, E
    episodes, n_e the samples of its episode): an episode's weights sum to N / E and their mean
    over the update stays 1, so the learning rate means what it meant.
    """
    counts: dict[Hashable, int] = {}
    for e in episode_ids:
        counts[e] = counts.get(e, 0) + 1
    n, eps = len(episode_ids), len(counts)
    return [n / (eps * counts[e]) for e in episode_ids]
