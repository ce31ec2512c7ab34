"""The learner: a transformers VLM trained with decoupled PPO on step or episode samples.

One update = one batch of :class:`Sample` s (the data manager's):

1. a sample is encoded exactly as the policy server encoded its prompt (``batching.py``), the
   response token ids the server returned appended; the loss covers those tokens only. An
   episode sample is the whole conversation encoded once, the loss on every turn's reply
   (``episode_encoding.py``; turn by turn: ``trained_turns.py``); one that is not the policy's own
   sequence token for token, or is over the budget, trains as its step samples. Samples
   are encoded when their micro-batch runs, in each pass, and dropped after it: one 1080p
   screenshot's ``pixel_values`` are ~50 MB, so an update holding its whole batch encoded would
   need host memory in proportion to the batch (64 episodes × 15 steps: ~19 GB); encoding twice
   costs CPU time instead, which the data loading of a real run overlaps anyway;
2. proximal log-probs are computed with the weights *before* this update (no grad);
3. ``minibatches`` optimizer steps follow, each over its share of the batch, in micro-batches of
   ``micro_batch_size`` samples (one forward pass each, left-padded) with gradient accumulation:
   the memory of a step is that of one micro-batch however broad the batch (BroRL's hundreds of
   rollouts per task); each micro-batch's loss is weighted by its share of the minibatch's tokens
   (or sequences), so the step is the same whatever the micro-batch size or number of ranks;
4. AdamW with the learning-rate schedule (``schedule.py``: warmup, then constant / linear /
   cosine), gradient-norm clipping; a step whose gradient is not finite is skipped (the weights,
   the optimizer and the schedule stay as they were); an update whose every step was skipped does
   **not** bump the policy version (nothing changed: the servers keep serving it);
5. otherwise the policy version goes up by one.

Precision: parameters and optimizer moments are kept in ``master_dtype`` (fp32), the forward and
backward passes run in the compute ``dtype`` (bf16 on GPUs, autocast; fp32 on CPUs): bf16 AdamW
on bf16 weights rounds a full fine-tune's lr 1e-5 updates to nothing. LoRA keeps the frozen base in
the compute dtype and only the adapter in fp32. The served weights are written in the compute dtype.

Several ranks (``distributed.py``): rank 0 sends each update's batch to the others; every rank
computes its share; gradients are summed (data parallel on CPUs, FSDP2 ``fully_shard`` on GPUs).

Saving (``learner_saving.py``, layout in ``checkpoint.py``): the served weights every update (what
the weight sync loads), the training state of a full checkpoint snapshotted and written in the
background; the options and the update's report are in ``learner_options.py``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from osfarm.policy.processing import encode_chat, load_processor
from osfarm.trainer import optimizer_state
from osfarm.trainer.advantages import episode_weights
from osfarm.trainer.batching import Encoded, encode_sample, plain_token, response_mask
from osfarm.trainer.checkpoint import (
    ADAPTER_DIR,
    MASTER_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    latest_checkpoint,
    model_dir,
    read_state,
    train_state_dir,
)
from osfarm.trainer.distributed import (
    Commands,
    DistContext,
    all_reduce_floats,
    all_reduce_grads,
    drop_unreached_grads,
    init_process_groups,
    leave_process_groups,
    shard,
)
from osfarm.trainer.forward_reach import ForwardReach
from osfarm.trainer.learner_options import (
    LearnerOptions,
    LoraOptions,
    LossOptions,
    UpdateStats,
    pick_device,
    pick_dtype,
)
from osfarm.trainer.learner_passes import LearnerPasses
from osfarm.trainer.learner_saving import CheckpointWriter, gather
from osfarm.trainer.model_init import load_model, load_reference, shard_from_rank0
from osfarm.trainer.samples import Sample
from osfarm.trainer.schedule import lr_factor
from osfarm.trainer.trained_turns import Turn, as_step_samples, prompt_messages, steps_where_not_one_sequence

__all__ = ["Encoded", "Learner", "LearnerOptions", "LoraOptions", "LossOptions", "UpdateStats", "encode_sample",
           "latest_checkpoint", "read_state", "response_mask", "STATE_FILE"]

log = logging.getLogger("osfarm.trainer.learner")


def load_model_and_processor(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    return load_model(path, dtype).to(device), load_processor(path)


class Learner(LearnerPasses):
    """Holds the policy being trained, its optimizer and its version (on every learner rank);
    its encoding and forward passes are :class:`LearnerPasses`."""

    def __init__(self, model_path: Path, opts: LearnerOptions | None = None, *, version: int = 0,
                 ctx: DistContext | None = None, device: str | None = None,
                 before_sharding: Callable[[Learner], None] | None = None):
        self.opts = opts or LearnerOptions()
        self.ctx = ctx or DistContext()
        torch.manual_seed(self.opts.seed)  # the same initial LoRA weights on every rank
        self.device = pick_device(device or self.opts.device, self.ctx)
        self.compute_dtype = pick_dtype(self.opts.dtype, self.device)
        self.master_dtype = torch.float32 if self.opts.master_dtype == "float32" else self.compute_dtype
        self.model_path = Path(model_path)
        self.lora = self.opts.lora is not None
        self.fsdp = self.ctx.enabled and (self.opts.fsdp == "on"
                                          or (self.opts.fsdp == "auto" and self.device.type == "cuda"))
        self.commands: Commands | None = None
        if self.ctx.enabled:
            self.commands = Commands(self.ctx, init_process_groups(self.ctx, self.device))
        self.processor = load_processor(self.model_path)
        self.opts.budget.apply_to_processor(self.processor)  # the screenshots resized as the server resized them
        self.pad_id = plain_token(self.processor.tokenizer)
        # full fine-tuning: every weight is trained, so all are kept in the master dtype; LoRA: the
        # frozen base stays in the compute dtype and only the adapter is upcast
        # under FSDP only rank 0 reads the weights; the others build the empty tree (model_init.py)
        self.model = load_model(self.model_path, self.compute_dtype if self.lora else self.master_dtype,
                                meta=self.fsdp and not self.ctx.is_main)
        if self.opts.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if self.opts.lora is not None:
            from peft import LoraConfig, get_peft_model

            lo = self.opts.lora
            self.model = get_peft_model(self.model, LoraConfig(r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
                                                               target_modules=lo.target_modules))
            for p in self.model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(self.master_dtype)
        if before_sharding is not None and (self.ctx.is_main or not self.fsdp):  # e.g. resume: the fp32
            # master weights, the adapter (under FSDP into rank 0's model, which the others' shards come from)
            before_sharding(self)
        # FSDP2 casts the shards to the compute dtype itself; elsewhere autocast runs the mixed passes
        self.autocast = (not self.fsdp) and self.compute_dtype != self.master_dtype
        if self.fsdp:
            shard_from_rank0(self.model, self.ctx, self.device, self.compute_dtype)
        else:
            self.model.to(self.device)
        # The KL reference stays frozen for the whole run; with LoRA it is the base model itself
        # (adapters switched off), so no second copy is loaded.
        self.ref_model: Any = None
        self.ref_device = (torch.device(self.opts.reference_device) if self.opts.reference_device and not self.fsdp
                           else self.device)  # under FSDP the reference is sharded like the policy
        if self.opts.loss.kl_coef > 0 and not self.lora:
            self.ref_model = load_reference(Path(self.opts.reference or self.model_path), self.compute_dtype,
                                            self.ctx, self.ref_device, fsdp=self.fsdp)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # FSDP2 gives every parameter a gradient, zeros where no rank used it: which ones no
        # rank's forward passes reached is asked before each step, so they skip it as on one rank
        self.reach = ForwardReach(self.model, self.params) if self.fsdp else None
        self.optimizer = torch.optim.AdamW(self.params, lr=self.opts.lr, weight_decay=self.opts.weight_decay,
                                           betas=self.opts.betas)
        self.model.eval()
        self.version = version
        self.counters: dict[str, int] = {"updates": 0, "samples": 0, "tokens": 0, "optimizer_steps": 0,
                                         "skipped_steps": 0, "skipped_updates": 0}
        self.writer = CheckpointWriter()

    # -- update -------------------------------------------------------------------------------------

    def update(self, samples: Sequence[Sample]) -> UpdateStats:
        """One policy update on ``samples`` (rank 0; the other ranks join through their command
        loop); the version goes up by one unless every optimizer step was skipped."""
        if self.commands is not None:
            self.commands.send("update", list(samples))
        return self._update(list(samples))

    def _micro_batches(self, mine: list[int], count: int, filler: int) -> list[tuple[list[int], float]]:
        """``mine`` cut into micro-batches, padded to ``count`` with zero-weight copies of sample
        ``filler`` (every rank must run as many forward passes: FSDP's are collective)."""
        step = self.opts.micro_batch_size
        out = [(mine[i:i + step], 1.0) for i in range(0, len(mine), step)]
        while len(out) < count:
            out.append(([filler], 0.0))
        return out

    @torch.no_grad()
    def _proximal_pass(self, samples: Sequence[Sample], turns: Sequence[Sequence[Turn]],
                       plans: list[list[tuple[list[int], float]]]) -> tuple[dict[int, torch.Tensor],
                                                                          dict[int, torch.Tensor]]:
        """Per sample: log π_prox (the weights before this update) and, with a KL term, log π_ref
        of its trained tokens (every turn's, in order; on this rank's samples)."""
        self.model.eval()
        prox: dict[int, torch.Tensor] = {}
        refs: dict[int, torch.Tensor] = {}
        for plan in plans:
            for idx, _ in plan:
                # under FSDP every forward is collective: each rank runs all of its micro-batches
                todo = list(idx) if self.fsdp else [i for i in idx if i not in prox]
                if not todo:
                    continue
                mb = self._encode_micro(samples, turns, todo)
                logp, _ = self.forward(mb)
                for i, row in zip(todo, mb.per_sample(logp), strict=True):
                    prox[i] = row.detach().float()
                if self.opts.loss.kl_coef > 0:
                    for i, row in zip(todo, mb.per_sample(self._reference(mb)), strict=True):
                        refs[i] = row.detach().float()
                del mb, logp  # this micro-batch's inputs go before the next one is encoded
        return prox, refs

    def _over_budget(self, samples: Sequence[Sample]) -> set[int]:
        """Indices of the samples over the run's token budget (left out of the update, counted)."""
        b = self.opts.budget
        if b.max_prompt_tokens is None and b.max_response_tokens is None:
            return set()
        out = set()
        for i, s in enumerate(samples):
            # one prompt encoded at a time and dropped at once: memory stays that of one sample
            prompt = (None if b.max_prompt_tokens is None
                      else int(encode_chat(self.processor, list(prompt_messages(s)))["input_ids"].shape[1]))
            why = b.overlong(prompt, max(len(t.ids) for t in self.turns(s)))
            if why is not None:
                log.warning("sample %s#%s left out of the update: %s", s.episode_id, s.step_index, why)
                out.add(i)
        return out

    def _update(self, samples: list[Sample]) -> UpdateStats:
        if not samples:
            raise ValueError("update needs at least one sample")
        t0 = time.perf_counter()
        # an episode sample that is not the policy's own sequence token for token trains as its
        # steps; so does one over the budget, whose earlier steps may fit
        samples, not_one_sequence = steps_where_not_one_sequence(samples, self.processor)
        over = self._over_budget(samples)
        if any(samples[i].whole_episode for i in over):
            not_one_sequence["over_budget"] = sum(1 for i in over if samples[i].whole_episode)
            samples = [x for i, s in enumerate(samples)
                       for x in (as_step_samples(s) if i in over and s.whole_episode else [s])]
            over = self._over_budget(samples)
        samples = [s for i, s in enumerate(samples) if i not in over]
        if not samples:  # nothing left to train: like an update whose every step was skipped
            return UpdateStats(version=self.version, samples=0, tokens=0, loss=0.0, entropy=0.0, kl_prox_behav=0.0,
                               grad_norm=float("nan"), seconds=round(time.perf_counter() - t0, 3), skipped_steps=1,
                               extra={"steps_taken": 0.0, "overlong_samples": float(len(over))})
        turns = [self.turns(s) for s in samples]
        flat = [t for ts in turns for t in ts]
        if self.opts.loss.episode_weighting:  # a positive weight on A scales that turn's PPO term alike
            for t, w in zip(flat, episode_weights([t.episode_id for t in flat]), strict=True):
                t.advantage *= w
        rank, world = self.ctx.rank, self.ctx.world
        # checked on every rank before any collective, so all raise together
        for t in flat:
            if not t.ids:
                raise ValueError(f"sample {t.label}: no response tokens")
            if t.behav is not None and len(t.behav) != len(t.ids):
                raise ValueError(f"sample {t.label}: {len(t.behav)} behaviour log-probs for {len(t.ids)} "
                                 f"response tokens")
        lengths = [sum(len(t.ids) for t in ts) for ts in turns]
        agg = self.opts.loss.aggregation
        total_tokens = sum(lengths)
        n_mb = min(self.opts.minibatches, len(samples))
        minibatches = [list(range(len(samples)))[i::n_mb] for i in range(n_mb)]
        step = self.opts.micro_batch_size
        plans: list[list[tuple[list[int], float]]] = []
        for mb_indices in minibatches:
            per_rank = [shard(mb_indices, lengths, r, world) for r in range(world)]
            count = max(math.ceil(len(p) / step) for p in per_rank)
            plans.append(self._micro_batches(per_rank[rank], count, mb_indices[0]))

        prox, refs = self._proximal_pass(samples, turns, plans)
        self.model.train()
        sums = {"loss": 0.0, "entropy": 0.0, "drift": 0.0}
        stat_sums: dict[str, float] = {}
        grad_norms: list[float] = []
        taken = skipped = 0
        lr = 0.0
        for mb_idx, plan in zip(minibatches, plans, strict=True):
            self.optimizer.zero_grad(set_to_none=True)
            if self.reach is not None:
                self.reach.clear()
            mb_tokens = sum(lengths[i] for i in mb_idx)
            mb_turns = sum(len(turns[i]) for i in mb_idx)
            for k, (idx, weight) in enumerate(plan):
                if self.fsdp:  # reduce-scatter once, after the minibatch's last micro-batch
                    self.model.set_requires_gradient_sync(k == len(plan) - 1)
                mb = self._encode_micro(samples, turns, idx)
                blank = torch.zeros(mb.size, mb.width)
                prox_rows = mb.rows([prox[i] for i in idx], blank)
                ref_rows = mb.rows([refs[i] for i in idx], blank) if refs else None
                loss, stats, ent = self.micro_loss([turns[i] for i in idx], mb, prox_rows, ref_rows)
                micro_tokens = sum(lengths[i] for i in idx)
                # the micro-batch's mean, re-weighted so the minibatch's loss is the token (or
                # turn) mean over all of its samples, on all ranks together
                share = (micro_tokens / mb_tokens if agg == "token_mean"
                         else sum(len(turns[i]) for i in idx) / mb_turns) * weight
                # the ranks' gradients are to be summed; FSDP's reduce-scatter averages them (and
                # gloo has no pre-multiplied sum), so its shares count world-size times
                (loss * (share * world if self.fsdp else share)).backward()
                del mb, prox_rows, ref_rows  # freed before the next micro-batch is encoded
                w = weight * micro_tokens / total_tokens
                # the minibatches' losses weighed as their tokens (or turns): the update's objective
                sums["loss"] += float(loss.detach()) * share * (mb_tokens / total_tokens if agg == "token_mean"
                                                                else mb_turns / len(flat))
                sums["entropy"] += float(ent) * w
                for k2, v in stats.items():
                    stat_sums[k2] = stat_sums.get(k2, 0.0) + float(v) * w
                if weight:
                    for i in idx:  # a turn without behaviour log-probs adds nothing (nan)
                        behav = [x for t in turns[i] for x in (t.behav if t.behav is not None else
                                                                [math.nan] * len(t.ids))]
                        sums["drift"] += float(torch.nansum(torch.tensor(behav, dtype=torch.float32) - prox[i].cpu()))
            if self.ctx.enabled and not self.fsdp:
                all_reduce_grads(self.params)
            if self.reach is not None:
                drop_unreached_grads(self.params, self.reach.reached())
            gn = float(torch.nn.utils.clip_grad_norm_(self.params, self.opts.grad_clip))
            grad_norms.append(gn)
            if math.isfinite(gn):
                lr = self.opts.lr * lr_factor(self.counters["optimizer_steps"], kind=self.opts.lr_schedule,
                                              warmup=self.opts.warmup_steps, total=self.opts.total_steps,
                                              min_ratio=self.opts.min_lr_ratio)
                for g in self.optimizer.param_groups:
                    g["lr"] = lr
                self.optimizer.step()
                self.counters["optimizer_steps"] += 1
                taken += 1
            else:  # a non-finite gradient skips the step instead of poisoning the weights
                skipped += 1
                self.counters["skipped_steps"] += 1
            self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        if self.ctx.enabled:
            keys = sorted(stat_sums)
            summed = all_reduce_floats([sums["loss"], sums["entropy"], sums["drift"], *(stat_sums[k] for k in keys)],
                                       self.device)
            sums["loss"], sums["entropy"], sums["drift"] = summed[:3]
            stat_sums = dict(zip(keys, summed[3:], strict=True))
        if taken:
            self.version += 1
            self.counters["updates"] += 1
            self.counters["samples"] += len(samples)
            self.counters["tokens"] += total_tokens
        else:
            self.counters["skipped_updates"] += 1
            log.warning("update skipped: every optimizer step had a non-finite gradient (version stays %d)",
                        self.version)
        held = self.opts.simulated_update_s + self.opts.simulated_sample_s * len(samples)
        if held:  # the learner's thread, never the event loop, waits here
            time.sleep(held)
        extra = {f"loss/{k}": v for k, v in stat_sums.items()}
        extra["steps_taken"] = float(taken)
        extra["overlong_samples"] = float(len(over))
        extra["turns"] = float(len(flat))
        extra["episode_samples"] = float(sum(1 for s in samples if s.whole_episode))
        extra.update({f"episode_fallback_{why}": float(n) for why, n in not_one_sequence.items()})
        finite = [g for g in grad_norms if math.isfinite(g)]
        return UpdateStats(version=self.version, samples=len(samples), tokens=total_tokens, loss=sums["loss"],
                           entropy=sums["entropy"], kl_prox_behav=sums["drift"] / total_tokens,
                           grad_norm=max(finite) if finite else float("nan"),
                           seconds=round(time.perf_counter() - t0, 3),
                           skipped_steps=skipped, lr=lr, extra=extra)

    # -- checkpoints --------------------------------------------------------------------------------

    def save(self, out: Path, extra_state: dict[str, Any] | None = None,
             write_extra: Callable[[Path], None] | None = None, *, full: bool = True,
             background: bool = False) -> Path:
        """Write checkpoint dir ``out`` and return it (rank 0; under FSDP the other ranks join the
        gathers): the served weights (what the weight sync loads) before returning; with ``full``
        the training state too (``state/``, ``trainer_state.json``), written in a background
        thread with ``background`` (:meth:`wait_saved` waits for it; the next save does)."""
        if self.commands is not None:
            self.commands.send("save", {"full": full})
        got = gather(self, full=full)
        if not self.ctx.is_main:
            return Path(out)
        return self.writer.save(self, Path(out), got, full=full, background=background, extra_state=extra_state,
                                write_extra=write_extra)

    def wait_saved(self) -> None:
        """Block until a background checkpoint write is complete (raises its error)."""
        self.writer.wait()


    @classmethod
    def resume(cls, ckpt: Path, opts: LearnerOptions | None = None, *, ctx: DistContext | None = None,
               device: str | None = None) -> tuple[Learner, dict[str, Any]]:
        """A learner restored from a checkpoint dir: weights (the fp32 master ones when saved),
        optimizer, version and counters. Returns it with the whole saved state (the data manager's
        and rollout controller's parts are the caller's to restore)."""
        ckpt = Path(ckpt)
        state = read_state(ckpt)
        opts = opts or LearnerOptions()
        sdir = train_state_dir(ckpt)
        if state.get("lora"):
            if opts.lora is None:
                raise ValueError(f"{ckpt}: a LoRA checkpoint; set learner.lora to resume it")

            def load_adapter(lrn: Learner) -> None:
                from peft import set_peft_model_state_dict
                from safetensors.torch import load_file

                set_peft_model_state_dict(lrn.model, load_file(str(ckpt / ADAPTER_DIR / "adapter_model.safetensors")))
                for p in lrn.model.parameters():
                    if p.requires_grad:
                        p.data = p.data.to(lrn.master_dtype)

            learner = cls(Path(state["base_model"]), opts, version=int(state["version"]), ctx=ctx, device=device,
                          before_sharding=load_adapter)
        else:
            master = sdir / MASTER_FILE

            def load_master(lrn: Learner) -> None:
                if master.is_file():  # served in bf16: continue from the fp32 weights
                    from safetensors.torch import load_file

                    missing = lrn.model.load_state_dict(load_file(str(master)), strict=False)
                    if missing.unexpected_keys:
                        raise ValueError(f"{master}: weights the model does not have: {missing.unexpected_keys[:5]}")

            # the KL reference is the model the run started from, not this checkpoint
            ref = opts.reference or Path(state.get("base_model", ckpt))
            learner = cls(model_dir(ckpt), opts.model_copy(update={"lora": None, "reference": ref}),
                          version=int(state["version"]), ctx=ctx, device=device, before_sharding=load_master)
            learner.model_path = Path(state.get("base_model", ckpt))
        opt_file = sdir / OPTIMIZER_FILE
        if opt_file.is_file():  # saved by any rank count; under FSDP rank 0 alone reads it
            optimizer_state.load(opt_file, learner.model, learner.optimizer, sharded=learner.fsdp,
                                 reader=learner.ctx.is_main, device=learner.device)
        learner.counters.update({k: int(v) for k, v in state.get("counters", {}).items()})
        return learner, state

    # -- the other ranks ----------------------------------------------------------------------------

    def serve_commands(self) -> None:
        """Ranks > 0: do what rank 0 says until it says stop."""
        assert self.commands is not None and not self.ctx.is_main
        while True:
            name, payload = self.commands.receive()
            if name == "stop":
                self.commands = None
                leave_process_groups()
                return
            try:
                if name == "update":
                    self._update(payload)
                elif name == "save":
                    gather(self, full=bool(payload["full"]))
                else:
                    raise ValueError(f"unknown learner command {name!r}")
            except ValueError as e:  # rank 0 raised the same (checked before any collective)
                log.warning("rank %d: %s", self.ctx.rank, e)

    def stop_workers(self) -> None:
        """Rank 0: release the other ranks' command loops (after the last checkpoint is written)."""
        self.wait_saved()
        if self.commands is not None:
            self.commands.send("stop")
            self.commands = None
            leave_process_groups()

