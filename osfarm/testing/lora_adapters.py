"""PEFT LoRA adapters for the tiny policy model (the policy server tests load them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, cast


def lora_adapter(src: Path, dst: Path, seed: int = 0) -> tuple[Path, Path]:
    """A random (non-zero) LoRA on the attention projections of the model at ``src``; returns
    (adapter dir, merged model dir) under ``dst``. Different seeds give different adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    base = Qwen2VLForConditionalGeneration.from_pretrained(src)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(20)  # a visible change of the output distribution
    peft_model.save_pretrained(str(dst / "adapter"))
    # peft types the LoRA model's merge_and_unload as its __getattr__'s answer (a Tensor)
    cast(Any, peft_model).merge_and_unload().save_pretrained(dst / "merged")
    return dst / "adapter", dst / "merged"


def misfit_adapter(adapter: Path, dst: Path) -> Path:
    """A copy of ``adapter`` whose config claims another rank: its weights no longer fit the model
    (what an adapter trained for another base looks like to the loader)."""
    shutil.copytree(adapter, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config["r"] = int(config["r"]) * 2
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst
