"""The learner's settings (``learner:`` in train.yaml) and what one update reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import AliasChoices, BaseModel, Field

from osfarm.schema.budget import Budget
from osfarm.trainer.distributed import DistContext
from osfarm.trainer.losses import Aggregation, KLKind


class LoraOptions(BaseModel):
    r: int = Field(default=16, ge=1)
    alpha: int = Field(default=32, ge=1)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # vLLM hot-loads the adapter alone; a merged copy is a full model per version (15 GB for a 7B)
    # that only a server reloading whole weights (our CPU server, a restart command) reads
    save_merged: bool | None = Field(
        default=None, validation_alias=AliasChoices("save_merged", "export_merged"),
        description="also write the merged full model to model/ (None: train.yaml decides from the policy "
                    "servers' kinds; a learner on its own writes the adapter only)")


class LossOptions(BaseModel):
    """Knobs of ``decoupled_ppo_loss`` (reference/rl.md)."""

    clip_low: float = Field(default=0.2, gt=0)
    clip_high: float = Field(default=0.28, gt=0)
    behav_cap: float | None = Field(default=1.0, gt=0, description="DART: truncate π_prox/π_b at C")
    behav_reject: float | None = Field(default=None, gt=0, description="AReaL: drop tokens with π_prox/π_b above this")
    dual_clip: float | None = Field(default=None, gt=1)
    aggregation: Aggregation = "token_mean"
    entropy_coef: float = Field(default=0.0, ge=0.0, description="entropy bonus (0: off)")
    kl_coef: float = Field(default=0.0, ge=0.0,
                           description="weight of KL(π_θ ‖ π_ref) in the loss (0: off, no reference kept)")
    kl_kind: KLKind = Field(default="k3", description="KL estimator (Schulman's k1/k2/k3)")
    episode_weighting: bool = Field(default=False, description="every episode of an update weighs the same, "
                                    "however many step samples it has (advantages.episode_weights): a long "
                                    "failure does not outweigh a short success")


class LearnerOptions(BaseModel):
    lr: float = Field(default=1e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(default=1.0, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0, description="optimizer steps of linear warmup from 0 to lr")
    total_steps: int | None = Field(default=None, ge=1, description="steps the decay runs over (default: the "
                                    "run's updates × minibatches)")
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0, description="linear/cosine: lr at the end, as a fraction")
    minibatches: int = Field(default=1, ge=1,
                             description="optimizer steps per update (proximal ≠ current after the first)")
    micro_batch_size: int = Field(default=1, ge=1, description="samples per forward pass (gradient accumulation "
                                  "over the rest of a minibatch bounds memory)")
    dtype: str = Field(default="auto", pattern="^(auto|float32|bfloat16|float16)$",
                       description="compute dtype (auto: bfloat16 on GPUs, float32 on CPUs)")
    master_dtype: str = Field(default="float32", pattern="^(float32|same)$",
                              description="trained parameters and optimizer state (same: the compute dtype)")
    device: str = Field(default="auto", description="auto: cuda (this rank's GPU) when available, else cpu")
    fsdp: Literal["auto", "on", "off"] = Field(default="auto", description="shard with FSDP2 over the ranks "
                                               "(auto: on GPUs with several ranks)")
    lora: LoraOptions | None = None
    loss: LossOptions = Field(default_factory=LossOptions)
    gradient_checkpointing: bool = False
    temperature: float = Field(default=1.0, gt=0, description="the rollouts' sampling temperature: the learner's "
                               "log-probs are of softmax(logits / T), as the server's processed log-probs are")
    full_logits: bool = Field(default=False, description="compute logits over the whole sequence (tests; costs memory)")
    reference: Path | None = Field(default=None, description="model dir of the KL reference policy (default: the "
                                   "model the run started from; with LoRA: the base without adapters)")
    reference_device: str | None = Field(default=None,
                                         description="device of the KL reference (default: the learner's)")
    budget: Budget = Field(default_factory=Budget, description="train.yaml's budget (set there): the image "
                           "resize bounds of the processor and the token limits of a trained sample")
    simulated_update_s: float = Field(default=0.0, ge=0.0, description="benchmarks: each update also holds the "
                                      "learner this many seconds, off the CPUs (a real model's GPU update time on "
                                      "the tiny model, as policy.delay_ms models the policy server's)")
    simulated_sample_s: float = Field(default=0.0, ge=0.0, description="benchmarks: and this many seconds per "
                                      "sample trained (a real update's time grows with its batch)")
    seed: int = 0


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str, ctx: DistContext | None = None) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", (ctx.local_rank if ctx else 0) % torch.cuda.device_count())
        return torch.device("cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass
class UpdateStats:
    version: int
    samples: int
    tokens: int
    loss: float
    entropy: float
    kl_prox_behav: float  # mean (log π_b − log π_prox) over response tokens: the staleness drift
    grad_norm: float
    seconds: float
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite gradient
    lr: float = 0.0  # the learning rate of the last step taken
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def skipped(self) -> bool:
        """No step was taken: the weights and the version did not change."""
        return self.skipped_steps > 0 and self.extra.get("steps_taken", 0.0) == 0.0

    def as_dict(self) -> dict[str, float]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d
