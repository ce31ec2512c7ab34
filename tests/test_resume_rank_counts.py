"""A checkpoint resumes whatever the rank count that saved it (issue 28, item 2): one optimizer
format on disk (keyed by parameter name), read by rank 0 alone under FSDP, the others sent their
shards. Saved on one rank, resumed by two FSDP2 ranks (gloo on the CPU: the code path of GPU
runs), saved there and resumed on one rank again: the moments, step counts and lr schedule
position come back, and each update is the one a single rank makes continuing without a break.
The full fine-tune runs on a model whose output embeddings are tied to its input ones (as
Qwen2-VL-2B's are): the tie survives the sharded init. The FSDP update gives one rank a sample
with a screenshot and the other a text-only one (a rank without vision-tower gradients still
joins the reduce-scatter). Files of earlier versions (moments keyed by position) still resume."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from osfarm.policy.tiny import tiny_model_dir
from osfarm.trainer.checkpoint import OPTIMIZER_FILE, train_state_dir
from osfarm.trainer.learner import Learner, LearnerOptions, LoraOptions
from osfarm.trainer.optimizer_state import indexed, named, param_names

sys.path.insert(0, str(Path(__file__).parent))
from test_learner import MESSAGES, TEXT_ONLY, make_sample  # noqa: E402

# the lr warms up over the first steps, so an update after a resume shows the schedule's position
OPTS = {"lr": 1e-2, "warmup_steps": 4, "micro_batch_size": 1}
# the update on two ranks gives one the sample with a screenshot, the other a text-only one: a
# rank with no gradient for the vision tower still joins the reduce-scatter
BATCHES = [[(MESSAGES, [107, 108], 1.0), (TEXT_ONLY, [121, 122, 123], -1.0)],
           [(TEXT_ONLY, [131], 1.0), (MESSAGES, [141, 142, 143], -0.5)],
           [(MESSAGES, [151, 152], -1.0), (TEXT_ONLY, [161, 162], 1.0)]]

RANKS = """
import json, sys
from pathlib import Path
import torch
from torch.distributed.tensor import DTensor
sys.path.insert(0, {tests!r})
from test_learner import make_sample
from test_resume_rank_counts import BATCHES, options
from osfarm.trainer.distributed import DistContext
from osfarm.trainer.learner import Learner
from osfarm.trainer.optimizer_state import param_names

reads = []  # the optimizer files this rank reads
real_load = torch.load
torch.load = lambda f, *a, **k: (isinstance(f, (str, Path)) and reads.append(Path(f).name)) or real_load(f, *a, **k)
torch.set_num_threads(1)
ctx = DistContext.from_env()
out = Path({out!r})
lrn, _ = Learner.resume(Path({ckpt!r}), options({lora!r}, fsdp="on"), ctx=ctx)
assert lrn.fsdp
m = lrn.model.get_base_model() if hasattr(lrn.model, "get_base_model") else lrn.model
tied = m.lm_head.weight is m.get_input_embeddings().weight
torch.load = real_load
local = {{}}  # this rank's slices of the moments, as the resume left them
for name, p in zip(param_names(lrn.model, lrn.optimizer), lrn.params, strict=True):
    st = lrn.optimizer.state[p]
    local[name] = {{k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in st.items()}}
torch.save(dict(moments=local, reads=reads, tied=tied), out / f"rank{{ctx.rank}}.pt")
if ctx.is_main:
    stats = lrn.update([make_sample(m, ids, None, advantage=a) for m, ids, a in BATCHES[1]])
    lrn.save(out / "v2")
    lrn.stop_workers()
    (out / "stats.json").write_text(json.dumps(dict(stats.as_dict(), counters=lrn.counters)))
else:
    lrn.serve_commands()
"""


def options(lora: bool, **more: Any) -> LearnerOptions:
    return LearnerOptions(**OPTS, lora=LoraOptions(r=4, alpha=8) if lora else None, **more)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with ``lm_head.weight`` tied to the input embeddings."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    src, dst = tiny_model_dir(), tmp_path_factory.mktemp("tied")
    config = AutoConfig.from_pretrained(src)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = True
    model = AutoModelForImageTextToText.from_pretrained(src, config=config)
    model.lm_head.weight = model.get_input_embeddings().weight
    model.save_pretrained(dst)
    for f in src.iterdir():  # the processor's files
        if not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)
    return dst


def _batch(i: int) -> list[Any]:
    return [make_sample(m, ids, None, advantage=a) for m, ids, a in BATCHES[i]]


def _moments(lrn: Learner) -> dict[str, Any]:
    return named(lrn.optimizer.state_dict(), param_names(lrn.model, lrn.optimizer))["state"]


def _assert_moments_close(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert float(got[name]["step"]) == float(want[name]["step"]), name
        for k in ("exp_avg", "exp_avg_sq"):
            g, w = got[name][k].float(), want[name][k].float()
            # float noise of summing the gradients in another order, against the tensor's own scale
            err = float((g - w).abs().max()) / max(float(w.abs().max()), 1e-30)
            assert err < 1e-3, (name, k, err)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_saved_on_one_rank_resumed_by_two_fsdp_ranks_and_back(tmp_path: Path, lora: bool,
                                                               tied_model_dir: Path) -> None:
    if lora:
        pytest.importorskip("peft")
    base = tiny_model_dir() if lora else tied_model_dir
    one = Learner(base, options(lora))  # the run that never stops
    assert (one.model.lm_head.weight is one.model.get_input_embeddings().weight) is not lora
    one.update(_batch(0))
    ckpt = one.save(tmp_path / "v1")
    saved = torch.load(train_state_dir(ckpt) / OPTIMIZER_FILE, weights_only=True)

    script = tmp_path / "ranks.py"
    script.write_text(RANKS.format(tests=str(Path(__file__).parent), out=str(tmp_path), ckpt=str(ckpt), lora=lora))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    # each rank holds its slice (FSDP2 cuts dim 0 as torch.chunk does) of the saved moments
    dumps = [torch.load(tmp_path / f"rank{i}.pt", weights_only=True) for i in (0, 1)]
    assert dumps[0]["reads"] == [OPTIMIZER_FILE] and dumps[1]["reads"] == []  # rank 0 alone reads the file
    assert [d["tied"] for d in dumps] == [not lora] * 2  # rank 0's loaded model was tied before sharding too
    ranks = [d["moments"] for d in dumps]
    assert sorted(ranks[0]) == sorted(saved["state"]) == sorted(ranks[1])
    for name, full in saved["state"].items():
        assert int(full["step"]) == 1
        for k in ("exp_avg", "exp_avg_sq"):
            parts = list(full[k].chunk(2, dim=0))
            for i, rk in enumerate(ranks):
                want = parts[i] if i < len(parts) else full[k][:0]
                assert torch.equal(rk[name][k], want), (name, k, i)
                assert torch.equal(rk[name]["step"], full["step"]), (name, i)
    assert sum(rk[n]["exp_avg"].numel() for rk in ranks for n in rk) == sum(
        f["exp_avg"].numel() for f in saved["state"].values())

    # the two ranks' update is the one the unbroken run makes, at the same point of the schedule
    two = json.loads((tmp_path / "stats.json").read_text())
    cont = one.update(_batch(1))
    assert two["version"] == cont.version == 2 and two["counters"] == one.counters
    assert two["lr"] == pytest.approx(cont.lr) and cont.lr == pytest.approx(1e-2 * 2 / 4)
    assert two["loss"] == pytest.approx(cont.loss, abs=1e-5)
    assert two["grad_norm"] == pytest.approx(cont.grad_norm, rel=1e-4)
    v2 = tmp_path / "v2"
    fsdp_saved = torch.load(train_state_dir(v2) / OPTIMIZER_FILE, weights_only=True)
    _assert_moments_close(fsdp_saved["state"], _moments(one))

    # saved by the FSDP ranks, resumed on one rank: the same moments, and the next update agrees
    back, _ = Learner.resume(v2, options(lora))
    _assert_moments_close(_moments(back), fsdp_saved["state"])
    for k, v in one.model.state_dict().items():
        torch.testing.assert_close(back.model.state_dict()[k], v, rtol=1e-4, atol=1e-6, msg=k)
    a, b = one.update(_batch(2)), back.update(_batch(2))
    assert b.version == a.version == 3 and back.counters == one.counters and b.lr == pytest.approx(a.lr)
    assert b.loss == pytest.approx(a.loss, abs=1e-5)
    _assert_moments_close(_moments(back), _moments(one))
    for k, v in one.model.state_dict().items():
        torch.testing.assert_close(back.model.state_dict()[k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_a_checkpoint_with_moments_keyed_by_position_still_resumes(tmp_path: Path) -> None:
    """Earlier versions saved ``optimizer.state_dict()`` as it is (keyed by position)."""
    one = Learner(tiny_model_dir(), LearnerOptions(**OPTS))
    one.update(_batch(0))
    ckpt = one.save(tmp_path / "v1")
    torch.save(one.optimizer.state_dict(), train_state_dir(ckpt) / OPTIMIZER_FILE)  # the old format
    back, _ = Learner.resume(ckpt, LearnerOptions(**OPTS))
    _assert_moments_close(_moments(back), _moments(one))
    a, b = one.update(_batch(1)), back.update(_batch(1))
    assert b.loss == pytest.approx(a.loss, abs=1e-5) and b.lr == pytest.approx(a.lr)
    _assert_moments_close(_moments(back), _moments(one))


# -- the conversions, on their numbers ---------------------------------------------------------------


def test_position_keyed_state_converts_to_names_by_order_and_back() -> None:
    m = {i: {"step": torch.tensor(float(i + 1)), "exp_avg": torch.full((2,), float(i))} for i in (0, 2)}
    old = {"state": m, "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}]}
    names = ["a.weight", "b.weight", "c.bias"]
    by_name = named(old, names)
    assert by_name["param_groups"] == [{"lr": 0.1, "params": ["a.weight", "b.weight"]},
                                       {"lr": 0.2, "params": ["c.bias"]}]
    assert sorted(by_name["state"]) == ["a.weight", "c.bias"]  # b never stepped: no state
    assert float(by_name["state"]["c.bias"]["step"]) == 3.0 and by_name["state"]["c.bias"]["exp_avg"].tolist() == [2, 2]
    assert named(by_name, names) is by_name
    back = indexed(by_name, names)
    assert back["param_groups"] == old["param_groups"] and back["state"].keys() == old["state"].keys()
    assert float(back["state"][2]["step"]) == 3.0
    # a saved group listing its names in another order still pairs each name with its parameter
    shuffled = {"state": {"b.weight": {"step": 7}}, "param_groups": [{"params": ["b.weight", "a.weight"]}]}
    assert indexed(shuffled, ["a.weight", "b.weight"]) == {"state": {1: {"step": 7}},
                                                            "param_groups": [{"params": [0, 1]}]}


def test_an_optimizer_state_of_another_model_is_a_clear_error() -> None:
    old = {"state": {}, "param_groups": [{"params": [0, 1]}]}
    with pytest.raises(ValueError, match="2 parameters, but the model trains 3"):
        named(old, ["a", "b", "c"])
    with pytest.raises(ValueError, match="missing \\['c'\\]"):
        indexed({"state": {}, "param_groups": [{"params": ["a", "b"]}]}, ["a", "b", "c"])
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        named({"exp_avg": 1}, ["a"])
