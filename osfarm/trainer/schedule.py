"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay.

The factor multiplies ``lr`` at optimizer step s (0-based, counting only steps that were taken:
a step skipped for a non-finite gradient does not advance the schedule):

    s < warmup:           (s + 1) / warmup
    constant:             1
    linear:               1 − (1 − min_ratio) · p          p = (s − warmup) / (total − warmup), capped at 1
    cosine:               min_ratio + (1 − min_ratio) · (1 + cos(π·p)) / 2
"""

from __future__ import annotations

import math
from typing import Literal

ScheduleKind = Literal["constant", "linear", "cosine"]


def lr_factor(step: int, *, kind: ScheduleKind = "constant", warmup: int = 0, total: int | None = None,
              min_ratio: float = 0.0) -> float:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    if kind not in ("linear", "cosine"):
        raise ValueError(f"schedule must be constant, linear or cosine, got {kind!r}")
    if total is None or total <= warmup:
        return 1.0
    p = min(1.0, (step - warmup) / (total - warmup))
    if kind == "linear":
        return 1.0 - (1.0 - min_ratio) * p
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
