"""Policy-gradient losses on per-token log-probs: AReaL's decoupled PPO, KL to a reference, entropy.

All tensors are ``[B, T]`` (batch of sequences × token positions) with a float ``mask`` of
{0, 1} that is 1 on the model's own tokens (the ones that train) and 0 on prompt, observation,
image and padding positions. AReaL's decoupled PPO objective (Fu et al. 2025):

    r_t = π_θ / π_prox                 ratio to the proximal policy (the learner before this update)
    w_t = π_prox / π_b                 behaviour importance weight (π_b sampled the tokens)
    loss_t = w_t · max(−Â_t·r_t, −Â_t·clip(r_t, 1−ε_low, 1+ε_high))

Clipping is centred on π_prox, so stale samples (π_b several versions old) still get a trust
region around the current learner; w_t corrects for the sampling policy and is a constant (no
gradient flows through π_prox or π_b). w_t is bounded either by truncation at C (DART:
``behav_cap``) or by rejection of tokens with w_t above a bound (AReaL: ``behav_reject``);
rejected tokens get weight 0 but still count in the token-mean denominator, as in AReaL, so a
batch with many stale tokens is not up-weighted.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean"]
KLKind = Literal["k1", "k2", "k3"]


def _check_same_shape(mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != tuple(mask.shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(mask.shape)} (the mask's)")


def masked_aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation = "token_mean",
                     *, count_mask: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` to a scalar over ``mask``.

    ``token_mean``: Σ values·mask / Σ count_mask (every token of the batch weighs the same; long
    responses weigh more). ``seq_mean``: each sequence's token mean, then the mean over sequences
    that have at least one token (every sequence weighs the same). ``count_mask`` (default
    ``mask``) is what the denominators count: AReaL's rejected tokens are 0 in ``mask`` but 1 in
    ``count_mask``. ``segments`` ([B, T] integers ≥ 0): the sequences of ``seq_mean`` are the
    (row, segment) pairs, e.g. the turns of an episode trained as one row. With no token at all
    the result is a zero that still carries a gradient.
    """
    count = mask if count_mask is None else count_mask
    v = torch.where(mask > 0, values, torch.zeros_like(values)) * mask
    if aggregation == "token_mean":
        n = count.sum()
        return v.sum() / n.clamp(min=1.0)
    if aggregation == "seq_mean":
        if segments is not None and v.numel():
            _check_same_shape(mask, segments=segments)
            per_row = int(segments.max()) + 1
            seq = (torch.arange(v.shape[0], device=v.device)[:, None] * per_row + segments.long()).reshape(-1)
            sums = torch.zeros(v.shape[0] * per_row, dtype=v.dtype, device=v.device).index_add(0, seq, v.reshape(-1))
            per_seq_n = torch.zeros_like(sums).index_add(0, seq, count.to(v.dtype).reshape(-1))
        else:
            sums, per_seq_n = v.sum(dim=-1), count.sum(dim=-1)
        has = per_seq_n > 0
        per_seq = sums / per_seq_n.clamp(min=1.0)
        n_seq = has.sum()
        return (per_seq * has).sum() / n_seq.clamp(min=1).to(per_seq.dtype)
    raise ValueError(f"aggregation must be 'token_mean' or 'seq_mean', got {aggregation!r}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = float(mask.sum())
    return float((torch.where(mask > 0, x, torch.zeros_like(x)) * mask).sum()) / n if n else 0.0


def decoupled_ppo_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor | None,
    logp_behav: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    behav_cap: float | None = None,
    behav_reject: float | None = None,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token_mean",
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss (scalar, to minimise) and its statistics.

    ``logp``: log π_θ of the sampled tokens (carries the gradient); ``logp_prox``: log π_prox
    (None: π_prox = π_b, i.e. ordinary PPO on the behaviour policy); ``logp_behav``: log π_b
    from the recorded rollout (None: w = 1). ``advantages``: ``[B]`` (one per sequence, spread
    over its tokens) or ``[B, T]``. ``dual_clip`` = c > 1 caps the loss of a negative-advantage
    token at c·|Â| (the ratio can no longer blow it up). ``segments``: see :func:`masked_aggregate`.
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    mask = mask.to(logp.dtype)
    _check_same_shape(mask, logp=logp, logp_prox=logp_prox, logp_behav=logp_behav)
    if advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise ValueError(f"advantages has {advantages.shape[0]} entries for {logp.shape[0]} sequences")
        advantages = advantages[:, None].expand_as(logp)
    _check_same_shape(mask, advantages=advantages)
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (c·|A| caps the negative-advantage loss), got {dual_clip}")
    if behav_cap is not None and behav_cap <= 0:
        raise ValueError(f"behav_cap must be > 0, got {behav_cap}")
    if behav_reject is not None and behav_reject <= 0:
        raise ValueError(f"behav_reject must be > 0, got {behav_reject}")

    on = mask > 0
    zero = torch.zeros_like(logp)
    adv = advantages.detach().to(logp.dtype)
    prox = (logp_prox if logp_prox is not None else (logp_behav if logp_behav is not None else logp)).detach()
    # Masked positions may hold anything (padding): keep them out of exp() so nothing overflows.
    log_ratio = torch.where(on, logp - prox, zero)
    ratio = torch.exp(log_ratio)

    if logp_behav is not None:
        behav_log_w = torch.where(on, prox - logp_behav.detach(), zero)
        w = torch.exp(behav_log_w)
    else:
        behav_log_w = zero
        w = torch.ones_like(logp)
    keep = mask
    rejected = torch.zeros_like(on)
    if behav_reject is not None:
        rejected = on & (w > behav_reject)
        keep = mask * (~rejected).to(mask.dtype)
        w = torch.where(rejected, zero, w)
    capped = torch.zeros_like(on)
    if behav_cap is not None:
        capped = on & ~rejected & (w > behav_cap)
        w = w.clamp(max=behav_cap)

    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = on & (pg_clipped > pg_unclipped)
    dual = torch.zeros_like(on)
    if dual_clip is not None:
        cap = dual_clip * adv.abs()
        dual = on & (adv < 0) & (pg > cap)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    per_token = w * pg
    loss = masked_aggregate(per_token, keep, aggregation, count_mask=mask, segments=segments)

    n_tok = float(mask.sum())

    def frac(b: torch.Tensor) -> float:
        return float((b & on).sum()) / n_tok if n_tok else 0.0

    stats = {
        "loss": float(loss.detach()),
        "tokens": n_tok,
        "clip_frac": frac(clipped),
        "dual_clip_frac": frac(dual),
        "behav_reject_frac": frac(rejected),
        "behav_cap_frac": frac(capped),
        "importance_weight_mean": _masked_mean(w.detach(), keep),
        "ratio_mean": _masked_mean(ratio.detach(), mask),
        # k1 estimates of KL(prox‖θ) and KL(b‖prox) on the sampled tokens: how far this update
        # moved, and how stale the samples are.
        "approx_kl": _masked_mean((prox - logp.detach()), mask),
        "behav_kl": _masked_mean(-behav_log_w.detach(), mask),
        "advantage_mean": _masked_mean(adv, mask),
    }
    return loss, stats


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, kind: KLKind = "k3",
               aggregation: Aggregation | None = "token_mean", *, segments: torch.Tensor | None = None) -> torch.Tensor:
    """KL(π_θ ‖ π_ref) estimated on tokens sampled from π_θ (Schulman's k1/k2/k3).

    With δ = log π_ref − log π_θ: k1 = −δ (unbiased, can be negative), k2 = δ²/2 (biased, low
    variance), k3 = exp(δ) − δ − 1 (unbiased, ≥ 0). Returns the aggregated scalar, or the
    per-token ``[B, T]`` values (0 off the mask) when ``aggregation`` is None.
    """
    mask = mask.to(logp.dtype)
    _check_same_shape(mask, logp=logp, logp_ref=logp_ref)
    on = mask > 0
    delta = torch.where(on, logp_ref.detach() - logp, torch.zeros_like(logp))
    if kind == "k1":
        kl = -delta
    elif kind == "k2":
        kl = 0.5 * delta.pow(2)
    elif kind == "k3":
        kl = torch.exp(delta) - delta - 1.0
    else:
        raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")
    kl = kl * mask
    if aggregation is None:
        return kl
    return masked_aggregate(kl, mask, aggregation, segments=segments)


def token_entropy(logits: torch.Tensor, *, chunk: int = 1024) -> torch.Tensor:
    """Entropy (nats) of the next-token distribution at each position: ``[B, T, V]`` → ``[B, T]``.

    H = logsumexp(z) − Σ softmax(z)·z, in float32 (bf16 logits lose the small probabilities);
    positions are processed ``chunk`` at a time so a 150k vocabulary does not need a full
    float32 copy of the logits.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    outs = []
    for s in range(0, logits.shape[1], max(1, chunk)):
        z = logits[:, s:s + chunk].float()
        lse = torch.logsumexp(z, dim=-1)
        p = torch.softmax(z, dim=-1)
        # a -inf logit (a masked vocabulary entry) has p = 0 and adds nothing, not 0·(−inf) = nan
        outs.append(lse - (p * torch.where(p > 0, z, torch.zeros_like(z))).sum(dim=-1))
    if not outs:
        return logits.new_zeros(logits.shape[:2], dtype=torch.float32)
    return torch.cat(outs, dim=1)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, *, chunk: int = 1024) -> torch.Tensor:
    """log π(token_ids[b, t] | ·) from ``logits[b, t]`` (already aligned: logits at t predict token t)."""
    if logits.dim() != 3 or token_ids.shape != logits.shape[:2]:
        raise ValueError(f"need logits [B, T, V] and token_ids [B, T], got {tuple(logits.shape)} and "
                         f"{tuple(token_ids.shape)}")
    outs = []
    for s in range(0, logits.shape[1], max(1, chunk)):
        z = logits[:, s:s + chunk].float()
        ids = token_ids[:, s:s + chunk].long()
        outs.append(z.gather(-1, ids[..., None]).squeeze(-1) - torch.logsumexp(z, dim=-1))
    if not outs:
        return logits.new_zeros(logits.shape[:2], dtype=torch.float32)
    return torch.cat(outs, dim=1)
