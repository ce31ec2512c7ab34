"""The vLLM command line osfarm needs, in one place: compose.yaml's ``vllm`` service, the command in
docs/policy.md and ``osfarm policy vllm-command`` are all made here (tests/test_vllm_command.py
checks compose and the docs against it).

What each flag is for:

* the agent: ``--served-model-name`` (the ``model`` agents send), ``--max-model-len`` (system prompt
  + K turns + M screenshots + reply), ``--limit-mm-per-prompt`` (at least the agent's
  ``history_images``; JSON syntax), ``--mm-processor-kwargs`` (Qwen2.5-VL's smart-resize bounds:
  UI-TARS coordinates are in the resized image, so the agent must map them with the same bounds);
* the trainer's behaviour log-probs: ``--logprobs-mode processed_logprobs`` (log-probs of the
  distribution tokens were sampled from, after temperature and top-p/top-k: π_b of the decoupled
  loss; vLLM's default is the raw model's), ``--generation-config vllm`` (never the model's
  ``generation_config.json`` sampling defaults, e.g. Qwen's top_k=1 and repetition penalty: only
  what the request asks), ``--max-logprobs`` and ``--return-tokens-as-token-ids`` (tokens come back
  as ``token_id:N``, never re-tokenised);
* weight sync: ``--enable-lora`` with the environment's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
  (``/v1/load_lora_adapter``), ``--max-lora-rank`` (at least ``learner.lora.r``) and ``--max-loras``
  (adapters served at once: the current version plus the ones episodes still run on, up to η + 1
  behind: η + 2).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from pydantic import BaseModel, Field

from osfarm.schema.budget import Budget

VLLM_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


class VllmOptions(BaseModel):
    model: str = "Qwen/Qwen2.5-VL-7B-Instruct"
    served_model_name: str = "policy"
    host: str | None = Field(default=None, description="None: vLLM's default (all interfaces of its container)")
    port: int = 8000
    dtype: str = "bfloat16"
    max_model_len: int = 32768
    max_images: int = 5
    min_pixels: int = 100 * 28 * 28
    max_pixels: int = 16384 * 28 * 28
    max_logprobs: int = 20
    max_lora_rank: int = 64
    max_loras: int = 4
    gpu_memory_utilization: float = 0.90
    tensor_parallel_size: int = 1

    def with_budget(self, budget: Budget) -> VllmOptions:
        """These options with a run's budget (train.yaml's ``budget``): its resize bounds and, with
        both token limits, ``max_model_len`` = prompt + response; what it leaves unset stays."""
        update = {k: v for k, v in (("min_pixels", budget.min_pixels), ("max_pixels", budget.max_pixels),
                                    ("max_model_len", budget.max_model_len)) if v is not None}
        return self.model_copy(update=update)


@dataclass(frozen=True)
class _Flag:
    flag: str
    field: str | None  # None: a switch without a value
    env: str | None = None  # compose.yaml: the variable that overrides it


FLAGS = (
    _Flag("--model", "model", "OSFARM_MODEL"),
    _Flag("--served-model-name", "served_model_name", "OSFARM_SERVED_MODEL"),
    _Flag("--host", "host"),
    _Flag("--port", "port"),
    _Flag("--dtype", "dtype"),
    _Flag("--max-model-len", "max_model_len", "OSFARM_MAX_MODEL_LEN"),
    _Flag("--limit-mm-per-prompt", "max_images", "OSFARM_MAX_IMAGES"),
    _Flag("--mm-processor-kwargs", "min_pixels"),
    _Flag("--max-logprobs", "max_logprobs"),
    _Flag("--logprobs-mode", None),
    _Flag("--generation-config", None),
    _Flag("--return-tokens-as-token-ids", None),
    _Flag("--enable-lora", None),
    _Flag("--max-lora-rank", "max_lora_rank", "OSFARM_MAX_LORA_RANK"),
    _Flag("--max-loras", "max_loras", "OSFARM_MAX_LORAS"),
    _Flag("--enable-prefix-caching", None),
    _Flag("--gpu-memory-utilization", "gpu_memory_utilization", "OSFARM_GPU_MEMORY_UTILIZATION"),
    _Flag("--tensor-parallel-size", "tensor_parallel_size", "OSFARM_TENSOR_PARALLEL_SIZE"),
)
# switches that take a fixed value (the behaviour log-probs depend on them: not configurable)
FIXED = {"--logprobs-mode": "processed_logprobs", "--generation-config": "vllm"}


def vllm_args(opts: VllmOptions | None = None, *, compose: bool = False) -> list[str]:
    """``vllm serve`` arguments (after ``vllm serve``, or as the vllm/vllm-openai image's command).

    ``compose``: the values a compose variable may override are written ``${VAR:-default}``."""
    o = opts or VllmOptions()
    out: list[str] = []
    for f in FLAGS:
        if f.flag in FIXED:
            out += [f.flag, FIXED[f.flag]]
            continue
        if f.field is None:
            out.append(f.flag)
            continue
        raw = getattr(o, f.field)
        if raw is None:
            continue
        value = f"${{{f.env}:-{raw}}}" if compose and f.env else str(raw)
        if f.flag == "--limit-mm-per-prompt":
            value = '{"image": ' + value + ', "video": 0}'
        elif f.flag == "--mm-processor-kwargs":
            value = json.dumps({"min_pixels": o.min_pixels, "max_pixels": o.max_pixels})
        out += [f.flag, value]
    return out


def compose_command() -> list[str]:
    """compose.yaml's ``services.vllm.command``."""
    return vllm_args(VllmOptions(), compose=True)


def shell_command(opts: VllmOptions | None = None, devices: list[str] | None = None) -> str:
    """The command as one would type it (docs/policy.md's block): environment, ``vllm serve MODEL``
    and one flag per line. ``devices``: CUDA devices (``cuda:N``) of this replica."""
    o = opts or VllmOptions()
    args = vllm_args(o)
    model = args[1]
    env = dict(VLLM_ENV)
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(d.partition(":")[2] or "0" for d in devices)
    lines = [" ".join(f"{k}={v}" for k, v in env.items()) + " \\", f"vllm serve {shlex.quote(model)} \\"]
    rest = args[2:]
    i = 0
    pairs: list[str] = []
    while i < len(rest):
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            pairs.append(f"{rest[i]} {shlex.quote(rest[i + 1])}")
            i += 2
        else:
            pairs.append(rest[i])
            i += 1
    lines += [f"  {p} \\" for p in pairs[:-1]] + [f"  {pairs[-1]}"]
    return "\n".join(lines)
