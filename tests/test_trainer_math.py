"""Trainer math against numbers worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from osfarm.trainer.advantages import group_std, grouped_advantages, grpo_advantages
from osfarm.trainer.allocation import (
    TaskStats,
    ci_half_width,
    dart_rollout_n,
    reward_std,
    student_t_quantile,
    xrpo_allocate,
    xrpo_priority,
)
from osfarm.trainer.losses import (
    decoupled_ppo_loss,
    gather_logprobs,
    kl_penalty,
    masked_aggregate,
    token_entropy,
)
from osfarm.trainer.selection import (
    select_high_entropy,
    surprisal_entropy,
    topk_entropy,
)
from osfarm.trainer.staleness import (
    StalenessGate,
    accepted_after_resume,
    in_version_window,
    staleness_capacity,
)

LN2 = math.log(2.0)


def approx(x, rel=1e-5, abs=1e-6):
    return pytest.approx(x, rel=rel, abs=abs)


# ---------------------------------------------------------------- advantages

def test_grpo_population_std():
    # rewards [1,0,0,1]: mean 0.5; deviations ±0.5; population var = 4·0.25/4 = 0.25 → std 0.5
    # → A = ±0.5/0.5 = [1,-1,-1,1] (up to eps = 1e-6 in the denominator)
    assert group_std([1, 0, 0, 1]) == approx(0.5)
    assert grpo_advantages([1, 0, 0, 1]) == approx([1, -1, -1, 1])


def test_grpo_sample_std_matches_verl():
    # sample var = 4·0.25/(4−1) = 1/3 → std 0.57735; A = 0.5/0.57735 = 0.866025
    assert group_std([1, 0, 0, 1], unbiased=True) == approx(math.sqrt(1 / 3))
    assert grpo_advantages([1, 0, 0, 1], unbiased=True) == approx([0.866025, -0.866025, -0.866025, 0.866025])


def test_grpo_one_success_of_four():
    # [1,0,0,0]: mean 0.25; deviations [0.75,-0.25,-0.25,-0.25]; var = (0.5625+3·0.0625)/4 = 0.1875
    # std = 0.433013 → A = [1.732051, -0.577350, -0.577350, -0.577350]
    assert grpo_advantages([1, 0, 0, 0]) == approx([1.732051, -0.577350, -0.577350, -0.577350])


def test_dr_grpo_drops_std():
    # Dr.GRPO: A = R − mean = [0.75, -0.25, -0.25, -0.25]
    assert grpo_advantages([1, 0, 0, 0], std_normalize=False) == approx([0.75, -0.25, -0.25, -0.25])


def test_degenerate_groups_give_zero():
    # all equal: deviations 0, std 0 → 0/(0+eps) = 0; one member: the same
    assert grpo_advantages([1, 1, 1]) == [0.0, 0.0, 0.0]
    assert grpo_advantages([0.3]) == [0.0]
    assert grpo_advantages([]) == []


def test_grouped_advantages_and_bad_input():
    # group a: [1,0] → mean .5, std .5 → [1,-1]; group b: [0.5] → [0]
    assert grouped_advantages([1, 0.5, 0], ["a", "b", "a"]) == approx([1, 0, -1])
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        grpo_advantages([1, float("nan")])
    with pytest.raises(ValueError, match="group ids"):
        grouped_advantages([1, 0], ["a"])


# ---------------------------------------------------------------- decoupled PPO

def _tokens(ratios, prox=None):
    """logp and logp_prox [1, T] whose ratio exp(logp − prox) is ``ratios``."""
    prox = torch.tensor([prox or [-1.0] * len(ratios)])
    logp = (prox + torch.log(torch.tensor([ratios]))).clone().requires_grad_(True)
    return logp, prox


def test_ppo_positive_advantage_clips_high_ratios_only():
    # clip range [1−0.2, 1+0.28] = [0.8, 1.28]; A = +1; w = 1 (behaviour = proximal)
    # r=1.0: max(-1.0, -1.0)  = -1.0
    # r=1.5: max(-1.5, -1.28) = -1.28  (clipped → no gradient)
    # r=0.5: max(-0.5, -0.8)  = -0.5   (A>0: a low ratio is not clipped)
    # r=1.1: max(-1.1, -1.1)  = -1.1
    # token mean = (-1 - 1.28 - 0.5 - 1.1)/4 = -3.88/4 = -0.97
    logp, prox = _tokens([1.0, 1.5, 0.5, 1.1])
    loss, st = decoupled_ppo_loss(logp, prox, prox, torch.tensor([1.0]), torch.ones(1, 4))
    assert loss.item() == approx(-0.97)
    assert st["clip_frac"] == approx(0.25)
    loss.backward()
    # d/dlogp of -A·r/4 = -r/4: [-0.25, 0 (clipped), -0.125, -0.275]
    assert logp.grad[0].tolist() == approx([-0.25, 0.0, -0.125, -0.275])


def test_ppo_negative_advantage_and_dual_clip():
    # A = -1: r=1 → max(1, 1) = 1; r=1.5 → max(1.5, 1.28) = 1.5; r=0.5 → max(0.5, 0.8) = 0.8
    # (clipped, no gradient); r=1.1 → 1.1. Mean = (1 + 1.5 + 0.8 + 1.1)/4 = 1.1
    logp, prox = _tokens([1.0, 1.5, 0.5, 1.1])
    loss, st = decoupled_ppo_loss(logp, prox, prox, torch.tensor([-1.0]), torch.ones(1, 4))
    assert loss.item() == approx(1.1)
    loss.backward()
    # d/dlogp of -A·r/4 = r/4: [0.25, 0.375, 0 (clipped), 0.275]
    assert logp.grad[0].tolist() == approx([0.25, 0.375, 0.0, 0.275])
    # dual clip c = 1.4 caps each token at c·|A| = 1.4: r=1.5's 1.5 → 1.4 (no gradient)
    # mean = (1 + 1.4 + 0.8 + 1.1)/4 = 4.3/4 = 1.075
    logp, prox = _tokens([1.0, 1.5, 0.5, 1.1])
    loss, st = decoupled_ppo_loss(logp, prox, prox, torch.tensor([-1.0]), torch.ones(1, 4), dual_clip=1.4)
    assert loss.item() == approx(1.075)
    assert st["dual_clip_frac"] == approx(0.25)
    loss.backward()
    assert logp.grad[0].tolist() == approx([0.25, 0.0, 0.0, 0.275])


def test_asymmetric_clip_bounds():
    # clip_low 0.1, clip_high 0.28, A = -1: r = 0.85 is below 1 − 0.1 = 0.9 → clipped to 0.9:
    # max(0.85, 0.9) = 0.9. With the default clip_low 0.2 (bound 0.8) it is not clipped: 0.85.
    logp, prox = _tokens([0.85])
    loss, st = decoupled_ppo_loss(logp, prox, prox, torch.tensor([-1.0]), torch.ones(1, 1), clip_low=0.1)
    assert loss.item() == approx(0.9) and st["clip_frac"] == 1.0
    loss, st = decoupled_ppo_loss(logp, prox, prox, torch.tensor([-1.0]), torch.ones(1, 1))
    assert loss.item() == approx(0.85) and st["clip_frac"] == 0.0


def test_behaviour_weight_truncation_and_rejection():
    # r = 1 everywhere (logp = prox), A = +1 → each token's clipped term is -1, times w.
    # w = π_prox/π_b = [1, 4, 0.5, 8] (logp_behav = prox − ln w)
    # no bound:          -(1 + 4 + 0.5 + 8)/4 = -13.5/4 = -3.375
    # DART cap C = 1:    w → [1, 1, 0.5, 1]: -3.5/4 = -0.875   (2 of 4 tokens capped)
    # AReaL reject > 5:  w → [1, 4, 0.5, 0]: -5.5/4 = -1.375   (denominator still 4 tokens)
    w = torch.tensor([[1.0, 4.0, 0.5, 8.0]])
    prox = torch.full((1, 4), -2.0)
    behav = prox - torch.log(w)
    adv, mask = torch.tensor([1.0]), torch.ones(1, 4)
    loss, st = decoupled_ppo_loss(prox.clone(), prox, behav, adv, mask)
    assert loss.item() == approx(-3.375)
    assert st["importance_weight_mean"] == approx(13.5 / 4)
    loss, st = decoupled_ppo_loss(prox.clone(), prox, behav, adv, mask, behav_cap=1.0)
    assert loss.item() == approx(-0.875) and st["behav_cap_frac"] == approx(0.5)
    logp = prox.clone().requires_grad_(True)
    loss, st = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_reject=5.0)
    assert loss.item() == approx(-1.375) and st["behav_reject_frac"] == approx(0.25)
    loss.backward()
    # gradient of -w·r/4 at r = 1: -w/4 = [-0.25, -1, -0.125, 0 (rejected)]
    assert logp.grad[0].tolist() == approx([-0.25, -1.0, -0.125, 0.0])


def test_no_gradient_through_proximal_or_behaviour():
    logp, prox = _tokens([1.2])
    prox.requires_grad_(True)
    behav = (prox.detach() - 0.3).requires_grad_(True)
    loss, _ = decoupled_ppo_loss(logp, prox, behav, torch.tensor([1.0]), torch.ones(1, 1))
    loss.backward()
    assert prox.grad is None and behav.grad is None and logp.grad is not None


def test_token_mean_vs_seq_mean_and_padding():
    # row 0: 1 token, A = +2 → loss -2 (r = w = 1); row 1: 3 tokens, A = -1 → 1 each; one pad
    # token_mean = (-2 + 1 + 1 + 1)/4 = 0.25; seq_mean = mean(-2, (1+1+1)/3) = (-2 + 1)/2 = -0.5
    prox = torch.full((2, 4), -1.0)
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0]])
    logp = prox.clone()
    logp[0, 3] = 80.0  # garbage on a padded position must not leak (exp(81) would be inf·0 = nan)
    adv = torch.tensor([2.0, -1.0])
    loss, st = decoupled_ppo_loss(logp, prox, prox, adv, mask)
    assert loss.item() == approx(0.25) and st["tokens"] == 4
    loss, _ = decoupled_ppo_loss(logp, prox, prox, adv, mask, aggregation="seq_mean")
    assert loss.item() == approx(-0.5)
    # per-token advantages [B, T] give the same as the broadcast [B] ones
    loss2, _ = decoupled_ppo_loss(logp, prox, prox, adv[:, None].expand(2, 4).clone(), mask)
    assert loss2.item() == approx(0.25)


def test_empty_mask_and_bad_shapes():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, st = decoupled_ppo_loss(logp, logp.detach(), logp.detach(), torch.ones(2), torch.zeros(2, 3))
    assert loss.item() == 0.0 and st["tokens"] == 0
    loss.backward()  # still differentiable
    with pytest.raises(ValueError, match="logp_prox has shape"):
        decoupled_ppo_loss(logp, torch.zeros(2, 4), None, torch.ones(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages has 3 entries"):
        decoupled_ppo_loss(logp, None, None, torch.ones(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="aggregation"):
        decoupled_ppo_loss(logp, None, None, torch.ones(2), torch.ones(2, 3), aggregation="sum")
    with pytest.raises(ValueError, match="dual_clip"):
        decoupled_ppo_loss(logp, None, None, torch.ones(2), torch.ones(2, 3), dual_clip=0.5)


def test_masked_aggregate_seq_mean_skips_empty_rows():
    # rows: [2, 4] → 3; [] → skipped; [6] → 6; seq_mean = (3 + 6)/2 = 4.5; token_mean = 12/3 = 4
    v = torch.tensor([[2.0, 4.0], [9.0, 9.0], [6.0, 0.0]])
    m = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    assert masked_aggregate(v, m, "seq_mean").item() == approx(4.5)
    assert masked_aggregate(v, m, "token_mean").item() == approx(4.0)


# ---------------------------------------------------------------- KL and entropy

def test_kl_estimators():
    # token 0: π_θ = 0.5, π_ref = 0.25 → δ = ln(0.25/0.5) = -ln 2 = -0.693147
    #   k1 = -δ = 0.693147; k2 = δ²/2 = 0.240227; k3 = e^δ − δ − 1 = 0.5 + 0.693147 − 1 = 0.193147
    # token 1: equal probabilities → 0; token 2 is masked. Token mean over 2 tokens halves each.
    logp = torch.tensor([[math.log(0.5), math.log(0.3), 5.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.3), -5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    per = kl_penalty(logp, ref, mask, "k1", aggregation=None)
    assert per[0].tolist() == approx([LN2, 0.0, 0.0])
    assert kl_penalty(logp, ref, mask, "k1").item() == approx(LN2 / 2)
    assert kl_penalty(logp, ref, mask, "k2").item() == approx(0.5 * LN2**2 / 2)
    k3 = kl_penalty(logp, ref, mask, "k3")
    assert k3.item() == approx((0.5 + LN2 - 1) / 2)
    k3.backward()
    # d k3/d logp = 1 − e^δ = 1 − 0.5 = 0.5, over 2 tokens → 0.25; token 1: 1 − 1 = 0
    assert logp.grad[0].tolist() == approx([0.25, 0.0, 0.0])
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, mask, "k4")


def test_token_entropy():
    # uniform over 4: ln 4 = 1.386294
    # p = [0.25, 0.25, 0.5] (logits ln1, ln1, ln2): H = 2·0.25·ln4 + 0.5·ln2 = 0.693147 + 0.346574 = 1.039721
    # near one-hot (logit 100 vs 0): ≈ 0
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, LN2, -float("inf")], [100.0, 0.0, 0.0, 0.0]]])
    h = token_entropy(logits, chunk=2)
    assert h.shape == (1, 3)
    assert h[0].tolist() == approx([math.log(4), 1.039721, 0.0], abs=1e-5)
    assert token_entropy(logits.to(torch.bfloat16)).dtype == torch.float32


def test_gather_logprobs():
    # logits [0, 0, ln2] → p = [0.25, 0.25, 0.5]: token 2 → ln 0.5, token 0 → ln 0.25
    logits = torch.tensor([[[0.0, 0.0, LN2], [0.0, 0.0, LN2]]])
    lp = gather_logprobs(logits, torch.tensor([[2, 0]]), chunk=1)
    assert lp[0].tolist() == approx([math.log(0.5), math.log(0.25)])


# ---------------------------------------------------------------- staleness



def test_staleness_capacity_rule():
    # η = 1, batch 4, version 0: (1 + 0 + 1)·4 = 8 rollouts may be accepted or running
    assert staleness_capacity(version=0, eta=1, batch_size=4, accepted=0, running=0) == 8
    # 3 accepted + 4 running → 8 − 7 = 1 more
    assert staleness_capacity(version=0, eta=1, batch_size=4, accepted=3, running=4) == 1
    # the farm has 6 environments and 4 are busy: min(6 − 4, 1) = 1; with 5 busy: min(1, 0) = 0
    assert staleness_capacity(version=0, eta=1, batch_size=4, accepted=3, running=4, max_concurrent=6) == 1
    assert staleness_capacity(version=0, eta=1, batch_size=4, accepted=3, running=5, max_concurrent=6) == 0
    # synchronous (η = 0) at version 2 after 8 consumed: (0 + 2 + 1)·4 − 8 = 4 = exactly one batch
    assert staleness_capacity(version=2, eta=0, batch_size=4, accepted=8, running=0) == 4
    with pytest.raises(ValueError, match="eta"):
        staleness_capacity(version=0, eta=-1, batch_size=4, accepted=0, running=0)


def test_version_window():
    # current 5, window 2: versions 3, 4, 5 are in; 2 is out; unknown is out
    assert [in_version_window(v, 5, 2) for v in (2, 3, 5)] == [False, True, True]
    assert in_version_window(None, 5, 2) is False


def test_staleness_gate_resume_resets_accepted(tmp_path):
    g = StalenessGate(eta=2, batch_size=4)
    g.submit(12)           # (2 + 0 + 1)·4 = 12: the gate is full
    assert g.capacity() == 0
    for _ in range(10):
        g.accept()
    g.reject(2)            # rejected rollouts give their slots back: 12 − (10 + 0) = 2
    assert g.capacity() == 2
    g.set_version(1)       # (2 + 1 + 1)·4 − 10 = 6
    assert g.capacity() == 6
    g.save(tmp_path / "st.json")
    # resume: accepted = version·batch = 4 (not 10, not 0), running = 0 → (2+1+1)·4 − 4 = 12
    assert accepted_after_resume(1, 4) == 4
    g2 = StalenessGate.load(tmp_path / "st.json", eta=2, batch_size=4)
    assert (g2.state.version, g2.state.accepted, g2.state.running) == (1, 4, 0)
    assert g2.capacity() == 12
    with pytest.raises(ValueError, match="backwards"):
        g2.set_version(0)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a staleness state file"):
        StalenessGate.load(tmp_path / "bad.json", eta=2, batch_size=4)


# ---------------------------------------------------------------- allocation

def test_dart_rollout_n():
    # below threshold 0.6 (or unknown): the full 8; else max(1, int(9/sr − 7)):
    # sr 0.6 → 15 − 7 = 8; 0.7 → 12.857 − 7 = 5.857 → 5; 0.8 → 11.25 − 7 → 4; 0.9 → 10 − 7 = 3; 1.0 → 2
    assert [dart_rollout_n(s) for s in (None, 0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)] == [8, 8, 8, 8, 5, 4, 3, 2]
    assert dart_rollout_n(1.0, rollout_n=16, threshold=0.9) == 2


def test_task_stats_window():
    st = TaskStats(window=3)
    for r in (1, 0, 0, 1):
        st.add(r, r == 1)
    # lifetime 4 episodes, 2 successes; recent window keeps the last 3: [0, 0, 1] → 1/3
    assert (st.episodes, st.successes, st.recent) == (4, 2, [0.0, 0.0, 1.0])
    assert st.success_rate == approx(1 / 3)
    assert TaskStats.from_json(st.to_json()) == st


def test_student_t_quantiles_match_tables():
    # two-sided 95% critical values from any t table
    table = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 10: 2.2281, 30: 2.0423}
    for df, t in table.items():
        assert student_t_quantile(0.975, df) == approx(t, rel=1e-4)
    assert student_t_quantile(0.025, 4) == approx(-2.7764, rel=1e-4)


def test_xrpo_priorities_and_allocation():
    # A: rewards [1, 0] → Laplace p̃ = (1+1)/(2+2) = 0.5, s = 0.5
    # B: rewards [0, 0, 0, 0] → p̃ = 1/6, s = √(1/6 · 5/6) = 0.372678
    assert reward_std([1, 0]) == approx(0.5)
    assert reward_std([0, 0, 0, 0]) == approx(math.sqrt(5) / 6)
    assert reward_std([1, 0], "sample") == approx(math.sqrt(0.5))
    # h(n) = t_{0.975,n−1}·s/√n. A at n=2: 0.5·(12.7062/√2 − 4.3027/√3) = 0.5·(8.98464 − 2.48417) = 3.25024
    assert ci_half_width(2, 0.5) == approx(12.7062 * 0.5 / math.sqrt(2), rel=1e-4)
    assert xrpo_priority(2, 0.5, 6) == approx(3.25024, rel=1e-4)
    # B at n=4: 0.372678·(3.18245/2 − 2.77645/√5) = 0.372678·(1.591225 − 1.241665) = 0.130272
    assert xrpo_priority(4, math.sqrt(5) / 6, 6) == approx(0.130272, rel=1e-4)
    # A after more rollouts: n=3: 0.5·(2.48417 − 1.59122) = 0.44647; n=4: 0.5·(1.59122 − 1.24166) = 0.17478
    # (both > B's 0.1303); n=5: 0.5·(1.24166 − 2.57058/√6) = 0.5·(1.24166 − 1.04944) = 0.09611 < 0.1303
    # so a budget of 5 with base 0 goes A, A, A (n 2→5), then B (n 4→5: priority 0.372678·0.19223
    # = 0.07164), then A (0.09611 > 0.07164): A 4, B 1
    assert xrpo_allocate({"A": [1, 0], "B": [0, 0, 0, 0]}, 5, base=0) == {"A": 4, "B": 1}
    # base first: 2 each, then the remaining 1 to A (n=4: 0.17478) over B (n=6:
    # 0.372678·(2.57058/√6 − 2.44691/√7) = 0.372678·(1.04944 − 0.92485) = 0.04643)
    assert xrpo_allocate({"A": [1, 0], "B": [0, 0, 0, 0]}, 5, base=2) == {"A": 3, "B": 2}
    # a never-tried task (n < 2) has infinite priority
    assert xrpo_allocate({"A": [1, 0, 1, 0], "new": []}, 2, base=0) == {"A": 0, "new": 2}
    # the exploration bonus λ√(ln T / n) favours the task with fewer rollouts
    assert xrpo_priority(4, 0.0, 10, lam=1.0) == approx(math.sqrt(math.log(10) / 4))


# ---------------------------------------------------------------- entropy selection

def test_high_entropy_selection():
    # entropies [0.1, 0.9, 0.5, None, 0.9]; fraction 0.5 of the 4 known → ceil(2) = 2 kept:
    # the two 0.9s (indices 1 and 4); the unknown one (index 3) is always kept
    assert select_high_entropy([0.1, 0.9, 0.5, None, 0.9], 0.5) == [False, True, False, True, True]
    # fraction 0.8 of 5 → ceil(4.0) = 4: all but the lowest
    assert select_high_entropy([0.3, 0.2, 0.5, 0.4, 0.1], 0.8) == [True, True, True, True, False]
    # ties go to the earlier step: fraction 0.4 of 3 → ceil(1.2) = 2 → indices 0 and 1 of three equal
    assert select_high_entropy([0.5, 0.5, 0.5], 0.4) == [True, True, False]
    assert select_high_entropy([0.1, 0.2], 1.0) == [True, True]
    assert select_high_entropy([0.1, 0.2], 0.0) == [False, False]
    with pytest.raises(ValueError, match="fraction"):
        select_high_entropy([0.1], 1.5)


def test_entropy_proxies():
    # surprisal: mean of −logp over [-0.1, -0.5, {"logprob": -1.2}] = 1.8/3 = 0.6
    assert surprisal_entropy([-0.1, -0.5, {"logprob": -1.2}]) == approx(0.6)
    assert surprisal_entropy([]) is None
    # top-2 logprobs ln .5, ln .5 → uniform over 2: ln 2; one token → mean = ln 2
    tok = {"logprob": math.log(0.5), "top_logprobs": [{"logprob": math.log(0.5)}, {"logprob": math.log(0.5)}]}
    assert topk_entropy([tok]) == approx(LN2)
    assert topk_entropy([-0.3]) is None


def test_lr_schedule_warmup_and_decay():
    from osfarm.trainer.schedule import lr_factor

    assert [lr_factor(s, warmup=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(2, kind="linear", warmup=2, total=6) == 1.0
    assert lr_factor(4, kind="linear", warmup=2, total=6) == pytest.approx(0.5)
    assert lr_factor(9, kind="linear", warmup=2, total=6, min_ratio=0.1) == pytest.approx(0.1)  # held at the end
    assert lr_factor(4, kind="cosine", warmup=2, total=6) == pytest.approx(0.5)
    assert lr_factor(6, kind="cosine", total=6, min_ratio=0.2) == pytest.approx(0.2)
    assert lr_factor(100, kind="cosine") == 1.0  # no total: nothing to decay over
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(3, kind="step", total=5)


def test_xrpo_sharpening():
    from osfarm.trainer.advantages import sharpen_advantages

    adv = grpo_advantages([1, 1, 0, 0], eps=0.0)  # [1, 1, -1, -1]
    lls = [-0.1, -3.0, -1.0, -1.0]  # mean -1.275
    out = sharpen_advantages(adv, [True, True, False, False], lls, 0.5)
    assert out[0] == pytest.approx(1.0)  # a success the policy already found likely: unchanged
    assert out[1] == pytest.approx(1.0 * (1 + 0.5 * math.tanh(1.725)))  # an unlikely success: amplified
    assert out[2:] == pytest.approx([-1.0, -1.0])  # failures never
    assert sharpen_advantages(adv, [True, True, False, False], lls, 0.0) == pytest.approx(adv)
    assert sharpen_advantages(adv, [True] * 4, [None] * 4, 1.0) == pytest.approx(adv)  # nothing recorded
    assert max(sharpen_advantages([1.0, 1.0], [True, True], [-100.0, 0.0], 0.5)) <= 1.5  # bounded by 1 + λ
    with pytest.raises(ValueError):
        sharpen_advantages(adv, [True] * 3, lls, 0.5)


def test_dart_dynamic_trajectory_length():
    from osfarm.trainer.allocation import dart_max_steps

    st = TaskStats()
    assert dart_max_steps(None, 15) == 15 and dart_max_steps(st, 15) == 15  # never solved: all the room
    st.add(0.0, False, 15)
    st.add(1.0, True, 4)
    assert st.success_steps == [4]
    assert dart_max_steps(st, 15) == 6  # ceil(1.5 × 4)
    st.add(1.0, True, 12)
    assert dart_max_steps(st, 15) == 15  # capped
    assert dart_max_steps(st, 15, margin=1.0) == 12
    back = TaskStats.from_json(st.to_json())
    assert back.success_steps == [4, 12]


def test_capacity_counts_what_was_consumed():
    # every update took one batch: the classic rule
    assert staleness_capacity(version=3, eta=1, batch_size=8, accepted=30, running=2) == \
        staleness_capacity(version=3, eta=1, batch_size=8, accepted=30, running=2, consumed=24)
    # whole groups: an update took 10 (groups of 5); the slack keeps room for the group it waits for
    assert staleness_capacity(version=1, eta=0, batch_size=8, accepted=10, running=0, consumed=10) == 8
    assert staleness_capacity(version=0, eta=0, batch_size=8, accepted=5, running=3, consumed=0, slack=4) == 4
