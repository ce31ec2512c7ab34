"""The learner: a transformers VLM trained with decoupled PPO on step-level samples.

One update = one batch of :class:`Sample` s (H6's data manager):

1. every sample is encoded exactly as the policy server encoded its prompt (the chat template of
   the model's processor over the OpenAI messages, images included), then the response token ids
   the server returned are appended; the loss mask is 1 on those response tokens only;
2. proximal log-probs are computed with the weights *before* this update (no grad);
3. ``minibatches`` optimizer steps follow, each over its share of the batch with gradient
   accumulation one sample at a time (a VLM sample carries its own images; padding them into a
   batch saves little on a CPU and costs memory on a GPU), AdamW, gradient-norm clipping;
4. the policy version goes up by one.

Weights are fp32 on a CPU and bf16 on a GPU. LoRA (peft) is an option: then only the adapter
trains, the checkpoint holds the adapter (for vLLM's LoRA hot-load) and, unless turned off, the
merged full model (for our CPU policy server's reload).

A checkpoint is a Hugging Face model dir (``save_pretrained``: safetensors + config + processor
files) plus ``trainer_state.json`` (policy version, counters, the data manager's and rollout
controller's states) and ``optimizer.pt``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field

from osfarm.policy.processing import encode_chat, load_processor
from osfarm.policy.progress import hf_progress_bars_off
from osfarm.trainer.data_manager import Sample
from osfarm.trainer.losses import decoupled_ppo_loss, gather_logprobs, kl_penalty, token_entropy

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_DIR = "adapter"
STATE_SCHEMA = "osfarm.trainer_state/1"


class LoraOptions(BaseModel):
    r: int = Field(default=16, ge=1)
    alpha: int = Field(default=32, ge=1)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    export_merged: bool = Field(default=True, description="also write the merged full model (CPU server reload)")


class LossOptions(BaseModel):
    """Knobs of H6's ``decoupled_ppo_loss`` (reference/rl.md)."""

    clip_low: float = Field(default=0.2, gt=0)
    clip_high: float = Field(default=0.28, gt=0)
    behav_cap: float | None = Field(default=1.0, gt=0, description="DART: truncate π_prox/π_b at C")
    behav_reject: float | None = Field(default=None, gt=0, description="AReaL: drop tokens with π_prox/π_b above this")
    dual_clip: float | None = Field(default=None, gt=1)
    aggregation: str = Field(default="token_mean", pattern="^(token_mean|seq_mean)$")
    entropy_coef: float = Field(default=0.0, ge=0.0, description="entropy bonus (0: off)")
    kl_coef: float = Field(default=0.0, ge=0.0, description="weight of KL(π_θ ‖ π_ref) in the loss (0: off, no reference kept)")
    kl_kind: str = Field(default="k3", pattern="^(k1|k2|k3)$", description="KL estimator (Schulman's k1/k2/k3)")


class LearnerOptions(BaseModel):
    lr: float = Field(default=1e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(default=1.0, gt=0)
    minibatches: int = Field(default=1, ge=1, description="optimizer steps per update (proximal ≠ current after the first)")
    dtype: str = Field(default="auto", pattern="^(auto|float32|bfloat16|float16)$")
    device: str = Field(default="auto", description="auto: cuda when available, else cpu")
    lora: LoraOptions | None = None
    loss: LossOptions = Field(default_factory=LossOptions)
    gradient_checkpointing: bool = False
    temperature: float = Field(default=1.0, gt=0, description="the rollouts' sampling temperature: the learner's "
                               "log-probs are of softmax(logits / T), as the server's processed log-probs are")
    full_logits: bool = Field(default=False, description="compute logits over the whole sequence (tests; costs memory)")
    reference: Path | None = Field(default=None, description="model dir of the KL reference policy (default: the "
                                   "model the run started from; with LoRA: the base without adapters)")
    seed: int = 0


# ---- samples: the policy server's prompt encoding + the sampled response ------------------------


def response_mask(prompt_len: int, response_len: int) -> torch.Tensor:
    """Loss mask over a (prompt + response) sequence: 1 on response tokens, 0 on the prompt."""
    return torch.cat([torch.zeros(prompt_len), torch.ones(response_len)])


@dataclass
class Encoded:
    inputs: dict[str, torch.Tensor]  # input_ids etc. for the whole sequence (batch of 1)
    prompt_len: int
    response_ids: torch.Tensor  # [T]
    target_ids: torch.Tensor | None = None  # [1, L] the tokens to score, when input_ids had to differ

    @property
    def response_len(self) -> int:
        return int(self.response_ids.numel())


VISION_PLACEHOLDERS = ("<|image_pad|>", "<|video_pad|>")


def encode_sample(processor: Any, messages: Sequence[dict[str, Any]], response_ids: Sequence[int]) -> Encoded:
    """Prompt inputs + the response token ids appended (attention over all of them).

    The prompt is encoded by the policy server's own function (``encode_chat``), so its ids are
    the ones the sampled tokens were conditioned on: any difference would skew every importance
    weight (tests/test_policy_server.py checks ids and log-probs against a running server).
    """
    inputs = dict(encode_chat(processor, list(messages)))
    ids = inputs["input_ids"]
    resp = torch.tensor(list(response_ids), dtype=ids.dtype)
    if resp.numel() == 0:
        raise ValueError("a sample needs at least one response token")
    prompt_len = ids.shape[1]
    full = torch.cat([ids, resp[None]], dim=1)
    inputs["input_ids"] = full
    target_ids = None
    # A sampled vision placeholder (a random or early model can emit <|image_pad|>) would be one
    # image token more than the image has features, and the forward pass refuses it: as an input
    # it becomes a plain token; it is still scored as the token the policy sampled.
    tok = processor.tokenizer
    placeholders = [i for i in (tok.convert_tokens_to_ids(t) for t in VISION_PLACEHOLDERS)
                    if isinstance(i, int) and i != tok.unk_token_id]
    if placeholders and bool(torch.isin(resp, torch.tensor(placeholders, dtype=resp.dtype)).any()):
        plain = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        safe = resp.clone()
        safe[torch.isin(resp, torch.tensor(placeholders, dtype=resp.dtype))] = plain
        inputs["input_ids"] = torch.cat([ids, safe[None]], dim=1)
        target_ids = full
    if "attention_mask" in inputs:
        am = inputs["attention_mask"]
        inputs["attention_mask"] = torch.cat([am, torch.ones(1, resp.numel(), dtype=am.dtype)], dim=1)
    if "mm_token_type_ids" in inputs:  # response tokens are text
        mt = inputs["mm_token_type_ids"]
        inputs["mm_token_type_ids"] = torch.cat([mt, torch.zeros(1, resp.numel(), dtype=mt.dtype)], dim=1)
    inputs.pop("token_type_ids", None)
    return Encoded(inputs=inputs, prompt_len=prompt_len, response_ids=resp, target_ids=target_ids)


# ---- the learner -------------------------------------------------------------------------------------


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model_and_processor(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText

    processor = load_processor(path)
    with hf_progress_bars_off():
        model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype)
    return model.to(device), processor


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
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


class Learner:
    """Holds the policy being trained, its optimizer and its version."""

    def __init__(self, model_path: Path, opts: LearnerOptions | None = None, *, version: int = 0):
        self.opts = opts or LearnerOptions()
        torch.manual_seed(self.opts.seed)
        self.device = pick_device(self.opts.device)
        self.dtype = pick_dtype(self.opts.dtype, self.device)
        self.model_path = Path(model_path)
        self.model, self.processor = load_model_and_processor(self.model_path, self.dtype, self.device)
        if self.opts.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.lora = self.opts.lora is not None
        if self.opts.lora is not None:
            from peft import LoraConfig, get_peft_model

            lo = self.opts.lora
            self.model = get_peft_model(self.model, LoraConfig(r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
                                                               target_modules=lo.target_modules))
        # The KL reference stays frozen for the whole run; with LoRA it is the base model itself
        # (adapters switched off), so no second copy is loaded.
        self.ref_model: Any = None
        if self.opts.loss.kl_coef > 0 and not self.lora:
            self.ref_model, _ = load_model_and_processor(Path(self.opts.reference or self.model_path), self.dtype,
                                                         self.device)
            self.ref_model.eval().requires_grad_(False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.opts.lr, weight_decay=self.opts.weight_decay,
                                           betas=self.opts.betas)
        self.version = version
        self.counters: dict[str, int] = {"updates": 0, "samples": 0, "tokens": 0}

    # -- forward ------------------------------------------------------------------------------------

    def response_ids(self, sample: Sample) -> list[int]:
        """The sample's response token ids; an experience-pool episode recorded without ids has
        its response text tokenised (plus the end-of-turn token the server would have sampled)."""
        if sample.response_token_ids:
            return list(sample.response_token_ids)
        text = sample.response_text or ""
        tok = self.processor.tokenizer
        out = list(tok(text, add_special_tokens=False)["input_ids"])
        end = tok.convert_tokens_to_ids("<|im_end|>")
        if isinstance(end, int) and end != tok.unk_token_id:
            out.append(end)
        return out

    def encode(self, sample: Sample) -> Encoded:
        if sample.turns:
            raise ValueError(f"sample {sample.episode_id}: trajectory samples (several trained turns) are not supported "
                             "by the learner yet; use the data manager's step granularity")
        return encode_sample(self.processor, sample.messages, self.response_ids(sample))

    def token_logprobs(self, enc: Encoded, *, full: bool | None = None,
                       model: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-probs [1, N], loss mask [1, N], logits [1, N, V]) of the sequence's next tokens.

        ``full``: N = every position of prompt + response, and the mask (:func:`response_mask`)
        is 1 only where the predicted token is a response token. Otherwise (the default, which
        saves a [L, vocab] logits tensor on long VLM prompts) only the response positions are
        computed: N = T and the mask is all ones. Both give the same response log-probs.
        """
        full = self.opts.full_logits if full is None else full
        inputs = {k: v.to(self.device) for k, v in enc.inputs.items()}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        ids = inputs["input_ids"]
        keep = 0 if full else enc.response_len + 1  # 0 = all positions
        logits = (model or self.model)(**inputs, use_cache=False, logits_to_keep=keep).logits[:, :-1, :]
        if self.opts.temperature != 1.0:  # the policy is the distribution the server samples from
            logits = logits / self.opts.temperature
        scored = enc.target_ids.to(ids.device) if enc.target_ids is not None else ids
        targets = scored[:, -logits.shape[1]:]  # the logit at position i predicts token i + 1
        logp = gather_logprobs(logits, targets)
        if full:
            mask = response_mask(enc.prompt_len - 1, enc.response_len)[None].to(logp.device)
        else:
            mask = torch.ones_like(logp)
        return logp, mask, logits

    def response_logprobs(self, enc: Encoded) -> torch.Tensor:
        """Log-probs [1, T] of the response tokens under the current weights."""
        logp, mask, _ = self.token_logprobs(enc)
        return logp[mask > 0][None]

    @torch.no_grad()
    def reference_logprobs(self, enc: Encoded) -> torch.Tensor:
        """Log-probs [1, T] of the response tokens under the frozen KL reference."""
        if self.lora:
            with self.model.disable_adapter():
                return self.response_logprobs(enc)
        logp, mask, _ = self.token_logprobs(enc, model=self.ref_model)
        return logp[mask > 0][None]

    @torch.no_grad()
    def score(self, sample: Sample) -> list[float]:
        """Current log-probs of a sample's response tokens (no grad)."""
        self.model.eval()
        return self.response_logprobs(self.encode(sample))[0].float().cpu().tolist()

    def sample_loss(self, sample: Sample, enc: Encoded, prox: torch.Tensor,
                    ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """(loss, loss stats, mean entropy) of one sample; ``prox`` [1, T]: its proximal log-probs,
        ``ref`` [1, T]: its KL reference's (None without a KL term)."""
        lo = self.opts.loss
        logp, mask, logits = self.token_logprobs(enc)
        # place the per-response-token tensors on the sequence's mask (prompt positions: unused 0s)
        on = mask > 0
        prox_full = torch.zeros_like(logp)
        prox_full[on] = prox.reshape(-1).to(logp.dtype)
        if sample.behav_logprobs is None:  # not recorded (e.g. a pool episode): π_b = π_prox, weight 1
            behav = prox_full
        else:
            behav = torch.zeros_like(logp)
            behav[on] = torch.tensor(list(sample.behav_logprobs), dtype=logp.dtype, device=logp.device)
        adv = torch.tensor([float(sample.advantage)], dtype=torch.float32, device=self.device)
        loss, stats = decoupled_ppo_loss(logp, prox_full, behav, adv, mask, clip_low=lo.clip_low,
                                         clip_high=lo.clip_high, behav_cap=lo.behav_cap, behav_reject=lo.behav_reject,
                                         dual_clip=lo.dual_clip, aggregation=lo.aggregation)
        if ref is not None and lo.kl_coef > 0:
            ref_full = torch.zeros_like(logp)
            ref_full[on] = ref.reshape(-1).to(logp.dtype)
            kl = kl_penalty(logp, ref_full, mask, kind=lo.kl_kind, aggregation=lo.aggregation)  # type: ignore[arg-type]
            loss = loss + lo.kl_coef * kl
            stats = {**stats, "kl_ref": float(kl.detach())}
        ent = token_entropy(logits)
        ent_mean = (ent * mask).sum() / mask.sum()
        if lo.entropy_coef:
            loss = loss - lo.entropy_coef * ent_mean
        return loss, stats, ent_mean.detach()

    # -- update -------------------------------------------------------------------------------------

    def update(self, samples: Sequence[Sample]) -> UpdateStats:
        """One policy update on ``samples``; the version goes up by one."""
        if not samples:
            raise ValueError("update needs at least one sample")
        t0 = time.perf_counter()
        encs = [self.encode(s) for s in samples]
        for s, e in zip(samples, encs, strict=True):
            if s.behav_logprobs is not None and len(s.behav_logprobs) != e.response_len:
                raise ValueError(f"sample {s.episode_id}#{s.step_index}: {len(s.behav_logprobs)} behaviour "
                                 f"log-probs for {e.response_len} response tokens")
        # proximal policy = the weights before this update
        self.model.eval()
        with torch.no_grad():
            prox = [self.response_logprobs(e).detach() for e in encs]
            refs = ([self.reference_logprobs(e).detach() for e in encs] if self.opts.loss.kl_coef > 0
                    else [None] * len(encs))
        self.model.train()
        aggregation = self.opts.loss.aggregation
        total_tokens = sum(e.response_len for e in encs)
        n_mb = min(self.opts.minibatches, len(samples))
        minibatches = [list(range(len(samples)))[i::n_mb] for i in range(n_mb)]
        loss_sum, ent_sum, drift_sum, grad_norms = 0.0, 0.0, 0.0, []
        agg_stats: dict[str, float] = {}
        params = [p for p in self.model.parameters() if p.requires_grad]
        for mb in minibatches:
            self.optimizer.zero_grad(set_to_none=True)
            mb_tokens = sum(encs[i].response_len for i in mb)
            for i in mb:
                s, e = samples[i], encs[i]
                loss, stats, ent_mean = self.sample_loss(s, e, prox[i], refs[i])
                # per-sample means re-weighted so the minibatch's loss is a token (or sequence) mean
                share = e.response_len / mb_tokens if aggregation == "token_mean" else 1.0 / len(mb)
                (loss * share).backward()
                w = e.response_len / total_tokens
                loss_sum += float(loss.detach()) * w
                ent_sum += float(ent_mean) * w
                if s.behav_logprobs is not None:
                    behav = torch.tensor(list(s.behav_logprobs), dtype=torch.float32)
                    drift_sum += float((behav - prox[i].reshape(-1).float().cpu()).sum())
                for k, v in stats.items():
                    agg_stats[k] = agg_stats.get(k, 0.0) + float(v) * w
            gn = torch.nn.utils.clip_grad_norm_(params, self.opts.grad_clip)
            grad_norms.append(float(gn))
            if math.isfinite(float(gn)):  # a non-finite gradient skips the step instead of poisoning the weights
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        self.version += 1
        self.counters["updates"] += 1
        self.counters["samples"] += len(samples)
        self.counters["tokens"] += total_tokens
        return UpdateStats(version=self.version, samples=len(samples), tokens=total_tokens, loss=loss_sum,
                           entropy=ent_sum, kl_prox_behav=drift_sum / total_tokens, grad_norm=max(grad_norms),
                           seconds=round(time.perf_counter() - t0, 3),
                           extra={f"loss/{k}": v for k, v in agg_stats.items()})

    # -- checkpoints --------------------------------------------------------------------------------

    def save(self, out: Path, extra_state: dict[str, Any] | None = None,
             write_extra: Callable[[Path], None] | None = None) -> Path:
        """Write a checkpoint dir (atomically: a temp dir renamed into place) and return it.

        The dir is a HF model dir the CPU policy server reloads; with LoRA it also holds
        ``adapter/`` (vLLM LoRA hot-load) and the merged model unless ``export_merged`` is off.
        """
        out = Path(out)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with hf_progress_bars_off():
            if self.lora:
                self.model.save_pretrained(str(tmp / ADAPTER_DIR))
                assert self.opts.lora is not None
                if self.opts.lora.export_merged:
                    self._save_merged(tmp)
            else:
                self.model.save_pretrained(str(tmp), safe_serialization=True)
        copy_processor_files(self.model_path, tmp)
        torch.save(self.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        state = {"schema": STATE_SCHEMA, "version": self.version, "counters": dict(self.counters),
                 "base_model": str(self.model_path), "lora": self.lora, "saved_at": time.time(),
                 **(extra_state or {})}
        if write_extra is not None:  # e.g. the data manager's and rollout controller's state files
            write_extra(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, default=str))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        return out

    def _save_merged(self, out: Path) -> None:
        """The base weights with the adapter folded in, without touching the training model."""
        merged = copy.deepcopy(self.model).merge_and_unload()
        merged.save_pretrained(str(out), safe_serialization=True)
        del merged

    @classmethod
    def resume(cls, ckpt: Path, opts: LearnerOptions | None = None) -> tuple[Learner, dict[str, Any]]:
        """A learner restored from a checkpoint dir: weights, optimizer, version and counters.

        Returns it with the whole saved state (the data manager's and rollout controller's parts
        are the caller's to restore)."""
        ckpt = Path(ckpt)
        state = read_state(ckpt)
        opts = opts or LearnerOptions()
        if state.get("lora"):
            if opts.lora is None:
                raise ValueError(f"{ckpt}: a LoRA checkpoint; set learner.lora to resume it")
            base = Path(state["base_model"])
            learner = cls(base, opts, version=int(state["version"]))
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            adapter = load_file(str(ckpt / ADAPTER_DIR / "adapter_model.safetensors"))
            set_peft_model_state_dict(learner.model, adapter)
        else:
            # the KL reference is the model the run started from, not this checkpoint
            ref = opts.reference or Path(state.get("base_model", ckpt))
            learner = cls(ckpt, opts.model_copy(update={"lora": None, "reference": ref}), version=int(state["version"]))
            learner.model_path = Path(state.get("base_model", ckpt))
        opt_file = ckpt / OPTIMIZER_FILE
        if opt_file.is_file():
            learner.optimizer.load_state_dict(torch.load(opt_file, map_location=learner.device, weights_only=True))
        learner.counters.update({k: int(v) for k, v in state.get("counters", {}).items()})
        return learner, state


# the files of a model dir that are not weights or config: tokenizer, processor, chat template
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.jinja", "chat_template.json")


def copy_processor_files(src: Path, dst: Path) -> None:
    """Copy the base model's processor files (the policy server loads the processor from the
    checkpoint dir too, and it never changes during training)."""
    for name in PROCESSOR_FILES:
        f = Path(src) / name
        if f.is_file():
            shutil.copy2(f, Path(dst) / name)


def read_state(ckpt: Path) -> dict[str, Any]:
    f = Path(ckpt) / STATE_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{ckpt}: not a trainer checkpoint (no {STATE_FILE})")
    state = json.loads(f.read_text())
    if state.get("schema") != STATE_SCHEMA:
        raise ValueError(f"{f}: unknown checkpoint schema {state.get('schema')!r}; expected {STATE_SCHEMA}")
    return state


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint with the highest version under ``ckpt_root`` (dirs named ``v<version>``)."""
    best: tuple[int, Path] | None = None
    if not Path(ckpt_root).is_dir():
        return None
    for d in Path(ckpt_root).iterdir():
        if d.is_dir() and d.name.startswith("v") and d.name[1:].isdigit() and (d / STATE_FILE).is_file():
            v = int(d.name[1:])
            if best is None or v > best[0]:
                best = (v, d)
    return best[1] if best else None
