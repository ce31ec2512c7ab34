"""A tiny, randomly initialised Qwen2-VL-architecture model, built locally from a config.

No download: the tokenizer is a byte-level BPE trained here on a small built-in corpus (GUI
actions, pyautogui code, UI-TARS replies), with Qwen2-VL's special tokens; the image processor
is Qwen2-VL's with a small pixel budget; the weights are random (seeded). The result is a
regular Hugging Face directory, loadable with ``Qwen2VLForConditionalGeneration.from_pretrained``
and ``AutoTokenizer`` / ``AutoImageProcessor`` (and ``AutoProcessor`` where torchvision is
installed: transformers 5 needs it for Qwen2-VL's video processor). One generation step over a
1280x720 screenshot takes well under a second on one CPU core.

``tiny_model_dir()`` builds it once into a cache directory and reuses it (tests, ``--model tiny``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from osfarm.policy.progress import hf_progress_bars_off

# Qwen2's special tokens, in Qwen2's order (ids 0.. here; the real vocabulary puts them at 151643..).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2's pre-tokenizer split (contractions, letters, single digits, punctuation runs, spaces).
_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The Qwen2-VL chat format: "<|im_start|>role\n...<|im_end|>\n", a vision block per image part,
# a default system turn when the chat has none.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Sizes: small enough for tests on a shared 2-core machine, big enough to exercise every part
# (2 text layers with grouped-query attention and mRoPE, a vision block and the patch merger).
TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    # head_dim 16 -> 8 rotary frequencies, split over (temporal, height, width)
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    "rms_norm_eps": 1e-6,
}
VISION_CONFIG = {
    "depth": 1,
    "embed_dim": 32,
    "num_heads": 2,
    "mlp_ratio": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
VOCAB_SIZE = 1024
MIN_PIXELS = 4 * 28 * 28
MAX_PIXELS = 200_704  # 256 image tokens of 28x28 pixels: a 1280x720 screen becomes 588x336
BUILD_FORMAT = 1  # bump when the recipe changes: the cache key includes it

_CORPUS = """\
import pyautogui
pyautogui.click(640, 360)
pyautogui.doubleClick(120, 48)
pyautogui.rightClick(300, 200)
pyautogui.moveTo(512, 384)
pyautogui.dragTo(800, 600, duration=0.5)
pyautogui.scroll(-5)
pyautogui.typewrite('hello world', interval=0.05)
pyautogui.write('Total revenue')
pyautogui.press('enter')
pyautogui.press('tab')
pyautogui.hotkey('ctrl', 's')
pyautogui.hotkey('ctrl', 'c')
pyautogui.hotkey('ctrl', 'v')
pyautogui.hotkey('alt', 'f4')
pyautogui.keyDown('shift'); pyautogui.keyUp('shift')
time.sleep(0.5)
DONE
WAIT
FAIL
{"action_type": "CLICK", "x": 412, "y": 88}
{"action_type": "TYPING", "text": "report.docx"}
{"action_type": "PRESS", "key": "enter"}
{"action_type": "HOTKEY", "keys": ["ctrl", "shift", "t"]}
{"action_type": "SCROLL", "dx": 0, "dy": -3}
Thought: The file menu is open. I will click the Save As entry to save the document.
Action: click(start_box='(132,245)')
Thought: I need to type the name of the new sheet.
Action: type(content='Summary\\n')
Action: hotkey(key='ctrl s')
Action: drag(start_box='(100,200)', end_box='(400,200)')
Action: scroll(start_box='(640,400)', direction='down')
Action: left_double(start_box='(88,120)')
Action: right_single(start_box='(300,310)')
Action: wait()
Action: finished(content='The task is complete.')
```python
import pyautogui
pyautogui.click(1020, 64)
```
Open the terminal, the text editor, the file manager, the browser, the spreadsheet.
Please change the background color of the slide to blue and save the presentation.
Rename the file on the desktop, then open it in LibreOffice Writer and bold the title.
In Chromium, open the settings page and set the default search engine to DuckDuckGo.
Compute the sum of column B in the sheet and write it in cell B10.
Mute the video in VLC, then take a snapshot of the current frame.
Export the image from GIMP as a PNG file with a resolution of 1920 by 1080 pixels.
Archive the emails in the inbox of Thunderbird that are older than one week.
The screenshot shows a window with a toolbar, a menu bar, buttons, text fields and icons.
0 1 2 3 4 5 6 7 8 9 10 20 50 100 128 200 256 300 360 400 480 512 600 640 720 800 1024 1080 1280 1920
"""


def tiny_spec(seed: int = 0) -> dict:
    """Everything the built directory depends on (its cache key)."""
    return {
        "format": BUILD_FORMAT,
        "seed": seed,
        "text": TEXT_CONFIG,
        "vision": VISION_CONFIG,
        "vocab": VOCAB_SIZE,
        "pixels": [MIN_PIXELS, MAX_PIXELS],
        "template": CHAT_TEMPLATE,
        "corpus": _CORPUS,
    }


def tiny_cache_key(seed: int = 0) -> str:
    blob = json.dumps(tiny_spec(seed), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def default_cache_root() -> Path:
    """``$OSFARM_MODEL_CACHE``, else ``$XDG_CACHE_HOME/osfarm`` (``~/.cache/osfarm``)."""
    if os.environ.get("OSFARM_MODEL_CACHE"):
        return Path(os.environ["OSFARM_MODEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "osfarm"


def tiny_model_dir(seed: int = 0, cache_root: Path | None = None) -> Path:
    """The cached tiny model directory, built on first use (atomic: concurrent callers are safe)."""
    root = cache_root or default_cache_root()
    final = root / f"tiny-qwen2vl-{tiny_cache_key(seed)}"
    if (final / "config.json").exists() and (final / "model.safetensors").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        build_tiny_model(staging, seed=seed)
        try:
            staging.rename(final)
        except OSError:  # another process won the race: its copy is identical
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _train_tokenizer():
    """A byte-level BPE (every byte is a token, so any text encodes) with Qwen2's pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True) * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges


def build_tokenizer():
    """Qwen2's tokenizer class over our locally trained vocabulary, with the chat template."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_tokenizer()
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    # Special tokens must be "added tokens": otherwise the pre-tokenizer would split them.
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_image_processor():
    try:  # transformers 5: the PIL backend (the default one needs torchvision)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )
    except ImportError:  # transformers 4: the "slow" processor is PIL-based
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    return ImageProcessor(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=VISION_CONFIG["patch_size"],
        temporal_patch_size=VISION_CONFIG["temporal_patch_size"],
        merge_size=VISION_CONFIG["spatial_merge_size"],
    )


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny Qwen2-VL model directory (config, weights, tokenizer, image processor) to ``out_dir``."""
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS), strict=True))
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    config = Qwen2VLConfig(
        text_config={
            **TEXT_CONFIG,
            "vocab_size": len(tokenizer),
            "bos_token_id": None,
            "eos_token_id": eos,
            "pad_token_id": pad,
        },
        # the merger projects vision features to the text width
        vision_config={**VISION_CONFIG, "hidden_size": TEXT_CONFIG["hidden_size"]},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    # Random weights that do not depend on the caller's RNG state.
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).eval()
    finally:
        torch.random.set_rng_state(rng_state)
    # Plain sampling defaults (no top-k 50, no repetition penalty): the server sets its own anyway.
    model.generation_config = GenerationConfig(
        eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=None, do_sample=True, temperature=1.0, top_p=1.0,
        top_k=0,
    )
    with hf_progress_bars_off():
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    build_image_processor().save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _write_processor_config(out_dir)
    (out_dir / "osfarm_tiny.json").write_text(
        json.dumps(tiny_spec(seed) | {"corpus": None, "template": None}, indent=1))
    return out_dir


def _write_processor_config(out_dir: Path) -> None:
    """Name Qwen2VLProcessor as the processor class, so AutoProcessor picks it (with torchvision)."""
    path = out_dir / "processor_config.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data["processor_class"] = "Qwen2VLProcessor"
    path.write_text(json.dumps(data, indent=2) + "\n")
