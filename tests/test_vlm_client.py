"""The OpenAI-compatible chat client and the VLM agent against the real CPU policy server (tiny
model), with faults injected by a real HTTP proxy in front of it."""

from __future__ import annotations

import io
import math
import random
from collections.abc import Iterator

import httpx
import pytest
from PIL import Image

from osfarm.agents import make_agent
from osfarm.agents.chat_client import (
    ChatClient,
    PolicyRequestRejected,
    PolicyUnavailable,
    backoff_delay,
    read_completion,
    retry_after_s,
    token_ids_from_logprob_tokens,
)
from osfarm.agents.vlm import parse_agent_opts
from osfarm.errors import InfraError
from osfarm.testing.vlm_servers import FaultProxy, closed_port_url, policy_server

FAST = {"backoff_s": 0.05, "backoff_max_s": 0.2}


def _png(w: int = 640, h: int = 400) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (30, 80, 150)).save(buf, "PNG")
    return buf.getvalue()


def _messages() -> list[dict]:
    from osfarm.agents.prompts.messages import image_part

    return [{"role": "user", "content": [{"type": "text", "text": "What is on the screen?"}, image_part(_png())]}]


@pytest.fixture(scope="module")
def policy() -> Iterator[str]:
    with policy_server() as url:
        yield url


# --- pure parts -------------------------------------------------------------------------------

class _Top(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return b


class _Bottom(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return a


def test_backoff_doubles_up_to_the_cap_with_equal_jitter() -> None:
    # d = min(cap, base * 2^(n-1)); the wait is d/2 plus up to d/2 of jitter
    assert [backoff_delay(n, 1.0, 5.0, _Bottom()) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 2.5, 2.5]
    assert [backoff_delay(n, 1.0, 5.0, _Top()) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    rng = random.Random(7)
    assert all(0.25 <= backoff_delay(2, 0.25, 30, rng) <= 0.5 for _ in range(100))


def test_retry_after_and_token_id_parsing() -> None:
    assert retry_after_s("3") == 3.0 and retry_after_s(None) is None
    assert retry_after_s("Wed, 21 Oct 2026 07:28:00 GMT") is None
    assert token_ids_from_logprob_tokens(["token_id:5", "token_id:17"]) == [5, 17]
    assert token_ids_from_logprob_tokens(["token_id:5", "hello"]) is None


def test_a_response_that_is_not_a_completion_is_a_clear_error() -> None:
    from osfarm.agents.chat_client import PolicyBadResponse

    with pytest.raises(PolicyBadResponse, match="choices"):
        read_completion({"id": "x"}, httpx.Headers())


def test_agent_options_are_validated_with_clear_messages() -> None:
    with pytest.raises(ValueError, match="option 'base_url' is required"):
        make_agent("vlm", model="m")
    with pytest.raises(ValueError, match="unknown option 'histroy_turns'"):
        make_agent("vlm", base_url="http://127.0.0.1:1", model="m", histroy_turns=3)
    with pytest.raises(ValueError, match="option 'history_images'"):
        make_agent("vlm", base_url="http://127.0.0.1:1", model="m", history_images=0)
    with pytest.raises(ValueError, match="prompt format 'uitars' shows only screenshot"):
        make_agent("vlm", base_url="http://127.0.0.1:1", model="m", prompt_format="uitars", observation="a11y")
    with pytest.raises(ValueError, match="use --action-space computer_13"):
        make_agent("vlm", base_url="http://127.0.0.1:1", model="m", prompt_format="computer_13",
                   action_space="pyautogui")
    a = make_agent("vlm", base_url="http://127.0.0.1:1", model="m", action_space="computer_13",
                   observation="screenshot_a11y")
    assert a.action_space == "computer_13" and a.format.name == "computer_13" and a.wants_a11y
    assert parse_agent_opts(["history_turns=2", "temperature=0.5", "observation=a11y", "seed=null"]) == {
        "history_turns": 2, "temperature": 0.5, "observation": "a11y", "seed": None}
    with pytest.raises(ValueError, match="expected key=value"):
        parse_agent_opts(["history_turns"])


def test_run_options_pass_vlm_options_and_refuse_them_elsewhere() -> None:
    from pathlib import Path

    from osfarm.runner.run import RunOptions

    o = RunOptions(suite=Path("s"), agent="vlm", out=Path("o"), model_url="http://127.0.0.1:9", model="tiny",
                   prompt_format="computer_13", agent_opts={"history_turns": 1})
    assert o.agent_options() == {"base_url": "http://127.0.0.1:9", "model": "tiny", "prompt_format": "computer_13",
                                 "history_turns": 1}
    make_agent("vlm", **o.agent_options())  # the format fixes the action space; no conflict with the default
    with pytest.raises(ValueError, match="are for the vlm agent"):
        RunOptions(suite=Path("s"), agent="noop", out=Path("o"), model="tiny").agent_options()


# --- against the real policy server ----------------------------------------------------------

async def test_completion_carries_tokens_logprobs_and_version(policy: str) -> None:
    async with ChatClient(policy, "tiny", **FAST) as c:
        r = await c.complete(_messages(), max_tokens=8, temperature=1.0, logprobs=True)
    assert r.attempts == 1 and r.policy_version == 0 and r.finish_reason in ("length", "stop")
    assert r.token_ids and len(r.token_ids) == len(r.logprobs or []) <= 8
    assert all(isinstance(t, int) for t in r.token_ids) and all(lp <= 0.0 for lp in r.logprobs or [])
    assert r.usage and r.usage["completion_tokens"] == len(r.token_ids)
    # the same ids come out of vLLM's "token_id:N" logprob tokens when the extension is absent
    raw = dict(r.raw)
    raw["choices"] = [{k: v for k, v in ch.items() if k != "token_ids"} for ch in raw["choices"]]
    raw.pop("policy_version")
    again = read_completion(raw, httpx.Headers({"X-Policy-Version": "0"}))
    assert again.token_ids == r.token_ids and again.policy_version == 0


async def test_without_logprobs_nothing_is_asked(policy: str) -> None:
    async with ChatClient(policy + "/v1/", "tiny", **FAST) as c:  # a /v1 URL works as well as the root
        assert "logprobs" not in c.payload([], logprobs=False)
        r = await c.complete(_messages(), max_tokens=4, logprobs=False)
    assert r.logprobs is None and r.policy_version == 0


@pytest.mark.parametrize(("fault", "retry_after"), [("503", None), ("502", None), ("429", "0"), ("drop", None)])
async def test_transient_faults_are_retried_then_forwarded(policy: str, fault: str, retry_after: str | None) -> None:
    with FaultProxy(policy, fail_first=2, fault=fault, retry_after=retry_after) as proxy:
        async with ChatClient(proxy.url, "tiny", retries=3, **FAST) as c:
            r = await c.complete(_messages(), max_tokens=4, logprobs=True)
    assert r.attempts == 3 and proxy.requests == 3 and proxy.forwarded == 1
    assert r.token_ids and r.policy_version == 0


async def test_a_4xx_is_not_retried(policy: str) -> None:
    with FaultProxy(policy, fail_first=5, fault="400") as proxy:
        async with ChatClient(proxy.url, "tiny", retries=3, **FAST) as c:
            with pytest.raises(PolicyRequestRejected, match="HTTP 400") as e:
                await c.complete(_messages(), max_tokens=4)
    assert proxy.requests == 1 and not isinstance(e.value, InfraError)


async def test_a_server_that_keeps_failing_is_unavailable_after_the_retries(policy: str) -> None:
    with FaultProxy(policy, fail_first=100, fault="503") as proxy:
        async with ChatClient(proxy.url, "tiny", retries=2, **FAST) as c:
            with pytest.raises(PolicyUnavailable,
                               match=r"policy server unreachable: .*HTTP 503.*after 3 attempts") as e:
                await c.complete(_messages(), max_tokens=4)
    assert proxy.requests == 3 and isinstance(e.value, InfraError)


async def test_a_closed_port_is_unavailable_after_the_retries() -> None:
    async with ChatClient(closed_port_url(), "tiny", retries=2, **FAST) as c:
        with pytest.raises(PolicyUnavailable, match=r"policy server unreachable: .*ConnectError.*after 3 attempts"):
            await c.complete(_messages(), max_tokens=4)


def test_sync_predict_records_the_model_call(policy: str) -> None:
    agent = make_agent("vlm", base_url=policy, model="tiny", prompt_format="uitars", max_tokens=12, max_pixels=200704,
                       history_turns=2, history_images=1, **FAST)
    agent.reset(None)
    obs = {"screenshot": _png(), "accessibility_tree": None, "terminal": None, "instruction": "open the terminal"}
    for step in range(3):
        text, actions = agent.predict("open the terminal", obs)
        call = agent.last_model_call
        assert call is not None and call.response_text == text and call.error is None
        assert call.policy_version == 0 and len(call.response_token_ids) == len(call.response_logprobs) > 0
        if call.parse_error is not None:  # random weights: gibberish, recorded as no action
            assert actions == []
        msgs = call.request
        images = [p for m in msgs if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image_url"]
        assert len(images) == 1 and images[0]["image_url"]["url"].startswith("data:image/png;base64,")
        assert sum(m["role"] == "assistant" for m in msgs) == min(step, 2)


async def test_a11y_observations_reach_the_model_as_a_table(policy: str) -> None:
    from test_vlm_parsers import A11Y

    agent = make_agent("vlm", base_url=policy, model="tiny", action_space="computer_13", observation="screenshot_a11y",
                       max_tokens=8, **FAST)
    agent.reset(None)
    try:
        text, _ = await agent.apredict("save the file", {"screenshot": _png(), "accessibility_tree": A11Y})
    finally:
        await agent.aclose()
    call = agent.last_model_call
    assert call.error is None and call.response_text == text and call.policy_version == 0
    system, user = call.request
    assert "save the file" in system["content"] and '"action_type"' in system["content"]
    kinds = [p["type"] for p in user["content"]]
    assert kinds == ["text", "image_url"] and "push-button\tSave\t" in user["content"][0]["text"]


async def test_top_logprobs_are_recorded_for_top_k_entropy(policy: str) -> None:
    """Entropy selection ranks steps by the policy's top-k entropy, which needs each token's k
    likeliest log-probs in the record: asked for, kept by the client and written by the agent."""
    from osfarm.trainer.selection import logprobs_as_floats, topk_entropy

    agent = make_agent("vlm", base_url=policy, model="tiny", prompt_format="pyautogui", max_tokens=6,
                       temperature=1.0, top_logprobs=4, **FAST)
    agent.reset(None)
    obs = {"screenshot": _png(), "accessibility_tree": None, "terminal": None, "instruction": "open the terminal"}
    await agent.apredict("open the terminal", obs)
    call = agent.last_model_call
    assert call is not None and call.response_logprobs and call.response_token_ids
    assert len(call.response_logprobs) == len(call.response_token_ids)
    assert all(len(t["top_logprobs"]) == 4 for t in call.response_logprobs)
    # the sampled token's log-prob is still there for the learner's behaviour log-probs
    assert all(lp <= 0.0 for lp in logprobs_as_floats(call.response_logprobs))
    h = topk_entropy(call.response_logprobs)
    assert h is not None and 0.0 < h <= math.log(4) + 1e-9
    assert "top_logprobs" not in ChatClient(policy, "tiny").payload([], logprobs=True)


async def test_a_seeded_agent_samples_each_step_with_its_own_seed(policy: str) -> None:
    """The seed makes an episode reproducible; one seed for every step would draw the same random
    numbers at each (the same prompt, the same reply: every step of an episode alike)."""
    async def replies() -> list[str]:
        agent = make_agent("vlm", base_url=policy, model="tiny", max_tokens=6, temperature=1.0, seed=11,
                           history_turns=0, **FAST)
        agent.reset(None)
        obs = {"screenshot": _png(), "accessibility_tree": None, "terminal": None}
        try:
            return [(await agent.apredict("open the terminal", obs))[0] for _ in range(2)]
        finally:
            await agent.aclose()

    first = await replies()
    assert first[0] != first[1]  # the same prompt twice
    assert await replies() == first  # and still reproducible
