"""Success rates with their 95% confidence interval.

A benchmark of a few hundred tasks measures a success rate to a few points at best; a leaderboard
that shows 41.2% vs 39.8% without the interval invites reading noise. The Wilson score interval
stays inside [0, 1] and behaves at 0/n and n/n, where the normal approximation does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``successes`` out of ``n``; (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    denom = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    lo = 0.0 if successes <= 0 else max(0.0, centre - half)  # exact at the ends (no 5e-17)
    hi = 1.0 if successes >= n else min(1.0, centre + half)
    return lo, hi


@dataclass(frozen=True)
class Rate:
    """``successes`` of ``n`` with its interval."""

    successes: int
    n: int

    @property
    def value(self) -> float:
        return self.successes / self.n if self.n else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.successes, self.n)

    def text(self) -> str:
        if not self.n:
            return "–"
        lo, hi = self.interval
        return f"{self.value:.1%} [{lo:.1%}, {hi:.1%}]"

    def short(self) -> str:
        return f"{self.value:.1%}" if self.n else "–"
