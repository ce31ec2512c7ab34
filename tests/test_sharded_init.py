"""Sharded model init under FSDP2 (issue 28, item 2): only rank 0 reads the weights, every rank
ends up holding about half of the policy and half of the KL reference, and the sharded models
are the ones a single process loads (same weights, same log-probs). Two gloo ranks on the CPU run
the code path of GPU runs (``fsdp: on``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from osfarm.policy.tiny import tiny_model_dir
from osfarm.trainer.learner import Learner, LearnerOptions, LossOptions

sys.path.insert(0, str(Path(__file__).parent))
from test_learner import MESSAGES, TEXT_ONLY, make_sample  # noqa: E402

RANKS = """
import json, sys
from pathlib import Path
import torch
import transformers
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from safetensors.torch import load_file, save_file
sys.path.insert(0, {tests!r})
from test_learner import make_sample, MESSAGES, TEXT_ONLY
from osfarm.trainer.distributed import DistContext
from osfarm.trainer.learner import Learner, LearnerOptions, LossOptions
from osfarm.trainer.model_init import local_numel

reads = []  # every weight read this rank makes
cls = transformers.AutoModelForImageTextToText
real = cls.from_pretrained.__func__
cls.from_pretrained = classmethod(lambda c, *a, **k: reads.append(str(a[0])) or real(c, *a, **k))

def trained(lrn):  # weights one update away from the base (a resume's load), read on rank 0 alone
    reads.append("trained")
    lrn.model.load_state_dict(load_file({trained!r}))


torch.set_num_threads(1)
ctx = DistContext.from_env()
out = Path({out!r})
opts = LearnerOptions(lr=1e-3, fsdp="on", micro_batch_size=2, loss=LossOptions(kl_coef=0.1))
lrn = Learner(Path({base!r}), opts, ctx=ctx, before_sharding=trained)
samples = [make_sample(m, ids, None) for m, ids in [(MESSAGES, [107, 108, 109]), (TEXT_ONLY, [121, 122])]]
scores = lrn.score_many(samples)  # forward passes are collectives: every rank runs them
refs = [lrn.reference_logprobs(lrn.encode(s))[0].tolist() for s in samples]
full = StateDictOptions(full_state_dict=True, cpu_offload=True)
policy = get_model_state_dict(lrn.model, options=full)
reference = get_model_state_dict(lrn.ref_model, options=full)
report = dict(reads=reads, policy_local=local_numel(lrn.model), ref_local=local_numel(lrn.ref_model),
              policy_total=sum(p.numel() for p in lrn.model.parameters()),
              ref_total=sum(p.numel() for p in lrn.ref_model.parameters()), scores=scores, refs=refs)
(out / f"rank{{ctx.rank}}.json").write_text(json.dumps(report))
if ctx.is_main:
    save_file({{k: v.contiguous() for k, v in policy.items()}}, str(out / "policy.safetensors"))
    save_file({{k: v.contiguous() for k, v in reference.items()}}, str(out / "reference.safetensors"))
    lrn.stop_workers()
else:
    lrn.serve_commands()
"""


def test_sharded_init_loads_once_and_holds_half_per_rank(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    base = tiny_model_dir()
    samples = [make_sample(m, ids, None) for m, ids in [(MESSAGES, [107, 108, 109]), (TEXT_ONLY, [121, 122])]]
    # weights one update away from the base: the policy starts from them, the reference is the base
    first = Learner(base, LearnerOptions(lr=1e-2))
    first.update([make_sample(MESSAGES, [107, 108], None, advantage=1.0),
                  make_sample(TEXT_ONLY, [121], None, advantage=-1.0)])
    trained = tmp_path / "trained.safetensors"
    save_file({k: v.contiguous() for k, v in first.model.state_dict().items()}, str(trained))
    script = tmp_path / "ranks.py"
    script.write_text(RANKS.format(tests=str(Path(__file__).parent), out=str(tmp_path), base=str(base),
                                  trained=str(trained)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]

    # rank 0 reads the policy, the trained weights and the reference; rank 1 reads nothing
    assert ranks[0]["reads"] == [str(base), "trained", str(base)] and ranks[1]["reads"] == []
    for rk in ranks:
        for part in ("policy", "ref"):
            share = rk[f"{part}_local"] / rk[f"{part}_total"]
            assert 0.4 < share < 0.6, (part, share)  # each rank holds about half, the reference too

    plain = Learner(base, LearnerOptions(lr=1e-3, loss=LossOptions(kl_coef=0.1)),
                    before_sharding=lambda lrn: lrn.model.load_state_dict(load_file(str(trained))))
    for name, model in (("policy", plain.model), ("reference", plain.ref_model)):
        got = load_file(str(tmp_path / f"{name}.safetensors"))
        want = model.state_dict()
        assert sorted(got) == sorted(want), name
        for k in want:
            assert torch.equal(got[k].to(want[k].dtype), want[k]), (name, k)
    assert not torch.equal(load_file(str(tmp_path / "policy.safetensors"))["lm_head.weight"],
                           load_file(str(tmp_path / "reference.safetensors"))["lm_head.weight"])
    want_scores = plain.score_many(samples)
    want_refs = [plain.reference_logprobs(plain.encode(s))[0].tolist() for s in samples]
    for rk in ranks:
        for got_row, want_row in zip(rk["scores"], want_scores, strict=True):
            assert got_row == pytest.approx(want_row, abs=1e-5)
        for got_row, want_row in zip(rk["refs"], want_refs, strict=True):
            assert got_row == pytest.approx(want_row, abs=1e-5)
