"""One image and length budget per run: train.yaml's ``budget`` reaches the agent's options, the
learner's options and vLLM's command line, and disagreeing settings are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from osfarm.policy.vllm import vllm_args
from osfarm.trainer.budget import Budget
from osfarm.trainer.config import TrainConfigError, load_train_config
from osfarm.trainer.run_wiring import learner_options, rollout_agent_options


def test_budget_numbers() -> None:
    b = Budget(max_prompt_tokens=100, max_response_tokens=20)
    assert b.overlong(100, 20) is None and b.overlong(None, 20) is None
    assert b.overlong(101, 5) == "prompt of 101 tokens over max_prompt_tokens 100"
    assert b.overlong(5, 21) == "response of 21 tokens over max_response_tokens 20"
    assert Budget().overlong(10**6, 10**6) is None  # no limits by default
    with pytest.raises(ValueError, match="min_pixels"):
        Budget(min_pixels=10, max_pixels=5)


def test_train_yaml_budget_reaches_the_agent_the_learner_and_vllm(tmp_path: Path) -> None:
    f = tmp_path / "train.yaml"
    f.write_text("agent: {kind: vlm, prompt_format: uitars}\n"
                 "budget: {min_pixels: 3136, max_pixels: 1003520, max_prompt_tokens: 7000, max_response_tokens: 900}\n")
    cfg = load_train_config(f)
    agent = rollout_agent_options(cfg.agent, "http://127.0.0.1:1", "policy")
    assert (agent["min_pixels"], agent["max_pixels"], agent["max_tokens"]) == (3136, 1003520, 900)
    assert learner_options(cfg)[0].budget == cfg.budget
    args = vllm_args(cfg.budget.vllm_options())
    assert args[args.index("--mm-processor-kwargs") + 1] == '{"min_pixels": 3136, "max_pixels": 1003520}'
    assert args[args.index("--max-model-len") + 1] == "7900"
    f.write_text("agent: {kind: vlm, max_tokens: 512}\nbudget: {max_response_tokens: 900}\n")
    with pytest.raises(TrainConfigError, match=r"agent.max_tokens \(512\) disagrees with budget.max_response_tokens"):
        load_train_config(f)
