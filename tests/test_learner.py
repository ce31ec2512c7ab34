"""The learner on the tiny Qwen2-VL model: token masks, updates, checkpoints and resume."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from osfarm.policy.tiny import tiny_model_dir
from osfarm.trainer.data_manager import Sample as DMSample
from osfarm.trainer.learner import (
    STATE_FILE,
    Learner,
    LearnerOptions,
    LoraOptions,
    LossOptions,
    encode_sample,
    latest_checkpoint,
    read_state,
    response_mask,
)


def make_sample(messages: list[dict[str, Any]], response_token_ids: list[int] | None,
                behav_logprobs: list[float] | None, *, advantage: float = 0.0, response_text: str = "") -> DMSample:
    """H6's Sample with the fields these tests do not care about filled in."""
    return DMSample(messages=messages, response_token_ids=response_token_ids, behav_logprobs=behav_logprobs,
                    policy_version=0, advantage=advantage, reward=0.0, task_id="t", group_id="t", episode_id="e",
                    step_index=1, response_text=response_text)


def _png(color: tuple[int, int, int]) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (320, 200), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


MESSAGES = [
    {"role": "system", "content": "You control a Linux desktop."},
    {"role": "user", "content": [{"type": "text", "text": "Click the blue button."},
                                 {"type": "image_url", "image_url": {"url": _png((20, 60, 200))}}]},
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="module")
def learner(model_dir: Path) -> Learner:
    return Learner(model_dir, LearnerOptions(lr=1e-3))


def _sample(learner: Learner, ids: list[int], advantage: float) -> DMSample:
    s = make_sample(MESSAGES, ids, [0.0] * len(ids), advantage=advantage)
    s.behav_logprobs = learner.score(s)  # on-policy: behaviour = current weights
    return s


def test_response_mask_numbers() -> None:
    assert response_mask(3, 2).tolist() == [0, 0, 0, 1, 1]
    assert response_mask(0, 1).tolist() == [1]


def test_encoding_appends_response_after_the_prompt(learner: Learner) -> None:
    enc = encode_sample(learner.processor, MESSAGES, [107, 108, 109])
    ids = enc.inputs["input_ids"][0].tolist()
    assert ids[-3:] == [107, 108, 109] and enc.prompt_len == len(ids) - 3
    assert enc.inputs["attention_mask"].shape == enc.inputs["input_ids"].shape
    assert "pixel_values" in enc.inputs and "image_grid_thw" in enc.inputs
    # the prompt ends with the generation prompt the server generates after
    text = learner.processor.tokenizer.decode(ids[: enc.prompt_len])
    assert text.rstrip().endswith("<|im_start|>assistant")


def test_full_and_sliced_logprobs_agree(learner: Learner) -> None:
    enc = learner.encode(make_sample(MESSAGES, [111, 112, 113, 114], [0.0] * 4))
    with torch.no_grad():
        lp_full, mask, _ = learner.token_logprobs(enc, full=True)
        lp_cut, mask_cut, _ = learner.token_logprobs(enc, full=False)
    assert mask.sum() == 4 and mask_cut.sum() == 4
    assert torch.allclose(lp_full[mask > 0], lp_cut[0], atol=1e-5)


def test_only_response_tokens_get_gradient(model_dir: Path) -> None:
    lrn = Learner(model_dir, LearnerOptions(lr=1e-3, full_logits=True))
    s = _sample(lrn, [121, 122, 123], advantage=1.0)
    enc = lrn.encode(s)
    captured: list[torch.Tensor] = []

    def keep(_module: Any, _inp: Any, out: torch.Tensor) -> None:
        out.retain_grad()
        captured.append(out)

    handle = lrn.model.get_output_embeddings().register_forward_hook(keep)
    try:
        lrn.model.train()
        prox = torch.tensor([s.behav_logprobs])
        loss, _stats, _ent = lrn.sample_loss(s, enc, prox)
        loss.backward()
    finally:
        handle.remove()
    logits = captured[-1]
    assert logits.shape[1] == enc.prompt_len + enc.response_len  # every position was computed
    per_pos = logits.grad[0].abs().sum(-1)
    P, T = enc.prompt_len, enc.response_len
    # position i predicts token i+1: positions P-1 .. P+T-2 predict the response tokens
    assert torch.all(per_pos[: P - 1] == 0), "a prompt token got gradient"
    assert torch.all(per_pos[P - 1: P - 1 + T] > 0), "a response token got no gradient"
    assert per_pos[-1] == 0  # the last position predicts nothing


def test_update_moves_logprobs_with_the_advantage(model_dir: Path) -> None:
    lrn = Learner(model_dir, LearnerOptions(lr=1e-3))
    good = _sample(lrn, [131, 132], advantage=1.0)
    bad = _sample(lrn, [141, 142], advantage=-1.0)
    before_good, before_bad = sum(good.behav_logprobs), sum(bad.behav_logprobs)
    for _ in range(3):
        stats = lrn.update([good, bad])
    assert stats.version == 3 and lrn.version == 3
    assert lrn.counters == {"updates": 3, "samples": 6, "tokens": 12}
    assert sum(lrn.score(good)) > before_good
    assert sum(lrn.score(bad)) < before_bad


def test_behaviour_logprob_count_must_match(learner: Learner) -> None:
    s = make_sample(MESSAGES, [105, 106, 107], [0.0, 0.0])
    with pytest.raises(ValueError, match="2 behaviour log-probs for 3 response tokens"):
        learner.update([s])


def test_checkpoint_round_trip_and_resume(model_dir: Path, tmp_path: Path) -> None:
    lrn = Learner(model_dir, LearnerOptions(lr=1e-3))
    s = _sample(lrn, [151, 152, 153], advantage=1.0)
    lrn.update([s])
    lrn.update([s])
    ckpt = lrn.save(tmp_path / "checkpoints" / "v2", {"data_manager": {"seen": 7}})
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "config.json").is_file()
    state = read_state(ckpt)
    assert state["version"] == 2 and state["counters"]["updates"] == 2 and state["data_manager"] == {"seen": 7}
    assert latest_checkpoint(tmp_path / "checkpoints") == ckpt

    back, state2 = Learner.resume(ckpt, LearnerOptions(lr=1e-3))
    assert back.version == 2 and back.counters == lrn.counters and state2["data_manager"] == {"seen": 7}
    assert back.score(s) == pytest.approx(lrn.score(s), abs=1e-5)
    # the optimizer state came back too: the next update is the same on both
    a, b = lrn.update([s]), back.update([s])
    assert a.version == b.version == 3
    assert back.score(s) == pytest.approx(lrn.score(s), abs=1e-4)
    assert back.counters == {"updates": 3, "samples": 3, "tokens": 9}


def test_checkpoint_loads_in_the_policy_engine(model_dir: Path, tmp_path: Path) -> None:
    from osfarm.policy.engine import PolicyEngine

    lrn = Learner(model_dir, LearnerOptions(lr=1e-3))
    s = _sample(lrn, [161, 162], advantage=1.0)
    lrn.update([s])
    ckpt = lrn.save(tmp_path / "v1")
    engine = PolicyEngine(model_dir, served_name="tiny")
    loaded = engine.reload(ckpt, 1)
    assert loaded.version == 1
    enc = lrn.encode(s)
    with torch.no_grad():
        out = loaded.model(**{k: v for k, v in enc.inputs.items()}, use_cache=False).logits
    lp = torch.log_softmax(out[0, enc.prompt_len - 1:-1].float(), -1).gather(-1, enc.response_ids[:, None])[:, 0]
    assert lp.tolist() == pytest.approx(lrn.score(s), abs=1e-4)


def test_lora_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    opts = LearnerOptions(lr=1e-2, lora=LoraOptions(r=4, alpha=8))
    lrn = Learner(model_dir, opts)
    trainable = sum(p.numel() for p in lrn.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in lrn.model.parameters())
    assert 0 < trainable < total / 10
    s = _sample(lrn, [171, 172], advantage=1.0)
    before = sum(s.behav_logprobs)
    lrn.update([s])
    lrn.update([s])
    assert sum(lrn.score(s)) > before
    ckpt = lrn.save(tmp_path / "v2")
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and (ckpt / "model.safetensors").is_file()
    assert json.loads((ckpt / STATE_FILE).read_text())["lora"] is True
    back, _ = Learner.resume(ckpt, opts)
    assert back.version == 2
    assert back.score(s) == pytest.approx(lrn.score(s), abs=1e-4)


def test_pool_sample_without_ids_or_logprobs(learner: Learner) -> None:
    """An experience-pool episode recorded without token ids: the response text is tokenised (plus
    the end-of-turn token) and π_b is taken as π_prox (weight 1)."""
    s = make_sample(MESSAGES, None, None, advantage=1.0, response_text="pyautogui.click(640, 360)")
    ids = learner.response_ids(s)
    tok = learner.processor.tokenizer
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(ids[:-1]) == "pyautogui.click(640, 360)"
    before = sum(learner.score(s))
    stats = learner.update([s])
    assert stats.tokens == len(ids)
    assert sum(learner.score(s)) > before


def test_kl_to_the_frozen_reference(model_dir: Path) -> None:
    """With kl_coef > 0 the loss carries KL(π_θ ‖ π_ref): 0 while the policy is the reference,
    > 0 once an update has moved it; the reference itself never moves."""
    lrn = Learner(model_dir, LearnerOptions(lr=1e-2, loss=LossOptions(kl_coef=0.1)))
    s = _sample(lrn, [107, 108, 109], advantage=1.0)
    first = lrn.update([s])
    assert first.extra["loss/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # k3 of identical policies: e^0 - 0 - 1
    s.behav_logprobs = lrn.score(s)
    second = lrn.update([s])
    assert second.extra["loss/kl_ref"] > 1e-6
    untouched = Learner(model_dir, LearnerOptions()).score(s)
    assert lrn.reference_logprobs(lrn.encode(s))[0].tolist() == pytest.approx(untouched, abs=1e-5)
    assert lrn.score(s) != pytest.approx(untouched, abs=1e-5)


def test_a_sampled_image_placeholder_token_still_trains(learner: Learner) -> None:
    """A random model can sample <|image_pad|>: the forward pass must not count it as an image
    token (one more than the image's features), and it is scored as the sampled token."""
    pad = learner.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    s = make_sample(MESSAGES, [107, pad], None, advantage=1.0)
    enc = learner.encode(s)
    assert enc.target_ids is not None and enc.target_ids[0, -1].item() == pad
    assert enc.inputs["input_ids"][0, -1].item() != pad
    lp = learner.score(s)
    assert len(lp) == 2 and all(x < 0 for x in lp)
    learner.update([s])


def test_model_loads_and_saves_print_no_progress_bars(tmp_path: Path) -> None:
    """`osfarm train` shows one progress display: building the tiny model, loading the learner,
    writing a LoRA and a full checkpoint and loading one in the policy engine print none of
    transformers' tqdm bars ("Loading weights", "Writing model shards"), and the bars are on
    again afterwards (a program using osfarm as a library keeps its own). A fresh interpreter:
    the switch is a process-wide global."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        from pathlib import Path
        from transformers.utils import logging as hf_logging
        from osfarm.policy.engine import PolicyEngine
        from osfarm.policy.tiny import build_tiny_model
        from osfarm.trainer.learner import Learner, LearnerOptions, LoraOptions
        root = Path({str(tmp_path)!r})
        model = build_tiny_model(root / "tiny")
        Learner(model).save(root / "full")
        Learner(model, LearnerOptions(lora=LoraOptions(r=2))).save(root / "lora")
        PolicyEngine(root / "full", served_name="t")
        print("bars on afterwards:", hf_logging.is_progress_bar_enabled())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TQDM_MININTERVAL": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    both = out.stdout + out.stderr
    for bar in ("Loading weights", "Writing model shards", "it/s]"):
        assert bar not in both, both[-2000:]
    assert "bars on afterwards: True" in out.stdout
