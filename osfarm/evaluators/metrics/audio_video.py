"""OSWorld's audio and video metrics (``compare_audios`` and ``compare_videos`` of
``metrics/vlc.py``, ``check_mp3_meta`` of ``others.py``), with ffmpeg and numpy in place of
OSWorld's heavy dependencies:

* ``compare_audios`` decodes with ffmpeg (mono, 22050 Hz, as ``librosa.load``), takes 20 MFCCs
  (2048-point FFT, hop 512, 128 mel bands, dB with an 80 dB floor), scales each coefficient row
  by its max-abs, aligns the frames with exact DTW on cosine distance (OSWorld uses fastdtw, an
  approximation of the same) and scores ``exp(-distance / path_length)``. Unlike OSWorld, two
  undecodable files score 0.0 (OSWorld: 1.0).
* ``compare_videos`` decodes with ffmpeg and compares 64-bit DCT perceptual hashes per frame
  (imagehash's ``phash``).

Under the metric contract (``contract.py``) an undecodable file scores 0.0.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from mutagen.easyid3 import EasyID3

from osfarm.evaluators.metrics.contract import bad_input_scores_zero, is_file
from osfarm.evaluators.metrics.rules import match_value_to_rule

__all__ = ["METRICS"]

FFMPEG = shutil.which("ffmpeg") or "/usr/bin/ffmpeg"


def _ffmpeg_audio(path: str, sr: int = 22050) -> np.ndarray:
    proc = subprocess.run(
        [FFMPEG, "-nostdin", "-v", "error", "-i", path, "-f", "f32le", "-ac", "1", "-ar", str(sr), "-"],
        capture_output=True,
        timeout=120,
        check=True,
    )
    return np.frombuffer(proc.stdout, dtype="<f4").astype(np.float64)


def _mel_filterbank(sr: int, n_fft: int, n_mels: int) -> np.ndarray:
    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        return 700.0 * (10 ** (m / 2595.0) - 1.0)

    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mel_pts = mel_to_hz(np.linspace(hz_to_mel(np.array(0.0)), hz_to_mel(np.array(sr / 2)), n_mels + 2))
    fb = np.zeros((n_mels, len(fft_freqs)))
    for i in range(n_mels):
        lo, mid, hi = mel_pts[i], mel_pts[i + 1], mel_pts[i + 2]
        up = (fft_freqs - lo) / max(mid - lo, 1e-9)
        down = (hi - fft_freqs) / max(hi - mid, 1e-9)
        fb[i] = np.maximum(0, np.minimum(up, down)) * (2.0 / (hi - lo))
    return fb


def _mfcc(y: np.ndarray, sr: int = 22050, n_mfcc: int = 20, n_fft: int = 2048, hop: int = 512) -> np.ndarray:
    """(n_mfcc, frames) MFCCs, librosa's defaults."""
    y = np.pad(y, n_fft // 2)
    if len(y) < n_fft:
        y = np.pad(y, (0, n_fft - len(y)))
    n_frames = 1 + (len(y) - n_fft) // hop
    idx = np.arange(n_fft)[None, :] + hop * np.arange(n_frames)[:, None]
    window = np.hanning(n_fft + 1)[:-1]
    power = np.abs(np.fft.rfft(y[idx] * window, axis=1)) ** 2  # (frames, bins)
    mel = power @ _mel_filterbank(sr, n_fft, 128).T  # (frames, mels)
    db = 10.0 * np.log10(np.maximum(mel, 1e-10))
    db = np.maximum(db, db.max() - 80.0)
    n = db.shape[1]
    k = np.arange(n_mfcc)[:, None]
    dct = np.cos(np.pi * k * (2 * np.arange(n)[None, :] + 1) / (2 * n)) * np.sqrt(2.0 / n)
    dct[0] /= np.sqrt(2.0)
    return dct @ db.T


def _dtw(x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    """Exact DTW on cosine distance between rows; returns (total distance, path length)."""
    xn = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    yn = y / np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-12)
    cost = 1.0 - xn @ yn.T
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    steps = np.zeros((n + 1, m + 1), dtype=np.int64)
    acc[0, 0] = 0.0
    for k in range(2, n + m + 1):  # anti-diagonals i + j = k, 1-based
        i = np.arange(max(1, k - m), min(n, k - 1) + 1)
        j = k - i
        cands = np.stack([acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]])
        lens = np.stack([steps[i - 1, j - 1], steps[i - 1, j], steps[i, j - 1]])
        best = np.argmin(cands, axis=0)
        cols = np.arange(len(i))
        acc[i, j] = cost[i - 1, j - 1] + cands[best, cols]
        steps[i, j] = lens[best, cols] + 1
    return float(acc[n, m]), int(steps[n, m])


def _coarsen(frames: np.ndarray, limit: int) -> np.ndarray:
    """Average consecutive frames so that at most ``limit`` remain (keeps DTW's matrix bounded)."""
    factor = -(-len(frames) // limit)
    if factor <= 1:
        return frames
    pad = (-len(frames)) % factor
    if pad:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    return frames.reshape(-1, factor, frames.shape[1]).mean(axis=1)


@bad_input_scores_zero
def compare_audios(audio_path_1: Any, audio_path_2: Any) -> float:
    """Similarity in [0, 1] of two audio files: ``exp(-DTW distance / path length)`` over
    max-abs-normalised MFCC frames (1.0 for identical audio)."""
    if not is_file(audio_path_1) or not is_file(audio_path_2):
        return 0.0
    y1, y2 = _ffmpeg_audio(str(audio_path_1)), _ffmpeg_audio(str(audio_path_2))
    if len(y1) == 0 or len(y2) == 0:
        return 0.0
    feats = []
    for y in (y1, y2):
        m = _mfcc(y)
        m = m / np.maximum(np.abs(m).max(axis=1, keepdims=True), 1e-12)  # librosa.util.normalize(axis=1)
        feats.append(_coarsen(m.T, 3000))
    distance, length = _dtw(feats[0], feats[1])
    return float(np.exp(-distance / length)) if length else 0.0


def _ffmpeg_frames(path: str, max_frames: int, size: int = 32) -> np.ndarray:
    proc = subprocess.run(
        [FFMPEG, "-nostdin", "-v", "error", "-i", path, "-frames:v", str(max_frames),
         "-vf", f"scale={size}:{size}:flags=area", "-pix_fmt", "gray", "-f", "rawvideo", "-"],
        capture_output=True,
        timeout=300,
        check=True,
    )
    data = np.frombuffer(proc.stdout, dtype=np.uint8)
    return data[: len(data) // (size * size) * size * size].reshape(-1, size, size)


def _phash(frame: np.ndarray) -> np.ndarray:
    n = frame.shape[0]
    k = np.arange(n)
    dct = np.cos(np.pi * k[:, None] * (2 * k[None, :] + 1) / (2 * n))
    low = (dct @ frame.astype(np.float64) @ dct.T)[:8, :8]
    return (low > np.median(low)).ravel()


@bad_input_scores_zero
def compare_videos(video_path1: Any, video_path2: Any, max_frames_to_check: int = 100, threshold: int = 5) -> float:
    """1 iff the first ``max_frames_to_check`` frames match: at most ``threshold`` frames whose
    perceptual hashes differ by more than ``threshold`` bits, and, when a video ends within that
    window, both end at the same frame."""
    if not is_file(video_path1) or not is_file(video_path2):
        return 0.0
    f1 = _ffmpeg_frames(str(video_path1), max_frames_to_check)
    f2 = _ffmpeg_frames(str(video_path2), max_frames_to_check)
    if len(f1) == 0 and len(f2) == 0:
        return 0.0
    mismatches = 0
    for a, b in zip(f1, f2, strict=False):
        if int(np.count_nonzero(_phash(a) != _phash(b))) > threshold:
            mismatches += 1
            if mismatches > threshold:
                return 0.0
    return float(len(f1) == len(f2))


@bad_input_scores_zero
def check_mp3_meta(result: Any, meta: Mapping[str, Mapping[str, Any]]) -> float:
    """1 iff every ID3 tag named in ``meta`` (EasyID3 keys: title, artist, album...; multiple
    values joined with ",", absent = "") matches its ``{"method", "ref"}`` rule."""
    if not is_file(result):
        return 0.0
    tags = EasyID3(result)
    for key, rule in meta.items():
        value = tags.get(key, "")
        if isinstance(value, list):
            value = ",".join(value)
        if not match_value_to_rule(value, rule):
            return 0.0
    return 1.0


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f for f in (compare_audios, compare_videos, check_mp3_meta)
}
