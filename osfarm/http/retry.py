"""Waiting between retries of infrastructure calls: exponential backoff with jitter.

Without jitter, every client of a farm that just restarted retries at the same instants and the
farm meets a thundering herd each time; without a growing delay, a restart that takes longer
than a few fixed pauses burns every retry at once. ``backoff_s`` gives "equal jitter": half of
the exponential delay is kept, the other half is random, so a delay is never near zero and never
above the cap.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable


def backoff_s(attempt: int, base_s: float = 0.5, cap_s: float = 30.0,
              rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry number ``attempt`` (1 = the first retry)."""
    delay = min(cap_s, base_s * 2 ** max(0, attempt - 1))
    return delay / 2 + rng() * delay / 2


class Deadline:
    """Retries until a deadline: ``next_delay()`` is the backoff of the next retry, or None when
    waiting it would pass the deadline (then the caller gives up and raises)."""

    def __init__(self, budget_s: float, base_s: float = 0.5, cap_s: float = 30.0,
                 monotonic: Callable[[], float] = time.monotonic):
        self._monotonic = monotonic
        self.until = monotonic() + budget_s
        self.base_s, self.cap_s = base_s, cap_s
        self.attempt = 0

    def next_delay(self) -> float | None:
        self.attempt += 1
        delay = backoff_s(self.attempt, self.base_s, self.cap_s)
        left = self.until - self._monotonic()
        if left <= 0:
            return None
        return min(delay, left)
