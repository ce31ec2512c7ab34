"""The learner past one device: ``torch.distributed`` ranks started with torchrun semantics.

``osfarm train --nproc N`` re-runs the same command under ``torch.distributed.run`` (torchrun:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` in each process's
environment); running ``torchrun --nproc-per-node N -m osfarm.cli train ...`` by hand (or with
``--nnodes`` on several machines) is the same. Rank 0 runs the whole trainer (farm, rollouts, data
manager, weight sync) and its learner; the other ranks run only a learner and wait for rank 0's
commands (:class:`Commands`): ``update`` with the batch, ``save`` with the checkpoint path, ``stop``.

Every rank holds the whole batch and computes its own share of the samples (:func:`shard`), so the
update is the one a single rank would make: each sample's loss is weighted by its share of the
whole minibatch's tokens, the ranks' gradients are summed, and every rank takes the same optimizer
step. On CPUs (gloo) each rank keeps a full replica and the gradients are all-reduced
(:func:`all_reduce_grads`); on GPUs (NCCL) the model is sharded with FSDP2 ``fully_shard`` (fp32
master shards, bf16 compute) and the reduce-scatter happens in the backward pass. Either way a
parameter that no rank used (the vision tower, in a minibatch without a screenshot) has no
gradient at the step and the optimizer skips it, as on one rank (:func:`drop_unreached_grads`).

Commands travel on a gloo group of their own with a long timeout: rank 0 may roll out for hours
between two updates, while a collective inside an update that hangs is a failure to report.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

COMMAND_TIMEOUT = dt.timedelta(days=7)
COMPUTE_TIMEOUT = dt.timedelta(minutes=30)


@dataclass(frozen=True)
class DistContext:
    """Where this process stands among the learner ranks (world 1: not distributed)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def multi_node(self) -> bool:
        return self.world > self.local_world

    @classmethod
    def from_env(cls) -> DistContext:
        """torchrun's variables (none set: a single process)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        return cls(rank=int(os.environ["RANK"]), world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   local_world=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def torchrun_argv(nproc: int, argv: Sequence[str]) -> list[str]:
    """The command line that runs ``osfarm <argv>`` as ``nproc`` ranks on this machine (torchrun,
    standalone rendezvous on a free port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "osfarm.cli", *argv]


def init_process_groups(ctx: DistContext, device: torch.device) -> Any:
    """Join the ranks: the default group for compute (NCCL on GPUs, gloo on CPUs) and a gloo group
    for commands; returns the command group."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, timeout=COMPUTE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)


def leave_process_groups() -> None:
    """This rank's last collective: every rank meets, then drops its process groups. A rank that
    exits while gloo's threads still talk to a peer that already left aborts ("terminate called
    without an active exception", exit code -6), about every other run here."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard(indices: Sequence[int], lengths: Sequence[int], rank: int, world: int) -> list[int]:
    """The samples (of ``indices``) rank ``rank`` computes: longest first, dealt round-robin, so
    the ranks get about the same number of tokens and a micro-batch holds samples of similar length."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    return order[rank::world]


def all_reduce_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum the gradients of a data-parallel replica over the ranks, flattened into one buffer per
    dtype. A parameter no rank has a gradient for keeps none (the optimizer skips it, as on one
    rank); one that some ranks lack counts as 0 there."""
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                       device=params[0].device if params else None)
    dist.all_reduce(has, op=dist.ReduceOp.SUM)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}  # the parameters' gradients, summed in place
    for p, anywhere in zip(params, has.tolist(), strict=True):
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n


def drop_unreached_grads(params: Sequence[torch.nn.Parameter], reached: Sequence[bool]) -> None:
    """FSDP2: set to None the gradient of every parameter that no rank's forward passes reached
    (``reached``: this rank's view, ``forward_reach.py``), so the optimizer skips it as one rank
    does; FSDP2 reduce-scatters zeros for those. A parameter with a non-zero gradient somewhere
    keeps it, whatever the hooks saw (one used outside its module's forward). Every rank drops
    the same ones: the gradient-norm clip and the step are collectives over the same tensors."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank

    if not params:
        return
    keep = torch.tensor([bool(r) for r in reached], dtype=torch.int32, device=local(params[0]).device)
    unreached = {i: p.grad for i, (p, r) in enumerate(zip(params, reached, strict=True))
                 if not r and p.grad is not None}
    if unreached:  # one transfer for all of them, not a device sync per parameter
        keep[list(unreached)] = torch.stack([local(g).any() for g in unreached.values()]).to(torch.int32)
    dist.all_reduce(keep, op=dist.ReduceOp.SUM)
    for p, anywhere in zip(params, keep.tolist(), strict=True):
        if not anywhere:
            p.grad = None


def all_reduce_floats(values: Sequence[float], device: torch.device) -> list[float]:
    """Element-wise sum of a list of floats over the ranks."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


class Commands:
    """Rank 0 tells the other learner ranks what to do next; they block in :meth:`receive`."""

    def __init__(self, ctx: DistContext, group: Any):
        self.ctx = ctx
        self.group = group

    def send(self, name: str, payload: Any = None) -> None:
        if not self.ctx.is_main:
            raise RuntimeError("only rank 0 sends learner commands")
        dist.broadcast_object_list([(name, payload)], src=0, group=self.group)

    def receive(self) -> tuple[str, Any]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        name, payload = box[0]
        return name, payload
