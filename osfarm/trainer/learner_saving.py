"""Saving the learner: the served weights on the update's critical path, the training state off it.

Every update writes the **served weights** into ``v<N>/`` (``model/`` for a full fine-tune;
``adapter/`` with LoRA, plus a merged ``model/`` only with ``save_merged``): the weight sync loads
them, so it waits for them. A **full checkpoint** (every ``checkpoint_every`` updates) adds
``state/`` (optimizer, fp32 master weights, the data manager's state) and ``trainer_state.json``:
the optimizer's moments and the master weights are twice to four times the served weights (a
7B full fine-tune: ~100 GB), so they are copied to host memory first (the snapshot: the next
update may change the live tensors) and written by a background thread while the next update
runs. One write at a time: a save waits for the previous one. ``trainer_state.json`` is written
last, so a dir without it is never taken for a checkpoint.

Under FSDP the weights are sharded: every rank joins the gathers (a collective) and rank 0
writes; a LoRA adapter is cut from the gathered state dict, never from rank 0's shards.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from osfarm.policy.progress import hf_progress_bars_off
from osfarm.trainer.checkpoint import (
    ADAPTER_DIR,
    MASTER_FILE,
    MODEL_DIR,
    OPTIMIZER_FILE,
    STATE_FILE,
    STATE_SCHEMA,
    TRAIN_STATE_DIR,
    copy_processor_files,
)
from osfarm.trainer.distributed import DistContext
from osfarm.trainer.learner_options import LearnerOptions
from osfarm.trainer.optimizer_state import named, param_names

if TYPE_CHECKING:
    from collections.abc import Callable


class Learner(Protocol):
    """What saving reads of ``learner.Learner`` (which imports this module)."""

    opts: LearnerOptions
    ctx: DistContext
    model: Any
    fsdp: bool
    lora: bool
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    model_path: Path
    version: int
    counters: dict[str, int]

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...  # read only here: the learner's is an AdamW


@dataclass
class Gathered:
    """What a save needs of the live (possibly sharded) model: full state dicts on rank 0 under
    FSDP, None elsewhere (the model's and optimizer's own are read)."""

    model: dict[str, torch.Tensor] | None
    optimizer: dict[str, Any] | None


def gather(learner: Learner, *, full: bool) -> Gathered:
    """The full model state dict (and the optimizer's with ``full``) gathered to rank 0's host
    memory under FSDP: every rank calls it with the same ``full`` (a collective)."""
    if not learner.fsdp:
        return Gathered(None, None)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd: dict[str, torch.Tensor] = {}
    for k, v in get_model_state_dict(learner.model, options=opts).items():
        # a full model state dict maps names to tensors (torch types it as any state-dict value)
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"full model state dict entry {k!r} is a {type(v).__name__}, not a tensor")
        model_sd[k] = v
    optim_sd = get_optimizer_state_dict(learner.model, learner.optimizer, options=opts) if full else None
    return Gathered(model_sd, optim_sd)


def write_weights(learner: Learner, out: Path, got: Gathered) -> None:
    """The served weights into ``out`` (rank 0): adapter and/or model dir, processor files."""
    with hf_progress_bars_off():
        if learner.lora:
            assert learner.opts.lora is not None
            _save_adapter(learner, out / ADAPTER_DIR, got.model)
            if learner.opts.lora.save_merged:
                _save_merged(learner, out / MODEL_DIR, got.model)
        else:
            _save_served(learner, out / MODEL_DIR, got.model)
    if (out / MODEL_DIR).is_dir():
        copy_processor_files(learner.model_path, out / MODEL_DIR)


def _live_state(learner: Learner, full_sd: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    return full_sd if full_sd is not None else {k: v.detach() for k, v in learner.model.state_dict().items()}


def _save_served(learner: Learner, out: Path, full_sd: dict[str, torch.Tensor] | None) -> None:
    """The weights in the serving (compute) dtype."""
    sd = _live_state(learner, full_sd)
    served = {k: v.to(learner.compute_dtype) if v.is_floating_point() else v for k, v in sd.items()}
    config = learner.model.config
    old = getattr(config, "dtype", None)
    config.dtype = learner.compute_dtype
    try:
        learner.model.save_pretrained(str(out), state_dict=served, safe_serialization=True)
    finally:
        config.dtype = old


def _save_adapter(learner: Learner, out: Path, full_sd: dict[str, torch.Tensor] | None) -> None:
    """The PEFT adapter, cut from the whole state dict (the gathered one under FSDP: each rank's
    own holds only its shards of every LoRA matrix)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    adapter = get_peft_model_state_dict(learner.model, state_dict=full_sd) if full_sd is not None else \
        get_peft_model_state_dict(learner.model)
    # the served dtype is the adapter's fp32: vLLM casts it to the model's dtype when it loads it
    save_file({k: v.detach().to("cpu").contiguous() for k, v in adapter.items()},
              str(out / "adapter_model.safetensors"))
    learner.model.peft_config["default"].save_pretrained(str(out))


def _save_merged(learner: Learner, out: Path, full_sd: dict[str, torch.Tensor] | None) -> None:
    """The base weights with the adapter folded in (W + B·A·alpha/r), computed from the state
    dict: the training model is never copied or touched."""
    assert learner.opts.lora is not None
    sd = _live_state(learner, full_sd)
    scale = learner.opts.lora.alpha / learner.opts.lora.r
    merged: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if ".lora_" in k:
            continue
        name = k.removeprefix("base_model.model.").replace(".base_layer.", ".")
        w = v.detach().to("cpu")
        if k.endswith(".base_layer.weight"):
            stem = k.removesuffix(".base_layer.weight")
            a, b = sd[f"{stem}.lora_A.default.weight"].to("cpu"), sd[f"{stem}.lora_B.default.weight"].to("cpu")
            w = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
        merged[name] = w.to(learner.compute_dtype) if w.is_floating_point() else w
    base = learner.model.get_base_model()
    config = base.config
    old = getattr(config, "dtype", None)
    config.dtype = learner.compute_dtype
    try:
        base.save_pretrained(str(out), state_dict=_unshared(merged), safe_serialization=True)
    finally:
        config.dtype = old


@dataclass
class TrainingState:
    """A full checkpoint's training state copied to host memory: nothing in it changes when the
    next update runs."""

    optimizer: dict[str, Any]
    master: dict[str, torch.Tensor] | None
    state: dict[str, Any]


def snapshot(learner: Learner, got: Gathered, extra_state: dict[str, Any] | None) -> TrainingState:
    """Rank 0's copy of the optimizer state (keyed by parameter name), the fp32 master weights
    (when the served ones are another dtype) and ``trainer_state.json``'s contents."""
    # keyed by parameter name, as FSDP's gathered state is: any rank count resumes it
    optim = got.optimizer if got.optimizer is not None else \
        named(_host_copy(learner.optimizer.state_dict()), param_names(learner.model, learner.optimizer))
    master = None
    if learner.master_dtype != learner.compute_dtype and not learner.lora:
        sd = _live_state(learner, got.model)
        master = _unshared({k: v.detach().to("cpu", copy=True).contiguous()
                            for k, v in sd.items() if v.is_floating_point()})
    state = {"schema": STATE_SCHEMA, "version": learner.version, "counters": dict(learner.counters),
             "base_model": str(learner.model_path), "lora": learner.lora, "saved_at": time.time(),
             "served_dtype": str(learner.compute_dtype).removeprefix("torch."),
             "master_dtype": str(learner.master_dtype).removeprefix("torch."), "world_size": learner.ctx.world,
             **(extra_state or {})}
    return TrainingState(optim, master, state)


def write_training_state(ckpt: Path, snap: TrainingState) -> None:
    """``state/``'s tensors, then ``trainer_state.json`` (last: the checkpoint is complete)."""
    sdir = ckpt / TRAIN_STATE_DIR
    sdir.mkdir(parents=True, exist_ok=True)
    _atomic(sdir / OPTIMIZER_FILE, lambda p: torch.save(snap.optimizer, p))
    if snap.master is not None:
        from safetensors.torch import save_file

        master = snap.master
        _atomic(sdir / MASTER_FILE, lambda p: save_file(master, str(p)))
    _atomic(ckpt / STATE_FILE, lambda p: p.write_text(json.dumps(snap.state, indent=2, default=str)))


class CheckpointWriter:
    """Writes checkpoint dirs: weights now, the training state in a background thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: Future[None] | None = None

    def save(self, learner: Learner, out: Path, got: Gathered, *, full: bool, background: bool,
             extra_state: dict[str, Any] | None, write_extra: Callable[[Path], None] | None) -> Path:
        """Write ``out`` (rank 0): the served weights before returning, the training state (with
        ``full``) before returning or, with ``background``, in the writer thread."""
        self.wait()  # one write at a time: the previous checkpoint is complete before this one starts
        out = Path(out)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_weights(learner, tmp, got)
        if full:
            (tmp / TRAIN_STATE_DIR).mkdir()
            if write_extra is not None:  # e.g. the data manager's state (already a snapshot: JSON text)
                write_extra(tmp / TRAIN_STATE_DIR)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        if full:
            snap = snapshot(learner, got, extra_state)
            if background:
                self._pending = self._pool.submit(write_training_state, out, snap)
            else:
                write_training_state(out, snap)
        return out

    def wait(self) -> None:
        """Block until the background write is done; its error, if any, is raised here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


def _host_copy(value: Any) -> Any:
    """``value`` with every tensor copied to host memory (an optimizer state dict's moments are
    the live tensors the next step updates in place)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copy(v) for v in value)
    return value


def _unshared(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy with no two entries sharing storage (safetensors refuses tied weights)."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in sd.items():
        ptr = v.data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.setdefault(ptr, k)
    return out
