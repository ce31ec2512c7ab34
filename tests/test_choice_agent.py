"""The trainer's choice agent against a real policy server (``osfarm policy serve --model tiny``):
one sampled token per step picks an action, ``osfarm_choice_steps`` steps per episode, every
call recorded with token ids, log-probs and the policy version; a server that stays down is an
infra error (never the agent's failure)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from osfarm.agents.chat_client import PolicyUnavailable
from osfarm.agents.choice import ChoiceAgent
from osfarm.errors import InfraError
from osfarm.testing.vlm_servers import closed_port_url, policy_server

CHOICES = [f"open('/tmp/x', 'a').write('{c}')" for c in "ABCD"]


def _task(**extra: object) -> SimpleNamespace:
    return SimpleNamespace(model_extra={"osfarm_choices": CHOICES, **extra})


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with policy_server() as url:
        yield url


def test_one_choice_per_step_then_done(server: str) -> None:
    agent = ChoiceAgent(server, "tiny", temperature=1.0, screenshot=False)
    agent.reset(_task(osfarm_choice_steps=3))

    async def episode() -> list[list[str]]:
        out = []
        for _ in range(3):
            _, actions = await agent.apredict("spell CAB", {"screenshot": None})
            call = agent.last_model_call
            assert call is not None and len(call.response_token_ids) == 1 and len(call.response_logprobs) == 1
            assert call.policy_version == 0
            assert actions[0] == CHOICES[call.response_token_ids[0] % 4]
            out.append(actions)
        await agent.aclose()
        return out

    steps = asyncio.run(episode())
    assert [len(a) for a in steps] == [1, 1, 2] and steps[-1][-1] == "DONE"


def test_bad_step_count_is_refused() -> None:
    agent = ChoiceAgent(closed_port_url(), "tiny")
    for bad in (0, "3", True):
        with pytest.raises(ValueError, match="osfarm_choice_steps"):
            agent.reset(_task(osfarm_choice_steps=bad))


def test_server_down_is_an_infra_error() -> None:
    agent = ChoiceAgent(closed_port_url(), "tiny")
    agent.client.retries, agent.client.backoff_s = 1, 0.05
    agent.reset(_task())
    with pytest.raises(PolicyUnavailable) as e:
        asyncio.run(agent.apredict("x", {"screenshot": None}))
    assert isinstance(e.value, InfraError)


def test_the_policy_token_comes_from_the_environment_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's choice agent sends OSFARM_POLICY_TOKEN (a trainer's jobs name no token; compose's
    train-cpu policy server refuses requests without one), as the VLM agent does."""
    monkeypatch.setenv("OSFARM_POLICY_TOKEN", "from-env")
    assert ChoiceAgent(closed_port_url(), "tiny").client.api_key == "from-env"
    assert ChoiceAgent(closed_port_url(), "tiny", api_key="own").client.api_key == "own"
    monkeypatch.delenv("OSFARM_POLICY_TOKEN")
    assert ChoiceAgent(closed_port_url(), "tiny").client.api_key is None


def test_with_history_each_prompt_is_the_last_one_plus_its_reply(server: str) -> None:
    """What an episode trained as one sequence needs (train.yaml's granularity episode gives the
    agent the whole episode as history): step k's request is step k-1's, its reply verbatim, and
    the new observation."""
    agent = ChoiceAgent(server, "tiny", temperature=1.0, screenshot=False, history_turns=3, history_images=3)
    agent.reset(_task(osfarm_choice_steps=3))

    async def episode() -> list[tuple[list[dict[str, object]], str]]:
        out = []
        for _ in range(3):
            text, _ = await agent.apredict("spell CAB", {"screenshot": None})
            assert agent.last_model_call is not None
            out.append((agent.last_model_call.request, text))
        await agent.aclose()
        return out

    calls = asyncio.run(episode())
    for (before, reply), (after, _) in zip(calls, calls[1:], strict=False):
        assert after[:len(before)] == before and after[len(before)] == {"role": "assistant", "content": reply}
        assert len(after) == len(before) + 2 and after[-1]["role"] == "user"
    with pytest.raises(ValueError, match="history_images"):
        ChoiceAgent(server, "tiny", history_images=0)
