"""The optimizer's state on disk: keyed by parameter name, so any rank count can resume it.

``torch.optim.Optimizer.state_dict()`` keys each parameter's moments by its position among the
optimizer's parameters (``{"state": {0: {...}}, "param_groups": [{"params": [0, 1, ...]}]}``);
the full state dict that FSDP2 gathers (``get_optimizer_state_dict(full_state_dict=True)``) keys
them by the parameter's name (its fully qualified name in the model: ``model.layers.0.mlp...``),
and ``set_optimizer_state_dict`` loads only that form into sharded parameters. Checkpoints store
the name-keyed form whatever the rank count that saved them; a single-rank (or data-parallel)
learner converts on the way out and in. Files of earlier versions hold the position-keyed form
of a single rank: the positions follow the learner's parameter order, which every rank count
shares (``model.parameters()`` with ``requires_grad``), so they convert by that order.

The conversions are pure functions of a state dict and the parameter names in optimizer order;
:func:`load` is a resume's reader: under FSDP only rank 0 reads the file (a full fine-tune's
moments are twice the fp32 weights: ~56 GB for 7B, which eight ranks each reading whole would
hold eight times over) and the others receive just their slices of each tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

STATE = "state"
GROUPS = "param_groups"
PARAMS = "params"


def param_names(model: Any, optimizer: Any) -> list[str]:
    """The name of each of ``optimizer``'s parameters in ``model``, in the optimizer's order
    (the order its state dict numbers them in)."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for p in group[PARAMS]:
            if id(p) not in by_id:
                raise ValueError(f"an optimizer parameter of shape {tuple(p.shape)} is not a parameter of the model")
            names.append(by_id[id(p)])
    return names


def _ids(sd: dict[str, Any]) -> list[Any]:
    return [i for group in sd.get(GROUPS, []) for i in group[PARAMS]]


def is_named(sd: dict[str, Any]) -> bool:
    """Whether ``sd`` keys its parameters by name (an empty optimizer's by its groups alone)."""
    return all(isinstance(i, str) for i in _ids(sd)) and all(isinstance(k, str) for k in sd.get(STATE, {}))


def _checked(sd: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(sd, dict) or STATE not in sd or GROUPS not in sd:
        raise ValueError(f"not an optimizer state dict: expected the keys {STATE!r} and {GROUPS!r}, "
                         f"got {sorted(sd) if isinstance(sd, dict) else type(sd).__name__}")
    return sd


def named(sd: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``sd`` keyed by parameter name: the position-keyed form (``optimizer.state_dict()``)
    converted by order, ``names[i]`` for position ``i`` of the groups' parameters together; a
    name-keyed ``sd`` comes back as it is. The tensors are shared, not copied."""
    sd = _checked(sd)
    if is_named(sd):
        return sd
    ids = _ids(sd)
    if len(ids) != len(names):
        raise ValueError(f"optimizer state for {len(ids)} parameters, but the model trains {len(names)}")
    to_name = dict(zip(ids, names, strict=True))
    unknown = [k for k in sd[STATE] if k not in to_name]
    if unknown:
        raise ValueError(f"optimizer state for parameter positions {unknown[:5]} that no param group lists")
    return {STATE: {to_name[k]: v for k, v in sd[STATE].items()},
            GROUPS: [{**g, PARAMS: [to_name[i] for i in g[PARAMS]]} for g in sd[GROUPS]]}


def indexed(sd: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``sd`` keyed by position in the order of ``names`` (what ``optimizer.load_state_dict``
    takes); a position-keyed ``sd`` is first checked against ``names`` by :func:`named`."""
    sd = named(sd, names)
    saved = _ids(sd)
    if sorted(saved) != sorted(names):
        missing, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
        raise ValueError(f"optimizer state does not match the model's trained parameters: "
                         f"missing {missing[:5]}, not in the model {extra[:5]}")
    to_pos = {name: i for i, name in enumerate(names)}
    strays = [k for k in sd[STATE] if k not in to_pos]
    if strays:
        raise ValueError(f"optimizer state for parameters the model does not train: {strays[:5]}")
    # load_state_dict pairs a group's saved positions with the live group's parameters in list
    # order, so each group lists its positions ascending: the live order, whatever the saved one
    groups = [{**g, PARAMS: sorted(to_pos[n] for n in g[PARAMS])} for g in sd[GROUPS]]
    if [i for g in groups for i in g[PARAMS]] != list(range(len(names))):
        raise ValueError("optimizer state groups its parameters otherwise than the optimizer does")
    return {STATE: {to_pos[k]: v for k, v in sd[STATE].items()}, GROUPS: groups}


def load(path: Path, model: Any, optimizer: torch.optim.Optimizer, *, sharded: bool, reader: bool,
         device: torch.device) -> None:
    """Load the optimizer state saved at ``path`` (either form) into ``optimizer``. ``sharded``
    (FSDP): every rank calls it (collectives); the ``reader`` (rank 0) reads the whole file and
    broadcasts it tensor by tensor, each rank keeping its slice. Otherwise this process reads it."""
    names = param_names(model, optimizer)
    if not sharded:
        optimizer.load_state_dict(indexed(torch.load(path, map_location=device, weights_only=True), names))
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    # memory-mapped: rank 0 pages each tensor in as it is broadcast instead of holding the whole file
    full = named(torch.load(path, map_location="cpu", weights_only=True, mmap=True), names) if reader else {}
    set_optimizer_state_dict(model, optimizer, full,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
