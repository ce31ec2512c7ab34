"""Loading the learner's models, and sharding them under FSDP2 without a full copy per rank.

Under FSDP every rank used to load the whole checkpoint (a 7B model in fp32: ~30 GB of host memory
per rank, eight ranks to a machine) and move it whole to its GPU before ``fully_shard`` cut it,
and the frozen KL reference was a whole replica on every rank for the entire run. Here only
rank 0 reads the weights, into host memory; the other ranks build the same module tree on the
``meta`` device (shapes, no storage). Every rank then shards the tree while it is still empty,
allocates just its own shards on its device (``to_empty``), and rank 0 broadcasts the weights
one tensor at a time, each rank keeping its slice (``set_model_state_dict`` with
``broadcast_from_rank0``). The reference is sharded the same way and never gathered whole.

Tied parameters (input and output embeddings) stay one parameter on every rank: moving rank 0's
loaded model to ``meta`` gives each place a parameter of its own, so they are tied again before
sharding, as in the other ranks' twin built from the config.

Buffers are not parameters: FSDP leaves them whole on every rank, and ``state_dict`` omits the
non-persistent ones (the rotary embeddings' ``inv_freq``), which ``to_empty`` leaves as
uninitialised memory; rank 0 broadcasts all of them after the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from osfarm.policy.progress import hf_progress_bars_off
from osfarm.trainer.distributed import DistContext


def load_model(path: Path, dtype: torch.dtype, *, meta: bool = False) -> Any:
    """The VLM at ``path`` in ``dtype``; with ``meta`` its module tree only (no weights read)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    with hf_progress_bars_off():
        if not meta:
            return AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype)
        config = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            return AutoModelForImageTextToText.from_config(config, dtype=dtype)


def shard_units(model: Any, compute_dtype: torch.dtype) -> None:
    """FSDP2: each language-model decoder layer its own unit, then the root; the shards keep
    their dtype (fp32 master), compute runs in ``compute_dtype``, gradients are reduced in fp32.

    The vision tower stays in the root unit: a rank whose micro-batch has no image skips it, and
    a unit of its own would then all-gather on some ranks and not on others (a collective
    mismatch that hangs or aborts the ranks); the root unit is gathered by every forward. Its
    gradients are the same problem: a rank whose share of a minibatch has no image has none for
    the vision tower, and its reduce-scatter would be shorter than the others' (gloo: "Received
    data size doesn't match expected size"), so such a rank contributes zeros. A minibatch with
    no image on any rank then gives the tower a zero gradient, which the learner drops before the
    step (``distributed.drop_unreached_grads``): one rank would have none and skip it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    units = set(getattr(model, "_no_split_modules", None) or [])
    for name, m in model.named_modules():
        if type(m).__name__ in units and "visual" not in name.split(".") and "Vision" not in type(m).__name__:
            fully_shard(m, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if hasattr(model, "set_reduce_scatter_unused_params"):  # recent torch (2.13 has it); older: as before
        model.set_reduce_scatter_unused_params(True)


def shard_from_rank0(model: Any, ctx: DistContext, device: torch.device, compute_dtype: torch.dtype) -> None:
    """Shard ``model`` over the ranks, in place: on rank 0 the loaded model (host memory), on the
    others its ``meta`` twin (:func:`load_model` with ``meta``); every rank calls it (collectives).
    Afterwards each rank holds its shards of every parameter on ``device`` and whole buffers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if ctx.is_main:
        # the tensors stay alive in these dicts after the module itself goes to meta below
        weights = {k: v.detach() for k, v in model.state_dict().items()}
        buffers = {k: v.detach() for k, v in model.named_buffers()}
        ties = _tied(model)
        model.to("meta")  # a new parameter per place: tied embeddings come apart here
        _retie(model, ties)  # as the other ranks' meta twin has them, or the ranks shard different trees
    else:
        weights, buffers = {}, {}
    shard_units(model, compute_dtype)
    model.to_empty(device=device)  # this rank's shards only, uninitialised
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    weights.clear()  # rank 0's host copy goes as soon as every rank has its slices
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if ctx.is_main:
                buf.copy_(buffers[name])
            dist.broadcast(buf, src=0)


def _tied(model: Any) -> list[list[str]]:
    """The names of each parameter registered in several places (tied input and output
    embeddings: ``lm_head.weight`` is ``embed_tokens.weight``)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def _retie(model: Any, ties: list[list[str]]) -> None:
    """Make each group of :func:`_tied`'s names one parameter again (its first name's)."""
    for names in ties:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)


def load_reference(path: Path, dtype: torch.dtype, ctx: DistContext, device: torch.device, *,
                   fsdp: bool) -> Any:
    """The frozen KL reference in ``dtype``: sharded over the ranks like the policy under
    ``fsdp`` (its forward passes are then collectives, run in step with the policy's), whole on
    ``device`` otherwise."""
    model = load_model(path, dtype, meta=fsdp and not ctx.is_main)
    model.eval().requires_grad_(False)
    if fsdp:
        shard_from_rank0(model, ctx, device, dtype)
    else:
        model.to(device)
    return model


def local_numel(model: Any) -> int:
    """Parameter elements this rank stores (its shards under FSDP; everything otherwise)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
