"""Saving the learner off the update's critical path (issue 28): served weights every version,
full checkpoints every ``checkpoint_every`` written in the background from a snapshot, LoRA
adapters alone unless merged weights are asked for, and a LoRA adapter saved whole from a model
sharded over two gloo ranks (FSDP2 on the CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_learner import MESSAGES, TEXT_ONLY, make_sample

from osfarm.policy.tiny import tiny_model_dir
from osfarm.trainer.checkpoint import STATE_FILE, latest_checkpoint, prune_checkpoints
from osfarm.trainer.config import TrainConfigError, load_train_config
from osfarm.trainer.learner import Learner, LearnerOptions, LoraOptions


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


def test_a_background_checkpoint_holds_the_state_of_its_version(model_dir: Path, tmp_path: Path) -> None:
    """``save(background=True)`` returns once the served weights are written; the optimizer state
    it writes later is the one of the saved version, though the next update has already changed
    the live moments by then (the snapshot is a copy)."""
    lrn = Learner(model_dir, LearnerOptions(lr=1e-3))
    s = make_sample(MESSAGES, [107, 108], None, advantage=1.0)
    lrn.update([s])
    want = {k: v.clone() for k, v in lrn.optimizer.state_dict()["state"][0].items()}
    release = threading.Event()
    lrn.writer._pool.submit(release.wait, 60)  # the writer thread is busy: the write waits its turn
    ckpt = lrn.save(tmp_path / "v1", {"note": "x"}, lambda d: (d / "extra.json").write_text("{}"), background=True)
    assert (ckpt / "model" / "model.safetensors").is_file()  # what the weight sync needs, there now
    assert (ckpt / "state" / "extra.json").is_file()
    assert not (ckpt / STATE_FILE).exists() and latest_checkpoint(tmp_path) is None  # not a checkpoint yet
    lrn.update([s])  # moves the live moments while the write is pending
    assert not torch.equal(lrn.optimizer.state_dict()["state"][0]["exp_avg"], want["exp_avg"])
    release.set()
    lrn.wait_saved()
    assert latest_checkpoint(tmp_path) == ckpt
    first = next(name for name, p in lrn.model.named_parameters() if p is lrn.params[0])  # keyed by name
    saved = torch.load(ckpt / "state" / "optimizer.pt", weights_only=True)["state"][first]
    assert all(torch.equal(saved[k], want[k]) for k in want)
    state = json.loads((ckpt / STATE_FILE).read_text())
    assert state["version"] == 1 and state["note"] == "x"
    back, _ = Learner.resume(ckpt, LearnerOptions(lr=1e-3))
    assert back.version == 1


def test_weights_only_versions_are_synced_then_pruned(model_dir: Path, tmp_path: Path) -> None:
    """Between full checkpoints a version gets its served weights only: never resumed from, and
    pruned once a newer version is written."""
    lrn = Learner(model_dir, LearnerOptions(lr=1e-3))
    s = make_sample(TEXT_ONLY, [121, 122], None, advantage=1.0)
    for v in (1, 2, 3):
        lrn.update([s])
        lrn.save(tmp_path / f"v{v}", full=v == 2, background=True)
        prune_checkpoints(tmp_path, keep=3)
    lrn.wait_saved()
    assert sorted(d.name for d in tmp_path.iterdir()) == ["v2", "v3"]  # v1 (weights only) went
    assert (tmp_path / "v3" / "model" / "config.json").is_file() and not (tmp_path / "v3" / "state").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "v2"


def test_train_yaml_sets_checkpoint_every_and_when_lora_writes_merged_weights(tmp_path: Path) -> None:
    cfg = tmp_path / "train.yaml"
    cfg.write_text("checkpoint_every: 5\nlearner:\n  temperature: 0.1\n  lora: {r: 4}\n")
    got = load_train_config(cfg)
    assert got.checkpoint_every == 5
    assert got.learner.lora is not None and got.learner.lora.save_merged  # spawned CPU servers load merged weights
    cfg.write_text("learner:\n  temperature: 0.1\n  lora: {r: 4}\n"
                   "policy:\n  servers: [{url: 'http://127.0.0.1:9', kind: vllm_lora}]\n")
    got = load_train_config(cfg)
    assert got.learner.lora is not None and got.learner.lora.save_merged is False  # vLLM: adapters only
    cfg.write_text("learner:\n  temperature: 0.1\n  lora: {r: 4, save_merged: false}\n")
    with pytest.raises(TrainConfigError, match="save_merged"):
        load_train_config(cfg)
    cfg.write_text("checkpoint_every: 0\n")
    with pytest.raises(TrainConfigError, match="checkpoint_every"):
        load_train_config(cfg)


LORA_RANKS = """
import sys
from pathlib import Path
import torch
from osfarm.trainer.distributed import DistContext
from osfarm.trainer.learner import Learner, LearnerOptions, LoraOptions
sys.path.insert(0, {tests!r})
from test_learner import make_sample, MESSAGES, TEXT_ONLY

torch.set_num_threads(1)
ctx = DistContext.from_env()
lrn = Learner(Path({model!r}), LearnerOptions(lr=1e-2, fsdp="on", lora=LoraOptions(r=4, alpha=8)), ctx=ctx)
samples = [make_sample(m, ids, None, advantage=a) for m, ids, a in
           [(MESSAGES, [107, 108, 109], -1.0), (TEXT_ONLY, [121], 1.0), (MESSAGES, [131, 132], 1.0)]]
if ctx.is_main:
    lrn.update(samples)
    lrn.save(Path({out!r}) / "v1", background=True)
    lrn.stop_workers()
else:
    lrn.serve_commands()
"""


def test_a_lora_adapter_saved_from_fsdp_shards_is_the_whole_adapter(model_dir: Path, tmp_path: Path) -> None:
    """LoRA under FSDP2 with 2 ranks (gloo): the adapter rank 0 writes is cut from the gathered
    state dict, so every LoRA matrix has its full shape and the values one rank trains to."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    script = tmp_path / "ranks.py"
    script.write_text(LORA_RANKS.format(tests=str(Path(__file__).parent), model=str(model_dir), out=str(tmp_path)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    one = Learner(model_dir, LearnerOptions(lr=1e-2, lora=LoraOptions(r=4, alpha=8)))
    one.update([make_sample(m, ids, None, advantage=a) for m, ids, a in
                [(MESSAGES, [107, 108, 109], -1.0), (TEXT_ONLY, [121], 1.0), (MESSAGES, [131, 132], 1.0)]])
    want = load_file(str(one.save(tmp_path / "one") / "adapter" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "v1" / "adapter" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and want
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert torch.allclose(got[k], want[k], atol=1e-5), k
    assert json.loads((tmp_path / "v1" / STATE_FILE).read_text())["lora"] is True
