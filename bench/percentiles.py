"""Medians and 90th percentiles of timing samples, in milliseconds, for the bench tables."""

from __future__ import annotations


def median_ms(samples: list[float]) -> float:
    s = sorted(samples)
    n = len(s)
    mid = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return mid * 1000.0


def p90_ms(samples: list[float]) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(0.9 * len(s)))] * 1000.0
