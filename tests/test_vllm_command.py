"""One source of truth for the vLLM command line: compose.yaml's vllm service, docs/policy.md's
command and `osfarm policy vllm-command` are what osfarm/policy/vllm.py builds, and it has every
flag the agent and the trainer's behaviour log-probs and weight sync need."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from osfarm.policy.vllm import VLLM_ENV, VllmOptions, compose_command, shell_command, vllm_args

ROOT = Path(__file__).resolve().parent.parent


def test_the_flags_the_trainer_and_agent_need_are_there():
    args = vllm_args()
    pairs = dict(zip(args, [*args[1:], ""], strict=True))
    # behaviour log-probs: the sampling distribution's, never the model's own sampling defaults
    assert pairs["--logprobs-mode"] == "processed_logprobs" and pairs["--generation-config"] == "vllm"
    assert "--return-tokens-as-token-ids" in args and pairs["--max-logprobs"] == "20"
    # weight sync: runtime LoRA with several live versions
    assert "--enable-lora" in args and int(pairs["--max-loras"]) >= 3 and int(pairs["--max-lora-rank"]) >= 16
    assert VLLM_ENV == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    # the agent: images, the smart-resize bounds its coordinate mapping uses
    assert pairs["--limit-mm-per-prompt"] == '{"image": 5, "video": 0}'
    assert pairs["--mm-processor-kwargs"] == '{"min_pixels": 78400, "max_pixels": 12845056}'
    assert vllm_args(VllmOptions(max_loras=6, host="127.0.0.1"))[vllm_args(VllmOptions(max_loras=6)).index(
        "--max-loras") + 3] == "6"  # --host comes first, shifting by 2


def test_compose_runs_the_generated_command():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    vllm = compose["services"]["vllm"]
    assert vllm["command"] == compose_command(), (
        "compose.yaml's vllm command differs from osfarm.policy.vllm: regenerate it with "
        "`osfarm policy vllm-command --compose`")
    for k, v in VLLM_ENV.items():
        assert vllm["environment"][k] == v


def test_docs_show_the_generated_command():
    text = (ROOT / "docs" / "policy.md").read_text()
    m = re.search(r"## vLLM \(GPU\).*?```bash\n(.*?)```", text, re.S)
    assert m, "docs/policy.md: no vLLM command block"
    want = shell_command(VllmOptions(model="ByteDance-Seed/UI-TARS-1.5-7B", served_model_name="ui-tars",
                                     host="127.0.0.1"))
    assert m.group(1).strip() == want


def test_the_cli_prints_it():
    run = subprocess.run([sys.executable, "-c", "from osfarm.cli import app; app()", "policy", "vllm-command",
                          "--compose"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == compose_command()
    run = subprocess.run([sys.executable, "-c", "from osfarm.cli import app; app()", "policy", "vllm-command",
                          "--device", "cuda:2", "--device", "cuda:3", "--max-loras", "6"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "CUDA_VISIBLE_DEVICES=2,3" in run.stdout and "--tensor-parallel-size 2" in run.stdout
    assert "--max-loras 6" in run.stdout
