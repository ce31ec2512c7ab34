"""At η = 0 the learner holds the weights that sampled: its log-probs of a reply the CPU policy
server sampled (a screenshot prompt, temperature 0.7, processed log-probs) are the server's, so the
decoupled loss sees KL(π_b ‖ π_prox) ≈ 0 and importance weights of 1 — alone, in a micro-batch with
other replies, and after a reload of the learner's own checkpoint into the server."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from osfarm.policy.process import PolicyProcess
from osfarm.policy.tiny import tiny_model_dir
from osfarm.trainer.learner import Learner, LearnerOptions
from osfarm.trainer.samples import Sample

pytestmark = pytest.mark.timeout(600)
T = 0.7


def _screenshot(shade: int) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (640, 400), (shade, 120, 200))
    ImageDraw.Draw(img).rectangle((40, 40, 300, 120), fill=(250, 250, 250))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(i: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You control a Linux desktop."},
            {"role": "user", "content": [{"type": "text", "text": f"Step {i}: click the white box."},
                                         {"type": "image_url", "image_url": {"url": _screenshot(30 * i)}}]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    proc = PolicyProcess(tiny_model_dir(), 0, "policy", tmp_path_factory.mktemp("kl") / "server.log")
    try:
        asyncio.run(proc.wait_ready(120))
        yield proc
    finally:
        proc.stop()


def _sample(url: str, i: int) -> Sample:
    body = {"model": "policy", "messages": _messages(i), "temperature": T, "top_p": 1.0, "max_tokens": 6 + i,
            "logprobs": True, "return_token_ids": True, "seed": 100 + i}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return Sample(messages=_messages(i), response_token_ids=ch["token_ids"],
                  behav_logprobs=[t["logprob"] for t in ch["logprobs"]["content"]], policy_version=0,
                  advantage=1.0 if i % 2 else -1.0, reward=float(i % 2), task_id="t", group_id="g",
                  episode_id=f"e{i}", step_index=1)


def test_eta_zero_kl_behav_is_zero(server: PolicyProcess, tmp_path: Path) -> None:
    samples = [_sample(server.url, i) for i in range(3)]
    for mbs in (1, 3):
        learner = Learner(tiny_model_dir(), LearnerOptions(lr=1e-3, temperature=T, micro_batch_size=mbs))
        stats = learner.update(samples)
        assert abs(stats.extra["loss/behav_kl"]) < 1e-3, stats.extra  # KL(π_b ‖ π_prox), k1 estimate
        assert abs(stats.kl_prox_behav) < 1e-3
        assert stats.extra["loss/importance_weight_mean"] == pytest.approx(1.0, abs=2e-3)
        assert stats.extra["loss/behav_cap_frac"] < 0.5  # truncation at C = 1 only trims float noise
    # the server reloads the learner's checkpoint: a reply it samples now matches the learner again
    ckpt = learner.save(tmp_path / "v1")
    r = httpx.post(f"{server.url}/v1/weights/reload", json={"path": str(ckpt / "model"), "version": 1}, timeout=120)
    assert r.status_code == 200, r.text
    fresh = _sample(server.url, 5)
    assert learner.score(fresh) == pytest.approx(fresh.behav_logprobs, abs=2e-3)
