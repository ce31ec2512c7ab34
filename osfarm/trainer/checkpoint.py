"""The layout of a training checkpoint: served weights apart from the full training state.

    <run>/checkpoints/v<N>/
        trainer_state.json    version, counters, base model, layout (written last: a dir without it
                              is not a checkpoint)
        model/                Hugging Face model dir, safetensors in the serving dtype + config +
                              processor files: what a policy server loads (``/v1/weights/reload``,
                              a vLLM restart); with LoRA the merged model (``save_merged``)
        adapter/              with LoRA: the PEFT adapter (vLLM's LoRA hot-load)
        state/                what only the trainer needs to resume: ``optimizer.pt`` (fp32 moments
                              and step counts, whole, keyed by parameter name whatever the rank
                              count that saved it: ``optimizer_state.py``), ``master.safetensors``
                              (the fp32 master weights when the served ones are bf16), the data
                              manager's and rollout controller's JSON

The LR schedule's position is ``trainer_state.json``'s ``counters.optimizer_steps``. A checkpoint
resumes with any rank count (one, data-parallel or FSDP): under FSDP rank 0 reads the weights and
the optimizer state and the other ranks receive their shards.

A checkpoint dir is written under a temporary name and renamed into place, so a crash never
leaves half a checkpoint; the last ``keep`` are kept. Versions between full checkpoints
(``checkpoint_every``) get the served weights only (no ``state/``, no ``trainer_state.json``: never
resumed from); ``state/`` and ``trainer_state.json`` may be written after the rename, in the
background (``learner_saving.py``), the state file last. Checkpoints of the first layout (model files
at the top of ``v<N>/``, schema ``osfarm.trainer_state/1``) still resume, and so do optimizer files
keyed by parameter position (``optimizer.state_dict()`` as it is, which earlier versions wrote on
one rank).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
STATE_SCHEMA = "osfarm.trainer_state/2"
OLD_SCHEMAS = ("osfarm.trainer_state/1",)
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
TRAIN_STATE_DIR = "state"
OPTIMIZER_FILE = "optimizer.pt"
MASTER_FILE = "master.safetensors"

# the files of a model dir that are not weights or config: tokenizer, processor, chat template
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json", "chat_template.jinja", "chat_template.json")


def model_dir(ckpt: Path) -> Path:
    """The served weights of a checkpoint (a HF model dir); the dir itself for the first layout."""
    d = Path(ckpt) / MODEL_DIR
    return d if (d / "config.json").is_file() else Path(ckpt)


def adapter_dir(ckpt: Path) -> Path:
    return Path(ckpt) / ADAPTER_DIR


def train_state_dir(ckpt: Path) -> Path:
    """Where the training state lives (the dir itself for the first layout)."""
    d = Path(ckpt) / TRAIN_STATE_DIR
    return d if d.is_dir() else Path(ckpt)


def copy_processor_files(src: Path, dst: Path) -> None:
    """Copy the base model's processor files (the policy server loads the processor from the
    checkpoint's model dir too, and it never changes during training)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in PROCESSOR_FILES:
        f = Path(src) / name
        if f.is_file():
            shutil.copy2(f, Path(dst) / name)


def read_state(ckpt: Path) -> dict[str, Any]:
    f = Path(ckpt) / STATE_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{ckpt}: not a trainer checkpoint (no {STATE_FILE})")
    state = json.loads(f.read_text())
    if state.get("schema") not in (STATE_SCHEMA, *OLD_SCHEMAS):
        raise ValueError(f"{f}: unknown checkpoint schema {state.get('schema')!r}; expected {STATE_SCHEMA}")
    return state


def checkpoint_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(version, dir) of every complete checkpoint under ``ckpt_root`` (dirs ``v<version>``), oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [(int(d.name[1:]), d) for d in root.iterdir()
             if d.is_dir() and d.name.startswith("v") and d.name[1:].isdigit() and (d / STATE_FILE).is_file()]
    return sorted(found)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint with the highest version under ``ckpt_root``."""
    dirs = checkpoint_dirs(ckpt_root)
    return dirs[-1][1] if dirs else None


def prune_checkpoints(ckpt_root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints, the weights-only dirs of versions before the
    newest (the servers loaded them already; the newest may still be getting its training state
    written) and leftovers of interrupted writes; returns what went."""
    gone = [d for _, d in checkpoint_dirs(ckpt_root)[:-keep]] if keep > 0 else []
    root = Path(ckpt_root)
    if root.is_dir():
        versions = {int(d.name[1:]): d for d in root.iterdir()
                    if d.is_dir() and d.name.startswith("v") and d.name[1:].isdigit()}
        newest = max(versions, default=None)
        gone += [d for v, d in versions.items() if v != newest and not (d / STATE_FILE).is_file()]
        gone += [d for d in root.iterdir() if d.is_dir() and ".tmp" in d.name]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone
