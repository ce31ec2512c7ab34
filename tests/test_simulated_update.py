"""bench/async_vs_sync.py models a real learner's update time on the tiny model: the hold grows
with the samples an update trains (``learner.simulated_sample_s``), so settings whose batches
differ in size are charged what a real update would charge them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from osfarm.policy.tiny import tiny_model_dir
from osfarm.trainer.learner import Learner, LearnerOptions

sys.path.insert(0, str(Path(__file__).parent))
from test_learner import TEXT_ONLY, make_sample  # noqa: E402


def test_the_simulated_hold_is_per_sample_trained() -> None:
    lrn = Learner(tiny_model_dir(), LearnerOptions(lr=1e-3, simulated_sample_s=0.5))
    one = lrn.update([make_sample(TEXT_ONLY, [101], None, advantage=1.0)])
    three = lrn.update([make_sample(TEXT_ONLY, [101 + i], None, advantage=1.0) for i in range(3)])
    assert one.seconds >= 0.5 and three.seconds >= 1.5  # a fixed hold per update would give 3 samples 0.5 s


def test_the_bench_calibrates_the_hold_from_the_synchronous_batch() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from async_vs_sync import measure, sample_seconds

    # η = 0, 3 updates of 40 samples, 30 s apart, each update 2 s: a batch's rollouts take 28 s
    rows = [{"time": 30.0 * i, "samples": 40, "episodes": 8, "env_utilisation": 0.5, "update_s": 2.0,
             "staleness_max": 0} for i in range(1, 4)]
    res = measure(rows, envs=8)
    assert res["samples_per_update"] == 40 and res["learner_utilisation"] == pytest.approx(4.0 / 60.0)
    assert sample_seconds(res, 3, 1.0) == pytest.approx(28.0 / 40)  # 40 samples held as long as the rollouts
    assert sample_seconds(res, 3, 2.0) == pytest.approx(56.0 / 40)
