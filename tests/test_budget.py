"""One image and length budget per run: train.yaml's ``budget`` reaches the agent's options, the
learner's options, vLLM's command line (``osfarm policy vllm-command --train-config``) and the CPU
policy servers (spawned by the trainer, or ``osfarm policy serve --train-config``), and
disagreeing settings are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from osfarm.policy.vllm import VllmOptions, vllm_args
from osfarm.schema.budget import Budget
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
    args = vllm_args(VllmOptions().with_budget(cfg.budget))
    assert args[args.index("--mm-processor-kwargs") + 1] == '{"min_pixels": 3136, "max_pixels": 1003520}'
    assert args[args.index("--max-model-len") + 1] == "7900"
    f.write_text("agent: {kind: vlm, max_tokens: 512}\nbudget: {max_response_tokens: 900}\n")
    with pytest.raises(TrainConfigError, match=r"agent.max_tokens \(512\) disagrees with budget.max_response_tokens"):
        load_train_config(f)


TRAIN_YAML = ("agent: {kind: vlm, prompt_format: uitars}\n"
              "budget: {min_pixels: 3136, max_pixels: 1003520, max_prompt_tokens: 7000, max_response_tokens: 900}\n")


def test_vllm_command_takes_the_budget_of_train_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import typer

    from osfarm.policy.cli import serve, vllm_command

    f = tmp_path / "train.yaml"
    f.write_text(TRAIN_YAML)
    vllm_command(train_config=f, max_pixels=1003520)  # a flag that repeats the file is fine
    line = capsys.readouterr().out
    assert """--mm-processor-kwargs '{"min_pixels": 3136, "max_pixels": 1003520}'""" in line
    assert "--max-model-len 7900" in line
    for flag, value, source in (("max_pixels", 1 << 20, "budget.max_pixels (1003520)"),
                                ("max_model_len", 8192, "budget.max_prompt_tokens + budget.max_response_tokens "
                                                        "(7900)")):
        with pytest.raises(typer.Exit):
            vllm_command(train_config=f, **{flag: value})
        err = capsys.readouterr().err.replace("\n", "")
        assert f"--{flag.replace('_', '-')} {value} disagrees with {f}'s {source}" in err
    with pytest.raises(typer.Exit):  # the server refuses the same way, before loading anything
        serve(model="tiny", train_config=f, min_pixels=28 * 28)
    assert "--min-pixels 784 disagrees" in capsys.readouterr().err.replace("\n", "")
    f.write_text("budget:\n  max_pixels: -3\n")
    with pytest.raises(typer.Exit):
        vllm_command(train_config=f)
    assert f"{f}:2: budget.max_pixels" in capsys.readouterr().err.replace("\n", "")
    vllm_command()  # no train.yaml: osfarm's defaults
    assert """'{"min_pixels": 78400, "max_pixels": 12845056}'""" in capsys.readouterr().out


def test_a_spawned_cpu_server_resizes_screenshots_as_the_learner(tmp_path: Path) -> None:
    """The trainer's spawned server gets the budget's flags (run_wiring: ServerBudget.serve_args):
    a 1080p screenshot becomes the prompt the learner rebuilds, token for token in number, and
    not the one the model's processor makes on its own."""
    import asyncio
    import base64
    import io

    import httpx
    from PIL import Image

    from osfarm.policy.process import PolicyProcess
    from osfarm.policy.run_budget import ServerBudget
    from osfarm.policy.tiny import tiny_model_dir
    from osfarm.trainer.learner import Learner, LearnerOptions
    from osfarm.trainer.samples import Sample

    buf = io.BytesIO()
    Image.new("RGB", (1920, 1080), (30, 90, 200)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Click the button."},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    budget = Budget(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    server = PolicyProcess(tiny_model_dir(), 0, "policy", tmp_path / "policy.log",
                           extra_args=ServerBudget.of(budget).serve_args())
    try:
        asyncio.run(server.wait_ready(240))
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                       json={"model": "policy", "messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        served = r.json()["usage"]["prompt_tokens"]
    finally:
        server.stop()
    sample = Sample(messages=messages, response_token_ids=[101], behav_logprobs=None, policy_version=0,
                    advantage=0.0, reward=0.0, task_id="t", group_id="t", episode_id="e", step_index=1)
    learner = Learner(tiny_model_dir(), LearnerOptions(budget=budget)).encode(sample).prompt_len
    unbudgeted = Learner(tiny_model_dir(), LearnerOptions()).encode(sample).prompt_len
    assert served == learner < unbudgeted
