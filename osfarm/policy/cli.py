"""``osfarm policy``: serve a policy over the OpenAI chat API, build the tiny test model.

torch, transformers and the web stack (FastAPI, uvicorn: ~0.2 s) load only when ``serve`` runs,
so every other ``osfarm`` command starts fast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from osfarm.http.hosts import is_loopback_host
from osfarm.policy.engine import PolicyEngine, resolve_model_path
from osfarm.policy.run_budget import BudgetError, ServerBudget, server_budget
from osfarm.policy.sampling import LOGPROBS_MODES, LatencyModel
from osfarm.policy.tiny import build_tiny_model, tiny_model_dir
from osfarm.policy.vllm import VllmOptions, compose_command, shell_command

policy_app = typer.Typer(
    help="CPU policy server (OpenAI-compatible chat completions with token ids, log-probs, policy versions).",
    no_args_is_help=True,
)
err = Console(stderr=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


@policy_app.command("serve")
def serve(
    model: Annotated[
        str, typer.Option("--model", envvar="OSFARM_POLICY_MODEL", help="a local HF model dir, or 'tiny'")
    ],
    host: Annotated[str, typer.Option("--host", envvar="OSFARM_POLICY_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", envvar="OSFARM_POLICY_PORT")] = 8000,
    served_model_name: Annotated[
        str | None,
        typer.Option("--served-model-name", help="name clients send as `model` (default: 'tiny' or the dir name)"),
    ] = None,
    tokenizer: Annotated[
        Path | None, typer.Option("--tokenizer", help="dir with the tokenizer and image processor (default: --model)")
    ] = None,
    version: Annotated[int, typer.Option("--version", help="policy version of the initial weights")] = 0,
    delay_ms: Annotated[float, typer.Option("--delay-ms", help="artificial latency per request, mean (ms)")] = 0.0,
    delay_sigma: Annotated[
        float, typer.Option("--delay-sigma", help="lognormal sigma of the latency (0 = fixed)")
    ] = 0.0,
    delay_seed: Annotated[int | None, typer.Option("--delay-seed", help="seed of the latency sampler")] = None,
    logprobs_mode: Annotated[
        str,
        typer.Option("--logprobs-mode",
                     help="processed: of the sampling distribution; raw: of the model (docs/policy.md)"),
    ] = "processed",
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16")] = "float32",
    max_model_len: Annotated[
        int | None, typer.Option("--max-model-len", help="context limit (prompt + max_tokens)")
    ] = None,
    min_pixels: Annotated[int | None, typer.Option("--min-pixels", min=1, help="screenshot resize lower bound "
                                                   "(default: the model processor's)", show_default=False)] = None,
    max_pixels: Annotated[int | None, typer.Option("--max-pixels", min=1, help="screenshot resize upper bound "
                                                   "(default: the model processor's)", show_default=False)] = None,
    train_config: Annotated[Path | None, typer.Option("--train-config", help="a trainer's train.yaml: its budget "
                                                      "sets --min-pixels, --max-pixels and --max-model-len (a flag "
                                                      "that disagrees is refused)", show_default=False)] = None,
    threads: Annotated[
        int | None, typer.Option("--threads", help="torch CPU threads (default: torch's choice)")
    ] = None,
    enable_lora: Annotated[
        bool,
        typer.Option("--enable-lora",
                     help="vLLM's runtime LoRA API: POST /v1/load_lora_adapter, /v1/unload_lora_adapter"),
    ] = False,
    max_loras: Annotated[
        int, typer.Option("--max-loras", help="most LoRA adapters loaded at once (--enable-lora)")
    ] = 8,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="allow binding a non-loopback address")] = False,
    token: Annotated[str | None, typer.Option("--token", envvar="OSFARM_POLICY_TOKEN", show_default=False,
                                              help="bearer token every route but /health needs (vLLM's --api-key); "
                                                   "the agents and the trainer send OSFARM_POLICY_TOKEN")] = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
) -> None:
    """Serve a transformers VLM on the CPU behind /v1/chat/completions (OpenAPI at /docs)."""
    if not is_loopback_host(host) and not allow_remote:
        raise _fail(f"--host {host}: bind a loopback address, or pass --allow-remote if the network is trusted")
    if logprobs_mode not in LOGPROBS_MODES:
        raise _fail(f"--logprobs-mode {logprobs_mode}: expected processed or raw")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise _fail(f"--dtype {dtype}: expected float32, bfloat16 or float16")
    if tokenizer is not None and not (tokenizer / "tokenizer_config.json").is_file():
        raise _fail(f"--tokenizer {tokenizer}: no tokenizer_config.json there")
    if delay_ms < 0 or delay_sigma < 0:
        raise _fail("--delay-ms and --delay-sigma must be >= 0")
    if max_loras < 1:
        raise _fail(f"--max-loras {max_loras}: must be >= 1")
    try:
        limits = server_budget(train_config, ServerBudget(min_pixels=min_pixels, max_pixels=max_pixels,
                                                          max_model_len=max_model_len))
    except BudgetError as e:
        raise _fail(str(e)) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn  # the web stack: only for this command (see the module docstring)

    from osfarm.policy.server import create_app

    if threads:
        import torch

        torch.set_num_threads(threads)
    with err.status(f"loading {model} ..."):
        try:
            path = resolve_model_path(model)
        except FileNotFoundError as e:
            raise _fail(str(e)) from None
        name = served_model_name or ("tiny" if model == "tiny" else Path(model).name)
        try:
            engine = PolicyEngine(
                path,
                served_name=name,
                version=version,
                logprobs_mode=logprobs_mode,
                dtype=dtype,
                max_model_len=limits.max_model_len,
                min_pixels=limits.min_pixels,
                max_pixels=limits.max_pixels,
                processor_path=tokenizer,
                enable_lora=enable_lora,
                max_loras=max_loras,
            )
        except (OSError, ValueError) as e:
            hint = "" if tokenizer else " (a bare checkpoint? pass --tokenizer DIR of the base model)"
            raise _fail(f"--model {model}: cannot load: {e}{hint}") from None
    latency = LatencyModel(delay_ms, delay_sigma, delay_seed) if delay_ms > 0 else None
    lora = f", LoRA adapters: up to {max_loras}" if enable_lora else ""
    err.print(f"serving [bold]{name}[/] (version {version}, {path}{lora}) on http://{host}:{port}", highlight=False)
    if not token and not is_loopback_host(host):
        err.print("[bold red]warning:[/] serving on a non-loopback address without --token (OSFARM_POLICY_TOKEN): "
                  "anyone who reaches it can generate and swap the weights", highlight=False)
    uvicorn.run(create_app(engine, latency, token=token or None), host=host, port=port, log_level=log_level.lower())


@policy_app.command("build-tiny")
def build_tiny(
    out: Annotated[Path | None, typer.Option("--out", help="write here (default: the shared cache dir)")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Build the tiny random Qwen2-VL model (no download) and print its directory."""
    with err.status("building the tiny model ..."):
        path = build_tiny_model(out, seed=seed) if out else tiny_model_dir(seed=seed)
    print(path)


@policy_app.command("vllm-command")
def vllm_command(
    model: Annotated[str, typer.Option("--model", help="HF model id or dir")] = VllmOptions().model,
    served_model_name: Annotated[str, typer.Option("--served-model-name")] = "policy",
    port: Annotated[int, typer.Option("--port")] = 8000,
    max_loras: Annotated[int, typer.Option("--max-loras", help="adapters at once: η + 2 for the trainer")] = 4,
    max_lora_rank: Annotated[int, typer.Option("--max-lora-rank", help="at least learner.lora.r")] = 64,
    max_images: Annotated[int, typer.Option("--max-images", help="at least the agent's history_images")] = 5,
    min_pixels: Annotated[int | None, typer.Option("--min-pixels", min=1, help="screenshot resize lower bound "
                                                   f"(default: {VllmOptions().min_pixels})",
                                                   show_default=False)] = None,
    max_pixels: Annotated[int | None, typer.Option("--max-pixels", min=1, help="screenshot resize upper bound "
                                                   f"(default: {VllmOptions().max_pixels})",
                                                   show_default=False)] = None,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", min=1, help="prompt + reply tokens "
                                                      f"(default: {VllmOptions().max_model_len})",
                                                      show_default=False)] = None,
    train_config: Annotated[Path | None, typer.Option("--train-config", help="a trainer's train.yaml: its budget "
                                                      "sets --min-pixels, --max-pixels and --max-model-len "
                                                      "(max_prompt_tokens + max_response_tokens); a flag that "
                                                      "disagrees is refused", show_default=False)] = None,
    device: Annotated[list[str] | None, typer.Option("--device", help="cuda:N of this replica (repeat for "
                                                     "tensor parallelism); a trainer's devices.policy entry")] = None,
    compose: Annotated[
        bool, typer.Option("--compose", help="compose.yaml's command list (${VAR:-default} values)")
    ] = False,
) -> None:
    """Print the vLLM command line osfarm's agent and trainer need (the one compose.yaml runs)."""
    if compose:
        for arg in compose_command():
            print(arg)
        return
    try:
        limits = server_budget(train_config, ServerBudget(min_pixels=min_pixels, max_pixels=max_pixels,
                                                          max_model_len=max_model_len))
    except BudgetError as e:
        raise _fail(str(e)) from None
    opts = VllmOptions(model=model, served_model_name=served_model_name, port=port, max_loras=max_loras,
                       max_lora_rank=max_lora_rank, max_images=max_images,
                       tensor_parallel_size=max(1, len(device or [])))
    opts = opts.model_copy(update={k: v for k, v in limits.model_dump().items() if v is not None})
    print(shell_command(opts, device or None))


__all__ = ["policy_app"]
