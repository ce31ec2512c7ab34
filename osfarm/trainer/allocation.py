"""How many rollouts each task gets, and how long they may run: DART's dynamic rollout number and
trajectory length, and an XRPO-style allocator.

DART-GUI's data curation (its dynamic rollout number and trajectory length): a task whose success rate sr is below
a threshold gets the full ``rollout_n`` (8); an easier one gets max(1, int(9/sr − 7)) — fewer
rollouts where a group would mostly be all-success and carry no GRPO signal (sr = 1 → 2). With
the default threshold 0.6 the two branches meet (9/0.6 − 7 = 8).

XRPO: spend a rollout budget where it most shrinks the uncertainty of a task's success estimate.
With n rollouts and std s, the half-width of the (1 − α) confidence interval is
h(n) = t_{1−α/2, n−1}·s/√n; one more rollout shrinks it by h(n) − h(n + 1); an exploration
bonus λ·√(ln T / n) (T = all rollouts so far) keeps rarely tried tasks in play. Every task first
gets a base number, then the budget goes one rollout at a time to the highest priority.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

# --------------------------------------------------------------------------- task statistics


@dataclass
class TaskStats:
    """A task's outcomes: lifetime counts plus the last ``window`` rewards (the success estimate)."""

    episodes: int = 0
    successes: int = 0
    recent: list[float] = field(default_factory=list)
    window: int = 32
    success_steps: list[int] = field(default_factory=list)  # lengths of the recent successes

    def add(self, reward: float, success: bool, steps: int | None = None) -> None:
        self.episodes += 1
        self.successes += bool(success)
        self.recent.append(float(reward))
        del self.recent[:-self.window]
        if success and steps:
            self.success_steps.append(int(steps))
            del self.success_steps[:-self.window]

    @property
    def success_rate(self) -> float | None:
        """Mean recent reward (the success rate for 0/1 rewards); None before any episode."""
        return sum(self.recent) / len(self.recent) if self.recent else None

    def to_json(self) -> dict:
        return {"episodes": self.episodes, "successes": self.successes, "recent": self.recent, "window": self.window,
                "success_steps": self.success_steps}

    @classmethod
    def from_json(cls, d: Mapping) -> TaskStats:
        return cls(int(d.get("episodes", 0)), int(d.get("successes", 0)), [float(x) for x in d.get("recent", [])],
                   int(d.get("window", 32)), [int(x) for x in d.get("success_steps", [])])


# --------------------------------------------------------------------------- DART


def dart_rollout_n(success_rate: float | None, *, rollout_n: int = 8, threshold: float = 0.6) -> int:
    """Rollouts for a task with this success rate (None: never tried → ``rollout_n``)."""
    if success_rate is None or success_rate < threshold or success_rate <= 0:
        return rollout_n
    return max(1, min(rollout_n, int(9.0 / success_rate - 7.0)))


def dart_max_steps(stats: TaskStats | None, max_steps: int, *, margin: float = 1.5, min_steps: int = 1) -> int:
    """DART's dynamic trajectory length: a task's step limit follows its successful trajectories.

    A task never solved keeps the full ``max_steps`` (exploration needs room); a solved one gets
    ``ceil(margin × its longest recent success)`` (at least ``min_steps``, at most ``max_steps``):
    desktops are not held for the long wandering tails of easy tasks, while a run a little longer
    than any success so far still fits.
    """
    if stats is None or not stats.success_steps:
        return max_steps
    return max(min_steps, min(max_steps, math.ceil(margin * max(stats.success_steps))))


# --------------------------------------------------------------------------- Student t quantile


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            delta = d * c
            h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@lru_cache(maxsize=4096)  # the allocator asks for the same (p, df) pairs over and over
def student_t_quantile(p: float, df: float) -> float:
    """t with P(T ≤ t) = p for Student's t with ``df`` degrees of freedom (bisection on the cdf)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"need 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# --------------------------------------------------------------------------- XRPO

StdMode = Literal["laplace", "sample"]


def reward_std(rewards: Sequence[float], mode: StdMode = "laplace") -> float:
    """The spread s used by the allocator.

    ``laplace`` (default, for rewards in [0, 1]): s = √(p̃(1 − p̃)) with p̃ = (Σr + 1)/(n + 2), so a
    task seen failing twice is still uncertain (its sample std would be 0 and it would never get
    another rollout). ``sample``: the sample std (XRPO's s; 0 for fewer than 2 rewards).
    """
    n = len(rewards)
    if mode == "laplace":
        p = (sum(rewards) + 1.0) / (n + 2.0)
        return math.sqrt(max(0.0, p * (1.0 - p)))
    if mode == "sample":
        if n < 2:
            return 0.0
        m = sum(rewards) / n
        return math.sqrt(sum((r - m) ** 2 for r in rewards) / (n - 1))
    raise ValueError(f"std mode must be 'laplace' or 'sample', got {mode!r}")


def ci_half_width(n: int, s: float, alpha: float = 0.05) -> float:
    """h(n) = t_{1−α/2, n−1}·s/√n; infinite for n < 2 (no interval from one sample)."""
    if n < 2:
        return math.inf
    return student_t_quantile(1.0 - alpha / 2.0, n - 1) * s / math.sqrt(n)


def xrpo_priority(n: int, s: float, total: int, *, alpha: float = 0.05, lam: float = 0.0) -> float:
    """Expected shrink of the interval from one more rollout, plus the exploration bonus."""
    if n < 2:
        return math.inf
    bonus = lam * math.sqrt(math.log(max(total, 1)) / n) if lam else 0.0
    return ci_half_width(n, s, alpha) - ci_half_width(n + 1, s, alpha) + bonus


def xrpo_allocate(rewards: Mapping[str, Sequence[float]], budget: int, *, base: int = 2, alpha: float = 0.05,
                  lam: float = 0.0, std_mode: StdMode = "laplace") -> dict[str, int]:
    """Split ``budget`` new rollouts among tasks (``rewards``: each task's rewards so far).

    Each task first gets ``base`` (in the given order while the budget lasts), then rollouts go
    one at a time to the highest :func:`xrpo_priority` (ties: the earlier task). A task's s is
    taken from its rewards so far and held fixed while planning.
    """
    if budget < 0 or base < 0:
        raise ValueError(f"budget and base must be >= 0, got budget={budget}, base={base}")
    tasks = list(rewards)
    alloc = {t: 0 for t in tasks}
    left = budget
    for t in tasks:
        give = min(base, left)
        alloc[t] += give
        left -= give
    if not tasks:
        return alloc
    s = {t: reward_std(rewards[t], std_mode) for t in tasks}
    total = sum(len(r) for r in rewards.values()) + (budget - left)
    while left > 0:
        best, best_p = tasks[0], -math.inf
        for t in tasks:
            p = xrpo_priority(len(rewards[t]) + alloc[t], s[t], total, alpha=alpha, lam=lam)
            if p > best_p:
                best, best_p = t, p
        alloc[best] += 1
        left -= 1
        total += 1
    return alloc
