"""Pure parts of the policy server: latency model, sequence ends, stop strings, the tiny model
and the processor fallback (image placeholder expansion)."""

from __future__ import annotations

import math

import pytest

from osfarm.policy.sampling import (
    NEG_INF_LOGPROB,
    LatencyModel,
    cut_at_stop,
    finite_logprob,
    lognormal_mu,
    sequence_end,
)


def test_lognormal_mu_by_hand() -> None:
    # mean 100 ms, sigma 1: mu = ln(100) - 1/2 = 4.60517 - 0.5
    assert lognormal_mu(100.0, 1.0) == pytest.approx(4.105170, abs=1e-6)
    assert lognormal_mu(50.0, 0.0) == pytest.approx(math.log(50.0))
    with pytest.raises(ValueError):
        lognormal_mu(0.0, 1.0)


def test_latency_model_mean_and_tail() -> None:
    lat = LatencyModel(200.0, 1.0, seed=0)
    xs = [lat.sample_ms() for _ in range(40000)]
    assert sum(xs) / len(xs) == pytest.approx(200.0, rel=0.05)
    xs.sort()
    assert xs[len(xs) // 2] == pytest.approx(200.0 * math.exp(-0.5), rel=0.05)  # median = exp(mu)
    assert LatencyModel(30.0).sample_ms() == 30.0
    assert LatencyModel(0.0, 2.0).sample_ms() == 0.0
    with pytest.raises(ValueError):
        LatencyModel(-1.0)


def test_sequence_end_keeps_the_stop_token_and_drops_padding() -> None:
    assert sequence_end([5, 6, 2, 0, 0], {0, 2}) == (3, True)
    assert sequence_end([5, 6, 7], {0, 2}) == (3, False)
    assert sequence_end([2], {2}) == (1, True)
    assert sequence_end([], {2}) == (0, False)


def test_cut_at_stop() -> None:
    assert cut_at_stop("Thought: x\nAction: click()", ("\nAction",)) == ("Thought: x", True)
    assert cut_at_stop("abc", ("z", "")) == ("abc", False)
    assert cut_at_stop("a;b|c", ("|", ";")) == ("a", True)  # the earliest stop wins


def test_finite_logprob() -> None:
    assert finite_logprob(float("-inf")) == NEG_INF_LOGPROB
    assert finite_logprob(-1.5) == -1.5


def test_tiny_model_builds_deterministically_and_expands_images(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from PIL import Image

    from osfarm.policy.processing import VisionChatProcessor
    from osfarm.policy.tiny import MAX_PIXELS, build_tiny_model, tiny_model_dir

    cached = tiny_model_dir()
    assert tiny_model_dir() == cached  # built once
    from safetensors.torch import load_file

    rebuilt = build_tiny_model(tmp_path / "again")
    a, b = load_file(str(cached / "model.safetensors")), load_file(str(rebuilt / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (cached / "tokenizer.json").read_bytes() == (rebuilt / "tokenizer.json").read_bytes()

    proc = VisionChatProcessor.from_pretrained(cached)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}, {"type": "image"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert text.count("<|image_pad|>") == 2
    images = [Image.new("RGB", (1280, 720)), Image.new("RGB", (64, 64), (255, 0, 0))]
    inputs = proc(text=[text], images=images, return_tensors="pt")
    grid = inputs["image_grid_thw"]
    expected = [int(g.prod()) // 4 for g in grid]
    n_pad = int((inputs["input_ids"] == proc.image_token_id).sum())
    assert n_pad == sum(expected) == int(inputs["mm_token_type_ids"].sum())
    _, h, w = grid[0].tolist()
    assert h * w * 14 * 14 <= MAX_PIXELS and (h * 14) / (w * 14) == pytest.approx(720 / 1280, rel=0.1)
    with pytest.raises(ValueError, match="more images"):
        proc(text=["no placeholder"], images=images[:1])
    # any text encodes (byte-level) and decodes back
    s = "naïve 😀 \t pyautogui.click(1, 2)"
    assert proc.tokenizer.decode(proc.tokenizer(s)["input_ids"]) == s


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "/nonexistent/model"], "not a model directory"),
        (["--model", "tiny", "--host", "0.0.0.0"], "--allow-remote"),
        (["--model", "tiny", "--logprobs-mode", "softmax"], "--logprobs-mode"),
        (["--model", "tiny", "--delay-ms", "-5"], "--delay-ms"),
    ],
)
def test_serve_rejects_bad_options_without_traceback(args: list[str], needle: str) -> None:
    from typer.testing import CliRunner

    from osfarm.cli import app

    result = CliRunner().invoke(app, ["policy", "serve", *args])
    assert result.exit_code == 2
    assert needle in result.output and "Traceback" not in result.output


def test_serve_names_the_fix_for_a_bare_checkpoint(tmp_path) -> None:
    """A checkpoint dir with weights but no tokenizer: exit 2 pointing at --tokenizer."""
    pytest.importorskip("transformers")
    import shutil

    from typer.testing import CliRunner

    from osfarm.cli import app
    from osfarm.policy.tiny import tiny_model_dir

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir() / name, ckpt / name)
    result = CliRunner().invoke(app, ["policy", "serve", "--model", str(ckpt)])
    assert result.exit_code == 2, result.output
    assert "--tokenizer" in result.output and "Traceback" not in result.output
    bad = CliRunner().invoke(app, ["policy", "serve", "--model", str(ckpt), "--tokenizer", str(tmp_path)])
    assert bad.exit_code == 2 and "tokenizer_config.json" in bad.output
