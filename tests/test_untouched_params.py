"""A parameter that no rank's forward passes reached is left out of the optimizer step, as one
rank leaves it (issue 28, item 2). On one rank a minibatch with no screenshot gives the vision
tower no gradient (``grad`` None) and AdamW skips it: no weight decay, no moment decay, no step
counted. Under FSDP2 every rank joins the reduce-scatter with zeros for the parameters it did
not use (``model_init.shard_units``), so without more the tower would step on a zero gradient
and drift on every text-only minibatch (history without images, replayed turns). Data parallel
(``all_reduce_grads``) sums the gradients of the ranks that have one and keeps none where no
rank has.

One update of two optimizer steps (``minibatches`` 2, weight decay on), launched once with two
gloo ranks on the CPU that run it under FSDP2 and under data parallel: the first minibatch is
text-only on both ranks, the second gives one rank a screenshot and the other a text-only
sample. Every weight, moment and step count is the one a single rank ends with. Below, the two
parts on one process: the forward hooks, and the gradients dropped (a world of one gloo rank)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from osfarm.policy.tiny import tiny_model_dir
from osfarm.trainer.distributed import drop_unreached_grads
from osfarm.trainer.forward_reach import ForwardReach
from osfarm.trainer.learner import Learner, LearnerOptions

sys.path.insert(0, str(Path(__file__).parent))
from test_learner import MESSAGES, TEXT_ONLY, make_sample  # noqa: E402
from test_resume_rank_counts import _assert_moments_close, _moments  # noqa: E402

OPTS = {"lr": 1e-2, "weight_decay": 0.1, "micro_batch_size": 1, "minibatches": 2}
# minibatch k holds samples k, k + 2: the first [TEXT_ONLY, TEXT_ONLY], the second [MESSAGES,
# TEXT_ONLY]; with two samples each, each rank computes one
BATCH = [(TEXT_ONLY, [107, 108], 1.0), (MESSAGES, [121, 122, 123], -1.0),
         (TEXT_ONLY, [131], -0.5), (TEXT_ONLY, [141, 142], 1.0)]

RANKS = """
import sys
from pathlib import Path
import torch
from torch.distributed.tensor import DTensor
sys.path.insert(0, {tests!r})
from test_untouched_params import OPTS, batch
from osfarm.trainer.distributed import DistContext, leave_process_groups
from osfarm.trainer.learner import Learner, LearnerOptions
from osfarm.trainer.optimizer_state import param_names

def whole(t):  # a collective under FSDP: every rank calls it, in the same order
    return t.full_tensor() if isinstance(t, DTensor) else t

torch.set_num_threads(1)
ctx = DistContext.from_env()
for fsdp in ("on", "off"):
    # every rank holds the batch and runs the update rank 0's command would start
    lrn = Learner(Path({model!r}), LearnerOptions(**OPTS, fsdp=fsdp), ctx=ctx)
    assert lrn.fsdp == (fsdp == "on")
    lrn._update(batch())
    got = {{}}
    for name, p in zip(param_names(lrn.model, lrn.optimizer), lrn.params, strict=True):
        state = {{k: whole(v).detach().clone() for k, v in lrn.optimizer.state[p].items()}}
        got[name] = dict(weight=whole(p).detach().clone(), state=state)
    if ctx.is_main:
        torch.save(got, Path({out!r}) / f"fsdp-{{fsdp}}.pt")
    lrn.commands = None
leave_process_groups()
"""


def batch() -> list[Any]:
    return [make_sample(m, ids, None, advantage=a) for m, ids, a in BATCH]


def test_an_fsdp_and_a_data_parallel_update_leave_unreached_parameters_as_one_rank_does(tmp_path: Path) -> None:
    model = tiny_model_dir()
    script = tmp_path / "ranks.py"
    script.write_text(RANKS.format(tests=str(Path(__file__).parent), out=str(tmp_path), model=str(model)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    one = Learner(model, LearnerOptions(**OPTS))
    one.update(batch())
    want = _moments(one)
    weights = {n: p.detach() for n, p in one.model.named_parameters() if p.requires_grad}
    vision = [n for n in weights if ".visual." in f".{n}"]
    assert vision and all(int(want[n]["step"]) == 1 for n in vision)  # the second minibatch alone reached it
    assert all(int(want[n]["step"]) == 2 for n in weights if n not in vision)
    for mode in ("on", "off"):
        got = torch.load(tmp_path / f"fsdp-{mode}.pt", weights_only=True)
        assert sorted(got) == sorted(weights), mode
        assert [int(got[n]["state"]["step"]) for n in vision] == [1] * len(vision), mode  # FSDP without: 2
        _assert_moments_close({n: g["state"] for n, g in got.items() if g["state"]}, want)
        for n, w in weights.items():
            # Adam's normalised steps turn summing-order noise into ~1e-6 here; a step taken or
            # skipped wrongly moves a weight by ~lr = 1e-2
            torch.testing.assert_close(got[n]["weight"], w, rtol=1e-4, atol=1e-5, msg=f"{mode}: {n}")


class _TwoBranches(torch.nn.Module):
    """``image`` runs only when its input is given, as a VLM's vision tower; ``head`` is tied to
    ``text``'s weight."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.image, self.head = (torch.nn.Linear(2, 2, bias=False) for _ in range(3))
        self.head.weight = self.text.weight
        self.scale = torch.nn.Parameter(torch.ones(()))  # used by the root's own forward

    def forward(self, x: torch.Tensor, pixels: torch.Tensor | None = None) -> torch.Tensor:
        y = self.text(x) * self.scale
        if pixels is not None:
            y = y + self.image(pixels)
        return y.sum()


def test_forward_reach_names_the_parameters_whose_modules_ran_with_gradients() -> None:
    m = _TwoBranches()
    params = [m.text.weight, m.image.weight, m.scale]
    reach = ForwardReach(m, params)
    with torch.no_grad():
        m(torch.ones(1, 2), torch.ones(1, 2))
    assert reach.reached() == [False, False, False]  # a pass without gradients trains nothing
    m(torch.ones(1, 2))
    assert reach.reached() == [True, False, True]
    m(torch.ones(1, 2), torch.ones(1, 2))
    assert reach.reached() == [True, True, True]
    reach.clear()
    assert reach.reached() == [False, False, False]
    reach.remove()
    m(torch.ones(1, 2))
    assert reach.reached() == [False, False, False]


@pytest.fixture()
def one_gloo_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    import torch.distributed as dist

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dropped_gradients_are_the_unreached_zero_ones(one_gloo_rank: None) -> None:
    """A parameter the hooks did not see keeps a gradient that is not all zero (used outside its
    module's forward); one they saw keeps even a zero one (a LoRA A at its first step)."""
    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    ps[0].grad, ps[1].grad, ps[2].grad = torch.zeros(3), torch.zeros(3), torch.tensor([0.0, 0.5, 0.0])
    drop_unreached_grads(ps, [True, False, False, False])
    assert [p.grad is not None for p in ps] == [True, False, True, False]
