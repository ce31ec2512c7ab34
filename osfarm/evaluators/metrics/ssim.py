"""Structural similarity (SSIM) of two images, as scikit-image's default
``structural_similarity`` computes it (7x7 uniform window, sample covariance, K1=0.01, K2=0.03,
data range 255 for 8-bit images, channel mean for colour), with numpy box sums instead of
OSWorld's scikit-image dependency."""

from __future__ import annotations

import numpy as np

__all__ = ["ssim"]


def _box_mean(x: np.ndarray, win: int) -> np.ndarray:
    """Means of every full ``win`` x ``win`` window (the 'valid' part of a uniform filter)."""
    c = np.zeros((x.shape[0] + 1, x.shape[1] + 1), dtype=np.float64)
    c[1:, 1:] = x.cumsum(0).cumsum(1)
    s = c[win:, win:] - c[:-win, win:] - c[win:, :-win] + c[:-win, :-win]
    return s / (win * win)


def _ssim_2d(a: np.ndarray, b: np.ndarray, win: int, data_range: float) -> float:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    ux, uy = _box_mean(a, win), _box_mean(b, win)
    # Variances on mean-shifted data: same values, less cancellation in the box sums.
    a0, b0 = a - a.mean(), b - b.mean()
    ux0, uy0 = _box_mean(a0, win), _box_mean(b0, win)
    cov_norm = win * win / (win * win - 1.0)
    vx = cov_norm * (_box_mean(a0 * a0, win) - ux0 * ux0)
    vy = cov_norm * (_box_mean(b0 * b0, win) - uy0 * uy0)
    vxy = cov_norm * (_box_mean(a0 * b0, win) - ux0 * uy0)
    c1 = (0.01 * data_range) ** 2
    c2 = (0.03 * data_range) ** 2
    s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux * ux + uy * uy + c1) * (vx + vy + c2))
    return float(s.mean())


def ssim(a: np.ndarray, b: np.ndarray, win_size: int = 7, data_range: float = 255.0) -> float:
    """Mean SSIM of two same-shape 2-D (gray) or 3-D (H, W, C) arrays, as scikit-image computes it."""
    if a.shape != b.shape:
        raise ValueError(f"SSIM needs same-shape images: {a.shape} vs {b.shape}")
    if win_size < 1 or win_size % 2 == 0 or min(a.shape[0], a.shape[1]) < win_size:
        raise ValueError(f"SSIM window {win_size} does not fit image {a.shape}")
    if a.ndim == 2:
        return _ssim_2d(a, b, win_size, data_range)
    return float(np.mean([_ssim_2d(a[..., c], b[..., c], win_size, data_range) for c in range(a.shape[2])]))

