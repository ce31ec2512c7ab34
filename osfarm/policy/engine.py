"""The policy engine: a transformers VLM on the CPU, its policy version, generation, reloads,
LoRA adapters.

Generation is blocking and runs on the server's single generation thread (one request at a
time: seeds are reproducible and the model's mRoPE state is per call). A reload builds the new
weights next to the old ones and then swaps one reference, so a request that already started
finishes on the weights (and reports the version) it started with.

LoRA adapters (``enable_lora``, vLLM's runtime adapter API): each one is merged into its own copy
of the *base* weights (the ``--model`` dir, whatever reloads happened since) and served under its
name. The adapter table is replaced, never mutated, so a request picks its adapter's weights
once, when it starts, and a replacement (``load_inplace``) or an unload does not touch it.
Adapters carry no policy version (vLLM's do not either): whoever loads them names the version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osfarm.errors import OsfarmError
from osfarm.policy.processing import encode_chat, load_processor
from osfarm.policy.progress import hf_progress_bars_off
from osfarm.policy.sampling import LogprobsMode, SamplingParams, cut_at_stop, finite_logprob, sequence_end
from osfarm.policy.streaming import ChoiceDelta, StepObserver
from osfarm.policy.tiny import tiny_model_dir
from osfarm.schema.budget import Budget

log = logging.getLogger(__name__)


class RequestError(OsfarmError, ValueError):
    """A request the engine refuses; ``field`` names the offending request field (JSON path)."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status


@dataclass(frozen=True)
class LoadedPolicy:
    model: Any
    version: int
    source: str
    loaded_at: float


@dataclass(frozen=True)
class LoadedAdapter:
    """A LoRA adapter merged into a copy of the base weights, served as model ``name``."""

    name: str
    model: Any
    path: str
    loaded_at: float


@dataclass
class Choice:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    logprobs: list[float] | None  # one per token id
    top_logprobs: list[list[tuple[int, float]]] | None  # per token: (token id, logprob), best first


@dataclass(frozen=True)
class Prepared:
    """A request ready to generate: its weights (chosen when it was prepared), its encoded prompt."""

    model: Any
    policy_version: int | None  # None: a LoRA adapter's weights
    inputs: Any  # the processor's BatchFeature
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class Generation:
    policy_version: int | None  # None: a LoRA adapter's generation (adapters have no version)
    prompt_token_ids: list[int]
    choices: list[Choice]
    t_generate_s: float


def resolve_model_path(model: str) -> Path:
    """``tiny`` -> the cached tiny model (built on first use); anything else must be a local dir."""
    if model == "tiny":
        return tiny_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {model}: not a model directory (no config.json); use a local HF dir or 'tiny'")
    return path


def _model_class(path: Path):
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    if config.model_type == "qwen2_vl":
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration
    return AutoModelForImageTextToText


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class PolicyEngine:
    def __init__(
        self,
        model_path: Path,
        *,
        served_name: str,
        version: int = 0,
        logprobs_mode: LogprobsMode = "processed",
        dtype: str = "float32",
        max_model_len: int | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        processor_path: Path | None = None,
        enable_lora: bool = False,
        max_loras: int = 8,
    ):
        self.model_path = Path(model_path)
        self.served_name = served_name
        self.logprobs_mode = logprobs_mode
        self.dtype = dtype
        # tokenizer + image processor: from the model dir unless given (a bare checkpoint has none)
        self.processor = load_processor(Path(processor_path) if processor_path else self.model_path)
        # a run's budget: screenshots resized as the agent maps coordinates and the learner rebuilds them
        Budget(min_pixels=min_pixels, max_pixels=max_pixels).apply_to_processor(self.processor)
        self.tokenizer = self.processor.tokenizer
        model = self._load_full(self.model_path)
        text_config = model.config.get_text_config()
        self.max_model_len = max_model_len or int(getattr(text_config, "max_position_embeddings", 32768))
        self.vocab_size = int(text_config.vocab_size)
        self.eos_ids = self._stop_token_ids(model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.current = LoadedPolicy(model, version, str(self.model_path), time.time())
        self._reload_lock = threading.Lock()
        self.reloading = False
        self.enable_lora = enable_lora
        self.max_loras = max_loras
        self.adapters: dict[str, LoadedAdapter] = {}  # replaced on every change, never mutated
        self._adapter_lock = threading.Lock()  # adapter loads and unloads run one at a time

    # ---- loading ---------------------------------------------------------------------------

    def _load_full(self, path: Path):
        with hf_progress_bars_off():
            model = _model_class(path).from_pretrained(path, dtype=_torch_dtype(self.dtype))
        return model.eval()

    def _stop_token_ids(self, model) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        for tok in ("<|im_end|>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return ids

    def _load_checkpoint(self, path: Path):
        """A HF model dir, a PEFT (LoRA) adapter dir, or a safetensors state dict (file or dir)."""
        if not path.exists():
            raise RequestError("path", f"{path} does not exist")
        if path.is_dir() and (path / "config.json").is_file():
            model = self._load_full(path)
        elif path.is_dir() and (path / "adapter_config.json").is_file():
            model = self._load_lora(path)
        else:
            files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
            if not files or any(f.suffix != ".safetensors" for f in files):
                raise RequestError(
                    "path",
                    f"{path}: expected a HF model dir (config.json), a LoRA adapter dir (adapter_config.json) "
                    "or safetensors weights",
                )
            model = self._load_state_dict(files)
        vocab = int(model.config.get_text_config().vocab_size)
        if vocab != self.vocab_size:
            raise RequestError("path", f"{path}: vocab size {vocab} differs from the served model's {self.vocab_size}")
        return model

    def _load_state_dict(self, files: list[Path]):
        from safetensors.torch import load_file

        state: dict[str, Any] = {}
        for f in files:
            state.update(load_file(str(f)))
        model = self._load_full(self.model_path)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or len(missing) == len(model.state_dict()):
            raise RequestError(
                "path",
                f"the safetensors weights do not fit the model ({len(unexpected)} unexpected keys, e.g. "
                f"{sorted(unexpected)[:3]}; {len(missing)} missing)",
            )
        return model

    def _load_lora(self, path: Path, field: str = "path"):
        """A PEFT LoRA adapter dir applied to a fresh copy of the base weights (``--model``), merged.

        Input problems (no such dir, not an adapter) are RequestErrors naming ``field``; an adapter
        that does not fit the base raises whatever PEFT / torch raise (or ValueError)."""
        if not path.exists():
            raise RequestError(field, f"{path} does not exist")
        if not (path.is_dir() and (path / "adapter_config.json").is_file()):
            raise RequestError(field, f"{path}: not a PEFT adapter dir (no adapter_config.json)")
        try:
            from peft import (
                MODEL_TYPE_TO_PEFT_MODEL_MAPPING,
                PeftConfig,
                PeftModel,
                PeftType,
            )
        except ImportError:
            raise RequestError(field, "a LoRA adapter needs the peft package (pip install peft)") from None
        config = PeftConfig.from_pretrained(str(path))
        if config.peft_type != PeftType.LORA:
            raise RequestError(field, f"{path}: a {config.peft_type} adapter; only LoRA adapters are supported")
        config.inference_mode = True
        base = self._load_full(self.model_path)
        # PeftModel.from_pretrained only warns when the adapter's weights do not fit the model:
        # build it the same way, then check what load_adapter reports.
        peft_cls = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)
        model = peft_cls(base, config, "default")
        result = model.load_adapter(str(path), "default", torch_device="cpu")
        if result.missing_keys:
            raise ValueError(
                f"the adapter does not fit the base model: {len(result.missing_keys)} of its LoRA weights are "
                f"missing from the checkpoint, e.g. {sorted(result.missing_keys)[:2]}"
            )
        if result.unexpected_keys:
            raise ValueError(
                f"the adapter does not fit the base model: {len(result.unexpected_keys)} of its weights name modules "
                f"the model lacks, e.g. {sorted(result.unexpected_keys)[:2]}"
            )
        return model.merge_and_unload().eval()

    def reload(self, path: Path, version: int, force: bool = False) -> LoadedPolicy:
        """Load new weights and make them current (blocking; call from a thread)."""
        with self._reload_lock:
            old = self.current
            if version < old.version and not force:
                raise RequestError(
                    "version",
                    f"{version} is older than the served version {old.version} (send force=true to roll back)",
                    409,
                )
            self.reloading = True
            try:
                model = self._load_checkpoint(Path(path))
            finally:
                self.reloading = False
            new = LoadedPolicy(model, version, str(path), time.time())
            self.current = new  # one reference swap: requests in flight keep `old`
            log.info("policy version %d -> %d from %s", old.version, version, path)
            return new

    # ---- LoRA adapters (vLLM's runtime adapter API) -----------------------------------------

    def load_adapter(self, name: str, path: Path, load_inplace: bool = False) -> LoadedAdapter:
        """Merge the LoRA adapter at ``path`` into a copy of the base weights and serve it as model
        ``name`` (blocking; call from a thread). ``load_inplace`` replaces an adapter of that name:
        requests that already started finish on the old weights."""
        if not self.enable_lora:
            raise RequestError("lora_name", "LoRA adapters are disabled on this server; start it with --enable-lora",
                               404)
        if name == self.served_name:
            raise RequestError("lora_name", f"'{name}' is the base model's served name; give the adapter another name")
        with self._adapter_lock:
            if name in self.adapters and not load_inplace:
                raise RequestError(
                    "lora_name",
                    f"the LoRA adapter '{name}' has already been loaded; set load_inplace to true to replace it",
                )
            if name not in self.adapters and len(self.adapters) >= self.max_loras:
                raise RequestError(
                    "lora_name",
                    f"this server holds at most {self.max_loras} LoRA adapters (--max-loras {self.max_loras}) and "
                    f"{len(self.adapters)} are loaded; unload one first (or load one in place)",
                )
            model = self._load_lora(Path(path), "lora_path")
            adapter = LoadedAdapter(name, model, str(path), time.time())
            replaced = name in self.adapters
            self.adapters = {**self.adapters, name: adapter}  # one reference swap: running requests keep theirs
        log.info("LoRA adapter %r %s from %s", name, "replaced" if replaced else "loaded", path)
        return adapter

    def unload_adapter(self, name: str) -> LoadedAdapter:
        """Stop serving adapter ``name``; requests already running on it finish (blocking: it waits
        for an adapter load in progress)."""
        if not self.enable_lora:
            raise RequestError("lora_name", "LoRA adapters are disabled on this server; start it with --enable-lora",
                               404)
        with self._adapter_lock:
            adapter = self.adapters.get(name)
            if adapter is None:
                loaded = ", ".join(f"'{n}'" for n in self.adapters) or "none"
                raise RequestError("lora_name", f"the LoRA adapter '{name}' cannot be found (loaded: {loaded})", 404)
            self.adapters = {n: a for n, a in self.adapters.items() if n != name}
        log.info("LoRA adapter %r unloaded", name)
        return adapter

    def served_names(self) -> list[str]:
        return [self.served_name, *self.adapters]

    # ---- generation ------------------------------------------------------------------------

    def prepare(self, messages: list[dict[str, Any]], params: SamplingParams, adapter: str | None = None) -> Prepared:
        """Pick the request's weights and encode its prompt (blocking: the generation thread).

        Messages are OpenAI chat messages (plain dicts); ``adapter``: a loaded LoRA adapter's name
        (None: the base model). Raises MessageError / RequestError."""
        # the weights this request runs on, whatever reloads / adapter swaps happen meanwhile
        if adapter is None:
            policy = self.current
            model, version = policy.model, policy.version
        else:
            lora = self.adapters.get(adapter)
            if lora is None:  # unloaded while the request waited for the generation thread
                raise RequestError("model", f"the LoRA adapter `{adapter}` has been unloaded", 404)
            model, version = lora.model, None
        inputs = encode_chat(self.processor, messages)
        prompt_ids = inputs["input_ids"][0].tolist()
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens",
            )
        return Prepared(model, version, inputs, prompt_ids, params)

    def generate(
        self, messages: list[dict[str, Any]], params: SamplingParams, adapter: str | None = None
    ) -> Generation:
        """``prepare`` + ``run``: the whole answer at once."""
        return self.run(self.prepare(messages, params, adapter))

    def run(self, req: Prepared, emit: Callable[[list[ChoiceDelta]], None] | None = None,
            cancel: threading.Event | None = None) -> Generation:
        """Generate the prepared request (blocking). With ``emit``, every step's tokens, log-probs
        and text deltas are handed to it as they are sampled (streaming, on this thread); setting
        ``cancel`` then stops the generation after the current step."""
        import torch

        params = req.params
        t0 = time.perf_counter()
        if params.seed is not None:
            torch.manual_seed(params.seed)
        else:  # fresh entropy: an earlier seeded request must not make later unseeded ones predictable
            torch.seed()
        # Greedy decoding gives n identical sequences: decode once (transformers refuses n > 1 there).
        n_runs = 1 if params.greedy else params.n
        kwargs: dict[str, Any] = {}
        if params.stop:
            kwargs.update(stop_strings=list(params.stop), tokenizer=self.tokenizer)
        observer = hook = None
        if emit is not None:
            from transformers import StoppingCriteriaList

            observer = StepObserver(n=params.n, rows=n_runs, params=params, eos_ids=self.eos_ids,
                                    decode=self.decode, finish=lambda ids: self.finish(ids, params), emit=emit,
                                    cancel=cancel)
            kwargs["stopping_criteria"] = StoppingCriteriaList([observer])
            if self.logprobs_mode == "raw":  # the observer sees processed scores only: record the logits
                hook = req.model.register_forward_hook(observer.record_logits)
        try:
            with torch.inference_mode():
                out = req.model.generate(
                    **req.inputs,
                    **kwargs,
                    max_new_tokens=params.max_tokens,
                    do_sample=not params.greedy,
                    # Explicit neutral values: a model's generation_config.json (e.g. Qwen's top_k=1,
                    # repetition_penalty=1.05) must not change what the request asked for.
                    temperature=1.0 if params.greedy else params.temperature,
                    top_p=1.0 if params.greedy else params.top_p,
                    top_k=0 if params.greedy else params.top_k,
                    repetition_penalty=1.0,
                    num_return_sequences=n_runs,
                    eos_token_id=sorted(self.eos_ids),
                    pad_token_id=self.pad_id,
                    return_dict_in_generate=True,
                    output_scores=self.logprobs_mode == "processed",
                    output_logits=self.logprobs_mode == "raw",
                )
        finally:
            if hook is not None:
                hook.remove()
        steps = out.scores if self.logprobs_mode == "processed" else out.logits
        generated = out.sequences[:, len(req.prompt_token_ids) :]
        choices = [self._choice(i, generated[i % n_runs].tolist(), steps, params, i % n_runs) for i in range(params.n)]
        return Generation(req.policy_version, req.prompt_token_ids, choices, time.perf_counter() - t0)

    def finish(self, ids: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
        """A generated sequence's answer: its ids up to the end (stop string, end-of-sequence token;
        padding dropped), its text (a stop string and what follows cut off) and finish reason."""
        if params.stop:  # a stop string ends the sequence where it first appears (padding follows)
            ids = ids[: self._stop_string_end(ids, params.stop)]
        length, stopped = sequence_end(ids, self.eos_ids)
        ids = ids[:length]
        text = self.decode(ids)
        if params.stop:
            text, hit = cut_at_stop(text, params.stop)
            stopped = stopped or hit
        return ids, text, "stop" if stopped else "length"

    def _choice(self, index: int, ids: list[int], steps, params: SamplingParams, row: int) -> Choice:
        """Choice ``index`` from row ``row`` of the generated batch (and of the per-step scores)."""
        import torch

        ids, text, finish_reason = self.finish(ids, params)
        logprobs = tops = None
        if params.logprobs or params.top_logprobs:
            logprobs, tops = [], []
            for t, tok in enumerate(ids):
                lp = torch.log_softmax(steps[t][row].float(), dim=-1)
                logprobs.append(finite_logprob(float(lp[tok])))
                if params.top_logprobs:
                    vals, idx = torch.topk(lp, k=min(params.top_logprobs, lp.shape[-1]))
                    tops.append([(int(i), finite_logprob(float(v))) for v, i in zip(vals, idx, strict=True)])
                else:
                    tops.append([])
        return Choice(index, ids, text, finish_reason, logprobs, tops)

    def decode(self, ids: Sequence[int]) -> str:
        """The answer text of token ids (special tokens left out)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _stop_string_end(self, ids: list[int], stop: tuple[str, ...]) -> int:
        for k in range(1, len(ids) + 1):
            text = self.decode(ids[:k])
            if any(s and s in text for s in stop):
                return k
        return len(ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
