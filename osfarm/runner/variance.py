"""How much a score moves between repeats of one run, and whether two runs really differ.

Pure functions over episode outcomes (task, repeat, success), so each number can be checked by
hand in a unit test; ``osfarm eval --repeats``, ``osfarm report compare`` and the dashboard all
compute them here.

* **mean ± standard error across repeats**: the success rate of each repeat (over its tasks),
  averaged; the s.e. is their sample standard deviation over sqrt(K). With K = 1 there is no s.e.
* **pass@k** (Chen et al. 2021, the unbiased estimator): with n samples of a task and c
  successes, 1 - C(n-c, k) / C(n, k) is the chance that at least one of k samples drawn from them
  succeeds; averaged over tasks.
* **pass^k**: C(c, k) / C(n, k), the chance that all k succeed (how reliably the agent solves it).
* **flip rate**: the share of tasks (with at least two repeats) whose repeats disagree.
* **paired test over tasks** of runs A and B: the per-task success rates of both runs are
  paired by task and d_t = rate_B(t) - rate_A(t). Under the null (the agents are exchangeable on
  every task) each d_t's sign is a coin flip, so the exact sign-flip permutation distribution of
  sum(d_t) gives the p-value. It assumes no distribution of d (which is bounded, lumpy and mostly
  0, where a t-test or Wilcoxon's normal approximation and tie handling are poor), uses tasks as
  the unit (tasks differ far more than repeats) and with K = 1 on both sides, where d_t is -1, 0
  or 1, it *is* the exact McNemar test on the discordant tasks. The mean difference comes with a
  95% Student-t interval over tasks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

Z975 = 1.959963984540054


@dataclass(frozen=True)
class Outcome:
    """One episode: its task, which repeat (1-based) and whether it succeeded."""

    task_id: str
    repeat: int
    ok: bool


@dataclass(frozen=True)
class TaskCount:
    """A task's repeats: ``n`` episodes, ``c`` of them successes."""

    n: int
    c: int

    @property
    def rate(self) -> float:
        return self.c / self.n if self.n else 0.0


def task_counts(outcomes: Iterable[Outcome]) -> dict[str, TaskCount]:
    """Per task: how many episodes and how many succeeded (first-seen task order)."""
    counts: dict[str, list[int]] = {}
    for o in outcomes:
        nc = counts.setdefault(o.task_id, [0, 0])
        nc[0] += 1
        nc[1] += bool(o.ok)
    return {t: TaskCount(n, c) for t, (n, c) in counts.items()}


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """The mean and its standard error (sample sd / sqrt(n)); no s.e. under two values."""
    if not values:
        return 0.0, None
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    _check_nck(n, c, k)
    if n - c < k:  # every draw of k holds a success
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k of one task: C(c, k) / C(n, k), the chance that k draws all succeed."""
    _check_nck(n, c, k)
    return math.comb(c, k) / math.comb(n, k)


def _check_nck(n: int, c: int, k: int) -> None:
    if not 0 <= c <= n:
        raise ValueError(f"successes c={c} must be between 0 and the samples n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be between 1 and the samples n={n}")


def flip_rate(counts: dict[str, TaskCount]) -> float | None:
    """Share of the tasks with two or more repeats whose repeats disagree; None when there are none."""
    repeated = [tc for tc in counts.values() if tc.n >= 2]
    if not repeated:
        return None
    return sum(0 < tc.c < tc.n for tc in repeated) / len(repeated)


@dataclass(frozen=True)
class RepeatStats:
    tasks: int
    repeats: int  # the most episodes any task has
    k: int  # pass@k / pass^k use the fewest episodes any task has
    mean: float  # mean over repeats of the repeat's success rate
    se: float | None  # its standard error (None with one repeat)
    pass_at_k: float
    pass_hat_k: float
    flip_rate: float | None
    flipped: int  # tasks whose repeats disagree

    def text(self) -> str:
        se = f" ± {self.se:.1%}" if self.se is not None else ""
        flips = f"{self.flip_rate:.1%} ({self.flipped}/{self.tasks})" if self.flip_rate is not None else "–"
        return (f"{self.mean:.1%}{se} over {self.repeats} repeat(s) of {self.tasks} tasks; "
                f"pass@{self.k} {self.pass_at_k:.1%}, pass^{self.k} {self.pass_hat_k:.1%}, flip rate {flips}")


def repeat_stats(outcomes: Iterable[Outcome]) -> RepeatStats | None:
    """The run's numbers across repeats; None for a run without episodes."""
    outs = list(outcomes)
    counts = task_counts(outs)
    if not counts:
        return None
    by_repeat: dict[int, list[bool]] = {}
    for o in outs:
        by_repeat.setdefault(o.repeat, []).append(o.ok)
    mean, se = mean_se([sum(v) / len(v) for _, v in sorted(by_repeat.items())])
    k = min(tc.n for tc in counts.values())
    return RepeatStats(
        tasks=len(counts), repeats=max(tc.n for tc in counts.values()), k=k, mean=mean, se=se,
        pass_at_k=sum(pass_at_k(tc.n, tc.c, k) for tc in counts.values()) / len(counts),
        pass_hat_k=sum(pass_hat_k(tc.n, tc.c, k) for tc in counts.values()) / len(counts),
        flip_rate=flip_rate(counts), flipped=sum(0 < tc.c < tc.n for tc in counts.values()))


def _t_mass(t: float, df: int) -> float:
    """P(0 <= T <= t) for Student's t with ``df`` degrees of freedom (Simpson's rule on its density)."""
    x = np.linspace(0.0, t, 4001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    y = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    h = t / 4000
    return float(h / 3 * (y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum()))


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (bisection on its CDF;
    no scipy in the core install)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    lo, hi = Z975, 13.0  # the quantile falls from 12.71 (df 1) towards z (df -> infinity)
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_mass(mid, df) < 0.475 else (lo, mid)
    return (lo + hi) / 2


def sign_flip_p(diffs: list[Fraction]) -> float:
    """Two-sided exact p-value of the paired sign-flip permutation test: the share of the 2^m
    sign assignments of the nonzero differences whose |sum| reaches the observed |sum|."""
    nonzero = [d for d in diffs if d != 0]
    if not nonzero:
        return 1.0
    scale = math.lcm(*(d.denominator for d in nonzero))
    ints = [abs(int(d * scale)) for d in nonzero]  # exact: scale is a multiple of every denominator
    observed = abs(sum(int(d * scale) for d in nonzero))
    total = sum(ints)
    dist = np.zeros(2 * total + 1)  # dist[s + total]: P(sum == s) under random signs
    dist[total] = 1.0
    for x in ints:
        dist = 0.5 * (np.roll(dist, x) + np.roll(dist, -x))  # no wrap: |partial sums| <= total
    sums = np.arange(-total, total + 1)
    return float(min(1.0, dist[np.abs(sums) >= observed].sum()))


@dataclass(frozen=True)
class PairedTest:
    tasks: int  # tasks both runs have
    mean_diff: float  # mean over tasks of rate_B - rate_A
    interval: tuple[float, float] | None  # its 95% Student-t interval (None under two tasks)
    p_value: float
    better: int  # tasks where B's rate is higher
    worse: int  # tasks where B's rate is lower
    test: str  # which test gave p_value

    def significant(self, alpha: float = 0.05) -> bool:
        return self.tasks > 0 and self.p_value < alpha

    def verdict(self, alpha: float = 0.05) -> str:
        if not self.tasks:
            return "no tasks in common: nothing to compare"
        if self.significant(alpha):
            who = "B (the second run) is better" if self.mean_diff > 0 else "A (the first run) is better"
            return f"significant at {alpha:g}: {who}"
        return f"not significant at {alpha:g}: the runs cannot be told apart on these tasks"

    def text(self) -> str:
        ci = f" [{self.interval[0]:+.1%}, {self.interval[1]:+.1%}]" if self.interval else ""
        return (f"{self.test} over {self.tasks} tasks: B - A = {self.mean_diff:+.1%}{ci} (95% CI), "
                f"p = {self.p_value:.4g}; B better on {self.better}, worse on {self.worse}")


def paired_test(a: dict[str, TaskCount], b: dict[str, TaskCount]) -> PairedTest:
    """Compare runs A and B on the tasks both have (see the module's docstring for the test)."""
    common = [t for t in a if t in b and a[t].n and b[t].n]
    diffs = [Fraction(b[t].c, b[t].n) - Fraction(a[t].c, a[t].n) for t in common]
    single = all(a[t].n == 1 and b[t].n == 1 for t in common)
    test = "exact McNemar (sign-flip permutation, K=1)" if single else "exact paired sign-flip permutation"
    floats = [float(d) for d in diffs]
    mean, se = mean_se(floats)
    interval = None
    if se is not None:
        half = t975(len(floats) - 1) * se
        interval = (mean - half, mean + half)
    return PairedTest(tasks=len(common), mean_diff=mean, interval=interval, p_value=sign_flip_p(diffs),
                      better=sum(d > 0 for d in diffs), worse=sum(d < 0 for d in diffs), test=test)
