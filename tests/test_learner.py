"""The learner on the tiny Qwen2-VL model: token masks, micro-batches, precision, updates,
checkpoints (served weights apart from the training state) and resume; two gloo ranks on the CPU
make the update one rank makes."""

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
from osfarm.trainer.checkpoint import model_dir as served_dir
from osfarm.trainer.checkpoint import prune_checkpoints, train_state_dir
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
from osfarm.trainer.samples import Sample as DMSample


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


TEXT_ONLY = [{"role": "system", "content": "You control a Linux desktop."},
             {"role": "user", "content": "Open the terminal and list the files of the home directory, please."}]


def _mixed_samples(lrn: Learner) -> list[DMSample]:
    """Samples of different prompt and response lengths, with and without screenshots."""
    out = []
    for i, (msgs, ids) in enumerate([(MESSAGES, [107, 108, 109]), (TEXT_ONLY, [121]), (MESSAGES, [131, 132]),
                                     (TEXT_ONLY, [141, 142, 143, 144, 145])]):
        s = make_sample(msgs, ids, None, advantage=(1.0 if i % 2 else -1.0))
        s.behav_logprobs = lrn.score(s)
        out.append(s)
    return out


def test_micro_batches_score_and_train_as_single_samples(model_dir: Path) -> None:
    """Left-padded micro-batches (images concatenated, each sample's mRoPE positions from its own
    attention mask) give each sample the log-probs it has alone, and an update in micro-batches
    of 3 is the update made one sample at a time (gradient accumulation by token share)."""
    one = Learner(model_dir, LearnerOptions(lr=1e-3))
    samples = _mixed_samples(one)
    many = Learner(model_dir, LearnerOptions(lr=1e-3, micro_batch_size=3))
    for got, want in zip(many.score_many(samples), [s.behav_logprobs for s in samples], strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    a, b = one.update(samples), many.update(samples)
    assert a.loss == pytest.approx(b.loss, abs=1e-5) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    for s in samples:
        assert many.score(s) == pytest.approx(one.score(s), abs=2e-4)


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
    assert stats.version == 3 and lrn.version == 3 and stats.lr == 1e-3
    assert lrn.counters == {"updates": 3, "samples": 6, "tokens": 12, "optimizer_steps": 3, "skipped_steps": 0,
                            "skipped_updates": 0}
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
    # the served weights (what a policy server loads) apart from the training state
    assert (ckpt / "model" / "model.safetensors").is_file() and (ckpt / "model" / "config.json").is_file()
    assert (ckpt / "model" / "tokenizer.json").is_file() and served_dir(ckpt) == ckpt / "model"
    assert (ckpt / "state" / "optimizer.pt").is_file() and not (ckpt / "model" / "optimizer.pt").exists()
    assert not (ckpt / "state" / "master.safetensors").exists()  # fp32 served = fp32 master: no copy
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
    assert back.counters == {"updates": 3, "samples": 3, "tokens": 9, "optimizer_steps": 3, "skipped_steps": 0,
                             "skipped_updates": 0}
    for v in (3, 4, 5):
        lrn.version = v
        lrn.save(tmp_path / "checkpoints" / f"v{v}")
    (tmp_path / "checkpoints" / "v6.tmp123").mkdir()  # a write the process did not finish
    prune_checkpoints(tmp_path / "checkpoints", keep=2)
    assert sorted(d.name for d in (tmp_path / "checkpoints").iterdir()) == ["v4", "v5"]


def test_checkpoint_loads_in_the_policy_engine(model_dir: Path, tmp_path: Path) -> None:
    from osfarm.policy.engine import PolicyEngine

    lrn = Learner(model_dir, LearnerOptions(lr=1e-3))
    s = _sample(lrn, [161, 162], advantage=1.0)
    lrn.update([s])
    ckpt = lrn.save(tmp_path / "v1")
    engine = PolicyEngine(model_dir, served_name="tiny")
    loaded = engine.reload(ckpt / "model", 1)
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
    # adapters only (what vLLM hot-loads): no 15 GB merged model per version unless asked for
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and not (ckpt / "model").exists()
    assert json.loads((ckpt / STATE_FILE).read_text())["lora"] is True
    back, _ = Learner.resume(ckpt, opts)
    assert back.version == 2
    assert back.score(s) == pytest.approx(lrn.score(s), abs=1e-4)
    # save_merged: the base with the adapter folded in, which the CPU policy server loads
    from osfarm.policy.engine import PolicyEngine

    lrn.opts.lora = LoraOptions(r=4, alpha=8, save_merged=True)
    merged = lrn.save(tmp_path / "v2m")
    engine = PolicyEngine(model_dir, served_name="tiny").reload(merged / "model", 2)
    enc = lrn.encode(s)
    with torch.no_grad():
        out = engine.model(**enc.inputs, use_cache=False).logits
    lp = torch.log_softmax(out[0, enc.prompt_len - 1:-1].float(), -1).gather(-1, enc.response_ids[:, None])[:, 0]
    assert lp.tolist() == pytest.approx(lrn.score(s), abs=1e-4)
    assert sum(lp.tolist()) != pytest.approx(before, abs=1e-3)  # the adapter is in it, not the bare base


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
        PolicyEngine(root / "full" / "model", served_name="t")
        print("bars on afterwards:", hf_logging.is_progress_bar_enabled())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TQDM_MININTERVAL": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    both = out.stdout + out.stderr
    for bar in ("Loading weights", "Writing model shards", "it/s]"):
        assert bar not in both, both[-2000:]
    assert "bars on afterwards: True" in out.stdout


def _weights(lrn: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in lrn.model.state_dict().items()}


def test_fp32_master_weights_keep_small_updates_that_bf16_rounds_away(model_dir: Path) -> None:
    """Full fine-tuning with bf16 weights: an AdamW step of lr 1e-6 is far below bf16's resolution
    (2^-8 relative) on any weight of magnitude 0.01 and more, and rounds to nothing. With fp32 master
    weights (the default) and bf16 compute (autocast) the same step moves the weights."""
    moved = {}
    for master in ("same", "float32"):
        lrn = Learner(model_dir, LearnerOptions(lr=1e-6, dtype="bfloat16", master_dtype=master))
        assert lrn.autocast == (master == "float32")
        s = make_sample(MESSAGES, [107, 108], None, advantage=1.0)
        before = _weights(lrn)
        stats = lrn.update([s])
        assert stats.skipped_steps == 0 and stats.version == 1
        after = _weights(lrn)
        # weights of magnitude >= 0.01: bf16 resolves steps above ~4e-5 there, fp32 above ~1e-9
        moved[master] = sum(int(((after[k] != before[k]) & (before[k].abs() >= 0.01)).sum()) for k in before)
        if master == "float32":
            assert all(p.dtype == torch.float32 for p in lrn.params)
            state = lrn.optimizer.state[lrn.params[0]]
            assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    assert moved["same"] == 0, "bf16 weights took an update below their resolution?"
    assert moved["float32"] > 1000


def test_a_non_finite_gradient_skips_the_step_and_keeps_the_version(model_dir: Path) -> None:
    lrn = Learner(model_dir, LearnerOptions(lr=1e-3, warmup_steps=2))
    bad = make_sample(MESSAGES, [107, 108], None, advantage=float("inf"))
    before = _weights(lrn)
    stats = lrn.update([bad])
    assert stats.skipped and stats.skipped_steps == 1 and stats.version == 0 and lrn.version == 0
    assert lrn.counters["skipped_updates"] == 1 and lrn.counters["updates"] == 0
    assert lrn.counters["optimizer_steps"] == 0  # the schedule did not advance either
    assert not lrn.optimizer.state  # no moments recorded
    after = _weights(lrn)
    assert all(torch.equal(after[k], before[k]) for k in before)
    # the warmup starts where it was: lr/2, then lr
    good = make_sample(MESSAGES, [107, 108], None, advantage=1.0)
    assert lrn.update([good]).lr == pytest.approx(5e-4) and lrn.update([good]).lr == pytest.approx(1e-3)
    assert lrn.version == 2


def test_bf16_served_weights_and_fp32_master_in_the_training_state(model_dir: Path, tmp_path: Path) -> None:
    """Served weights are written in the compute dtype (what vLLM/our server load), the fp32
    master weights go to the training state, and a resume continues from those, not from the
    rounded served copy."""
    from safetensors import safe_open

    lrn = Learner(model_dir, LearnerOptions(lr=1e-3, dtype="bfloat16"))
    s = make_sample(MESSAGES, [107, 108], None, advantage=1.0)
    lrn.update([s])
    ckpt = lrn.save(tmp_path / "v1")
    with safe_open(str(ckpt / "model" / "model.safetensors"), "pt") as f:
        key = next(iter(f.keys()))
        assert f.get_tensor(key).dtype == torch.bfloat16
    assert (train_state_dir(ckpt) / "master.safetensors").is_file()
    back, state = Learner.resume(ckpt, LearnerOptions(lr=1e-3, dtype="bfloat16"))
    assert state["served_dtype"] == "bfloat16" and state["master_dtype"] == "float32"
    want, got = _weights(lrn), _weights(back)
    assert all(torch.equal(got[k], want[k]) for k in want)


RANK_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from osfarm.trainer.distributed import DistContext
from osfarm.trainer.learner import Learner, LearnerOptions
sys.path.insert(0, {tests!r})
from test_learner import make_sample, MESSAGES, TEXT_ONLY

torch.set_num_threads(1)
ctx = DistContext.from_env()
out = Path({out!r})
lrn = Learner(Path({model!r}), LearnerOptions(lr=1e-3, micro_batch_size={mbs}, fsdp={fsdp!r}), ctx=ctx)
samples = [make_sample(m, ids, None, advantage=a) for m, ids, a in
           [(MESSAGES, [107, 108, 109], -1.0), (TEXT_ONLY, [121], 1.0), (MESSAGES, [131, 132], 1.0),
            (TEXT_ONLY, [141, 142, 143, 144, 145], -1.0), (MESSAGES, [151], 0.5)]]
if ctx.is_main:
    stats = lrn.update(samples)
    lrn.save(out / "v1")
    lrn.stop_workers()
    (out / "stats.json").write_text(json.dumps(stats.as_dict()))
else:
    lrn.serve_commands()
"""


@pytest.mark.parametrize("fsdp", ["off", "on"])
def test_two_gloo_ranks_make_the_update_of_one(model_dir: Path, tmp_path: Path, fsdp: str) -> None:
    """torchrun with 2 ranks on the CPU (gloo): each rank computes its share of the samples,
    gradients are summed (data parallel: an all-reduce of full replicas; FSDP2: sharded weights,
    reduce-scatter in the backward pass, the code path of GPU runs), and the update is the one a
    single rank makes on the whole batch; rank 0's checkpoint (gathered from the shards under
    FSDP) loads in the policy server's engine. Samples with and without screenshots share
    micro-batches (left-padded together); every micro-batch of either rank holds a screenshot,
    so both run the vision tower: a rank or a minibatch without one is test_resume_rank_counts'
    and test_untouched_params' case."""
    import subprocess
    import sys

    from osfarm.policy.engine import PolicyEngine

    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path), model=str(model_dir),
                                         mbs=2, fsdp=fsdp))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    two = json.loads((tmp_path / "stats.json").read_text())
    one = Learner(model_dir, LearnerOptions(lr=1e-3))
    samples = [make_sample(m, ids, None, advantage=a) for m, ids, a in
               [(MESSAGES, [107, 108, 109], -1.0), (TEXT_ONLY, [121], 1.0), (MESSAGES, [131, 132], 1.0),
                (TEXT_ONLY, [141, 142, 143, 144, 145], -1.0), (MESSAGES, [151], 0.5)]]
    stats = one.update(samples)
    assert two["version"] == 1 and two["samples"] == 5 and two["tokens"] == stats.tokens
    assert two["loss"] == pytest.approx(stats.loss, abs=1e-5)
    assert two["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-4)
    assert two["entropy"] == pytest.approx(stats.entropy, abs=1e-4)
    engine = PolicyEngine(model_dir, served_name="tiny")
    loaded = engine.reload(tmp_path / "v1" / "model", 1)
    for s in samples:
        enc = one.encode(s)
        with torch.no_grad():
            out = loaded.model(**enc.inputs, use_cache=False).logits
        lp = torch.log_softmax(out[0, enc.prompt_len - 1:-1].float(), -1).gather(-1, enc.response_ids[:, None])[:, 0]
        assert lp.tolist() == pytest.approx(one.score(s), abs=2e-4)  # the same weights, within float noise


def test_a_broad_group_trains_in_bounded_micro_batches(model_dir: Path) -> None:
    """BroRL: one group of 64 rollouts. With micro_batch_size 8 no forward pass holds more than 8
    samples (the memory of an update is that of one micro-batch), and the update is the one made
    with all 64 in one pass."""
    samples = [make_sample(TEXT_ONLY, [100 + i % 50, 200 + i % 7][: 1 + i % 2], None,
                           advantage=1.0 if i % 3 == 0 else -0.5) for i in range(64)]
    widths: list[int] = []
    small = Learner(model_dir, LearnerOptions(lr=1e-3, micro_batch_size=8))
    hook = small.model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(int(kw["input_ids"].shape[0])),
                                                 with_kwargs=True)
    try:
        a = small.update(samples)
    finally:
        hook.remove()
    assert max(widths) == 8 and len(widths) == 2 * 64 // 8  # proximal pass + training pass
    b = Learner(model_dir, LearnerOptions(lr=1e-3, micro_batch_size=64)).update(samples)
    assert a.loss == pytest.approx(b.loss, abs=1e-5) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)


def test_an_update_holds_one_micro_batch_encoded_at_a_time(model_dir: Path) -> None:
    """Samples are encoded when their micro-batch runs (in both passes) and dropped after it: at
    every forward pass of an update no more encoded samples are alive than one micro-batch holds,
    however large the batch (the host memory of a 1080p screenshot's pixel_values is ~50 MB)."""
    import gc

    from osfarm.trainer.batching import Encoded, MicroBatch

    lrn = Learner(model_dir, LearnerOptions(lr=1e-3, micro_batch_size=2))
    samples = [make_sample(MESSAGES if i % 2 else TEXT_ONLY, [101 + i, 102 + i], None,
                           advantage=1.0 if i % 3 else -1.0) for i in range(8)]
    alive: list[tuple[int, int]] = []

    def count(*_: Any) -> None:
        objs = gc.get_objects()
        alive.append((sum(isinstance(o, Encoded) for o in objs), sum(isinstance(o, MicroBatch) for o in objs)))

    hook = lrn.model.register_forward_pre_hook(count)
    try:
        lrn.update(samples)
    finally:
        hook.remove()
    assert len(alive) == 2 * 8 // 2  # the proximal pass and the training pass, 4 micro-batches each
    assert max(e for e, _ in alive) <= 2 and max(m for _, m in alive) <= 1, alive


def test_a_trajectory_sample_has_its_last_reply_once(learner: Learner) -> None:
    """A trajectory sample (data granularity ``trajectory``) carries its last reply in messages as
    well as in its response ids; the learner encodes the reply once, after the earlier turns."""
    history = [*TEXT_ONLY, {"role": "assistant", "content": "pyautogui.click(10, 10)"},
               {"role": "user", "content": "Now the terminal."}]
    ids = [171, 172, 173]
    reply = learner.processor.tokenizer.decode(ids)
    s = make_sample([*history, {"role": "assistant", "content": reply}], ids, None, advantage=1.0)
    s.turns = [{"message_index": 2, "step_index": 1, "token_ids": [160], "logprobs": None, "policy_version": 0},
               {"message_index": 4, "step_index": 2, "token_ids": ids, "logprobs": None, "policy_version": 0}]
    got = learner.encode(s)
    want = encode_sample(learner.processor, history, ids)
    assert got.inputs["input_ids"].tolist() == want.inputs["input_ids"].tolist()
    assert got.prompt_len == want.prompt_len
    stats = learner.update([s])  # trains on the well-formed sequence
    assert stats.tokens == len(ids)
    s.turns[-1]["message_index"] = 3  # a user message: the sample is malformed, and said so
    with pytest.raises(ValueError, match="message_index 3"):
        learner.encode(s)


def test_the_entropy_term_builds_no_graph_when_its_coefficient_is_0(model_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The entropy over [B, T, V] logits is only reported without a bonus: no autograd graph for it."""
    import osfarm.trainer.learner_passes as learner_module

    grads: list[bool] = []
    real = learner_module.token_entropy

    def spy(logits: torch.Tensor, **kw: Any) -> torch.Tensor:
        out = real(logits, **kw)
        grads.append(out.requires_grad)
        return out

    monkeypatch.setattr(learner_module, "token_entropy", spy)
    s = make_sample(TEXT_ONLY, [101, 102], None, advantage=1.0)
    off = Learner(model_dir, LearnerOptions(lr=1e-3))
    a = off.update([s])
    assert grads == [False] and a.entropy > 0  # still reported
    on = Learner(model_dir, LearnerOptions(lr=1e-3, loss=LossOptions(entropy_coef=0.01)))
    b = on.update([s])
    assert grads == [False, True] and b.entropy == pytest.approx(a.entropy, rel=1e-5)


def test_a_simulated_update_time_holds_the_learner_thread_not_the_event_loop(learner: Learner) -> None:
    """bench/async_vs_sync.py models a real learner's update with ``simulated_update_s``: the
    update takes that much longer on the learner's thread while the event loop (the rollouts)
    keeps running, as it does while a GPU trains."""
    import asyncio

    s = _sample(learner, [101, 102], 1.0)
    saved = learner.opts
    learner.opts = saved.model_copy(update={"simulated_update_s": 1.0})
    ticks = 0

    async def tick_while_updating() -> float:
        nonlocal ticks
        job = asyncio.get_running_loop().run_in_executor(None, learner.update, [s])
        while not job.done():
            await asyncio.sleep(0.05)
            ticks += 1
        return (await job).seconds

    try:
        seconds = asyncio.run(tick_while_updating())
    finally:
        learner.opts = saved
    assert seconds >= 1.0
    assert ticks >= 15  # the loop was free the whole time


def test_episode_weights_numbers() -> None:
    from osfarm.trainer.advantages import episode_weights

    # A: 3 step samples, B: 1; N = 4, E = 2: A's samples 4 / (2 · 3), B's 4 / (2 · 1)
    w = episode_weights(["A", "A", "B", "A"])
    assert w == pytest.approx([2 / 3, 2 / 3, 2.0, 2 / 3])
    assert sum(w) == pytest.approx(4.0)  # mean weight 1
    assert episode_weights(["A", "B"]) == [1.0, 1.0] and episode_weights([]) == []


def test_episode_weighting_keeps_a_long_failure_from_outweighing_a_short_success(model_dir: Path) -> None:
    """With ``episode_weighting`` a 3-step failure and a 1-step success count alike: the update's
    loss is that of advantages scaled by hand by the weights above (lr ~0: the weights stay put)."""
    import dataclasses

    lrn = Learner(model_dir, LearnerOptions(lr=1e-12))
    fail = [dataclasses.replace(make_sample(TEXT_ONLY, [101 + i, 102], None, advantage=-1.0), episode_id="long",
                                step_index=i + 1) for i in range(3)]  # text only: no vision pass, a cheaper test
    win = dataclasses.replace(make_sample(TEXT_ONLY, [120, 121], None, advantage=1.0), episode_id="short")
    plain = lrn.update([*fail, win]).loss
    by_hand = lrn.update([dataclasses.replace(s, advantage=s.advantage * w)
                          for s, w in zip([*fail, win], [2 / 3, 2 / 3, 2 / 3, 2.0], strict=True)]).loss
    lrn.opts.loss.episode_weighting = True
    weighted = lrn.update([*fail, win]).loss
    assert weighted == pytest.approx(by_hand, rel=1e-4, abs=1e-6)
    assert abs(weighted - plain) > 1e-3


def test_the_budget_resizes_screenshots_and_leaves_overlong_samples_out(model_dir: Path) -> None:
    """The learner's processor resizes as the server was told to (train.yaml's budget), and a sample
    over the token limits is left out of the update and counted, not truncated."""
    from osfarm.schema.budget import Budget

    big = make_sample([{"role": "user", "content": [
        {"type": "text", "text": "Click."}, {"type": "image_url", "image_url": {"url": _png((1, 2, 3))}}]}],
        [101, 102], None, advantage=1.0)
    plain = Learner(model_dir, LearnerOptions(lr=1e-3))
    small = Learner(model_dir, LearnerOptions(lr=1e-3, budget=Budget(max_pixels=28 * 28 * 16, max_prompt_tokens=80,
                                                                     max_response_tokens=3)))
    assert small.encode(big).prompt_len < plain.encode(big).prompt_len
    long_reply = make_sample(MESSAGES, [101, 102, 103, 104], None, advantage=-1.0)
    stats = small.update([big, long_reply])
    assert stats.extra["overlong_samples"] == 1.0 and stats.samples == 1  # the long reply is out
    assert small.encode(big).prompt_len <= 80 < plain.encode(big).prompt_len
    over = Learner(model_dir, LearnerOptions(lr=1e-3, budget=Budget(max_prompt_tokens=10)))
    stats = over.update([big])
    assert stats.skipped and stats.extra["overlong_samples"] == 1.0 and over.version == 0
