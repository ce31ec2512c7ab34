"""Streaming (``stream: true``) from a real ``osfarm policy serve --model tiny``, read with the
``openai`` package as agents and frameworks read vLLM: chunks, ``n``, log-probs, usage, token ids,
LoRA adapters, a generation that fails mid-stream and a client that goes away.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from safetensors.torch import load_file, save_file
from test_policy_server import _chat

from osfarm.policy.tiny import tiny_model_dir
from osfarm.testing.lora_adapters import lora_adapter
from osfarm.testing.vlm_servers import policy_server

BASE = "tiny"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with policy_server(extra=("--enable-lora",)) as u:
        yield u


@pytest.fixture(scope="module")
def api(url: str) -> Iterator[Any]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield client
    client.close()


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A working LoRA adapter and a broken one (NaN weights: the output distribution is NaN, so
    sampling fails inside the generation, after the stream has started)."""
    root = tmp_path_factory.mktemp("stream-lora")
    good, _ = lora_adapter(tiny_model_dir(), root / "good", seed=3)
    broken, _ = lora_adapter(tiny_model_dir(), root / "broken", seed=4)
    weights = broken / "adapter_model.safetensors"
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(str(weights)).items()}, str(weights))
    return {"good": good, "broken": broken}


def _metric(http: httpx.Client, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _collect(stream: Any) -> tuple[list[Any], dict[int, dict[str, Any]]]:
    """All chunks, and per choice index: its text, token ids, log-prob entries, finish reasons,
    and the position of each of its chunks."""
    chunks = list(stream)
    per: dict[int, dict[str, Any]] = {}
    for n, ch in enumerate(chunks):
        for c in ch.choices:
            p = per.setdefault(c.index, {"roles": [], "text": "", "pieces": 0, "ids": [], "lps": [], "finish": [],
                                         "positions": []})
            p["positions"].append(n)
            if c.delta.role:
                p["roles"].append((n, c.delta.role))
            if c.delta.content:
                p["text"] += c.delta.content
                p["pieces"] += 1
            p["ids"] += (c.model_extra or {}).get("token_ids") or []
            if c.logprobs is not None and c.logprobs.content:
                p["lps"] += [e.model_dump() for e in c.logprobs.content]
            if c.finish_reason is not None:
                p["finish"].append((n, c.finish_reason))
    return chunks, per


def _check_against(per: dict[int, dict[str, Any]], full: Any) -> None:
    assert sorted(per) == [c.index for c in full.choices]
    for c in full.choices:
        p = per[c.index]
        assert p["roles"] == [(p["positions"][0], "assistant")]  # the role first, once
        assert p["text"] == c.message.content
        assert p["ids"] == c.model_extra["token_ids"]
        assert p["finish"] == [(p["positions"][-1], c.finish_reason)]  # once, on the choice's last chunk
        if c.logprobs is not None:
            assert p["lps"] == [e.model_dump() for e in c.logprobs.content]


def test_stream_n2_logprobs_usage_equals_the_whole_answer(api: Any, http: httpx.Client) -> None:
    """Sampled, n=2, a screenshot, log-probs with top alternatives, usage and token ids: the
    concatenated chunks are the non-streamed answer of the same seed, token for token."""
    args: dict[str, Any] = dict(model=BASE, messages=_chat(), n=2, temperature=1.0, seed=21, max_tokens=40,
                                logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    full = api.chat.completions.create(**args)
    streams_before = _metric(http, "osfarm_policy_streams_total", '{result="completed"}')
    chunks, per = _collect(api.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    _check_against(per, full)
    assert {ch.object for ch in chunks} == {"chat.completion.chunk"}
    assert len({ch.id for ch in chunks}) == 1 and len({ch.created for ch in chunks}) == 1
    assert {ch.model for ch in chunks} == {BASE}
    assert all(ch.model_extra["policy_version"] == full.model_extra["policy_version"] for ch in chunks)
    # the prompt's token ids ride on the first chunks (vLLM's return_token_ids), once per choice
    with_prompt = [ch for ch in chunks if (ch.model_extra or {}).get("prompt_token_ids")]
    assert len(with_prompt) == 2
    assert with_prompt[0].model_extra["prompt_token_ids"] == full.model_extra["prompt_token_ids"]
    # the text came in pieces as it was generated, not in one piece at the end
    assert all(p["pieces"] > 1 for p in per.values())
    for p in per.values():
        for e in p["lps"]:
            assert e["logprob"] <= 0.0 and len(e["top_logprobs"]) == 2
            assert isinstance(e["bytes"], list) and isinstance(e["token"], str)
    # the last chunk: no choices, the whole request's usage (OpenAI's include_usage)
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == full.usage.model_dump()
    assert all(ch.usage is None for ch in body)
    assert _metric(http, "osfarm_policy_streams_total", '{result="completed"}') == streams_before + 1


def test_stream_greedy_with_a_stop_string(api: Any) -> None:
    """Greedy n=2 (one decode, two choices) cut by a stop string: text held back until it cannot be
    the start of the stop string, the stop string never sent."""
    full = api.chat.completions.create(model=BASE, messages=_chat(), temperature=0.0, max_tokens=30)
    text = full.choices[0].message.content
    # a 3-character stop string whose first occurrence is a few tokens in
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3)
                if text[i:i + 3] not in text[:i + 2] and "\ufffd" not in text[i:i + 3])
    args: dict[str, Any] = dict(model=BASE, messages=_chat(), temperature=0.0, max_tokens=30, n=2, stop=[stop],
                                logprobs=True)
    cut = api.chat.completions.create(**args)
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].message.content
    _, per = _collect(api.chat.completions.create(**args, stream=True))
    _check_against(per, cut)


def test_stream_to_the_end_of_sequence_token(api: Any) -> None:
    """A sampled answer that ends on the model's own end-of-sequence token (finish_reason stop):
    that token is the last streamed id, as in the whole answer."""
    for seed in range(40):
        args: dict[str, Any] = dict(model=BASE, messages=[{"role": "user", "content": "hello"}], temperature=1.0,
                                    seed=seed, max_tokens=400)
        full = api.chat.completions.create(**args)
        if full.choices[0].finish_reason == "stop":
            break
    else:
        pytest.fail("no seed in 40 gave an answer ended by the end-of-sequence token")
    _, per = _collect(api.chat.completions.create(**args, stream=True))
    _check_against(per, full)


def test_stream_wire_format(http: httpx.Client) -> None:
    """Server-sent events as vLLM writes them: `data: <json>` + a blank line each, `data: [DONE]`
    last; no log-probs unless asked, no usage chunk unless asked; the version header."""
    body = {"model": BASE, "messages": _chat(), "max_tokens": 6, "temperature": 0.0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        version = r.headers["X-Policy-Version"]
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    first, *rest = chunks
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert rest and all(c["choices"][0]["logprobs"] is None for c in rest)
    assert all("usage" not in c for c in chunks)
    assert all(str(c["policy_version"]) == version for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in rest][-1] == "length"
    assert sum(len(c["choices"][0]["token_ids"]) for c in rest) == 6
    # vLLM's continuous usage: the usage so far in every chunk, then the total
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(e.removeprefix("data: ")) for e in r.read().decode().split("\n\n")[:-2]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 4, 5, 6, 6]
    assert chunks[-1]["choices"] == [] and len({c["usage"]["prompt_tokens"] for c in chunks}) == 1


@pytest.mark.parametrize("body, param", [
    ({"stream": True, "max_tokens": 30000}, "max_tokens"),  # refused before the stream starts: a JSON 400
    ({"stream": True, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_streaming_requests_are_json_400s(http: httpx.Client, body: dict, param: str) -> None:
    r = http.post("/v1/chat/completions", json={"model": BASE, "messages": _chat(), **body})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["error"]["param"] == param


def test_lora_adapter_streams_without_a_version(api: Any, http: httpx.Client, adapters: dict[str, Path]) -> None:
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": str(adapters["good"])})
    assert r.status_code == 200, r.text
    args: dict[str, Any] = dict(model="good", messages=_chat(), temperature=1.0, seed=5, max_tokens=20, n=2,
                                logprobs=True)
    full = api.chat.completions.create(**args)
    base = api.chat.completions.create(**{**args, "model": BASE})
    assert [c.model_extra["token_ids"] for c in full.choices] != [c.model_extra["token_ids"] for c in base.choices]
    chunks, per = _collect(api.chat.completions.create(**args, stream=True))
    _check_against(per, full)
    assert all("policy_version" not in (ch.model_extra or {}) for ch in chunks)
    with http.stream("POST", "/v1/chat/completions", json={**args, "stream": True}) as resp:
        assert resp.status_code == 200 and "X-Policy-Version" not in resp.headers
        resp.read()


def test_an_error_mid_stream_is_an_error_event_and_the_server_goes_on(api: Any, http: httpx.Client,
                                                                      adapters: dict[str, Path]) -> None:
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(adapters["broken"])})
    assert r.status_code == 200, r.text
    errors_before = _metric(http, "osfarm_policy_streams_total", '{result="error"}')
    body = {"model": "broken", "messages": _chat(), "max_tokens": 8, "temperature": 1.0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200  # the failure comes after the status line
        events = resp.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["code"] == 500 and "generation failed" in error["message"] and "Traceback" not in error["message"]
    # the openai client raises it as an APIError
    with pytest.raises(openai.APIError, match="generation failed"):
        list(api.chat.completions.create(model="broken", messages=_chat(), max_tokens=8, temperature=1.0, stream=True))
    assert _metric(http, "osfarm_policy_streams_total", '{result="error"}') == errors_before + 2
    # the server goes on: health, a streamed answer of the base model
    assert http.get("/health").status_code == 200
    _, per = _collect(api.chat.completions.create(model=BASE, messages=_chat(), max_tokens=5, temperature=0.0,
                                                  stream=True))
    assert per[0]["finish"] and len(per[0]["ids"]) == 5
    assert _metric(http, "osfarm_policy_inflight_requests") == 0


def test_a_client_that_goes_away_cancels_the_generation(api: Any, http: httpx.Client) -> None:
    """Greedy decoding of the tiny model never ends before max_tokens: the generation only stops
    early because the client closed the stream after its first token."""
    max_tokens = 6000
    tokens_before = _metric(http, "osfarm_policy_completion_tokens_total")
    gone_before = _metric(http, "osfarm_policy_streams_total", '{result="disconnected"}')
    body = {"model": BASE, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}
    with httpx.Client(base_url=str(http.base_url), timeout=60) as own, \
            own.stream("POST", "/v1/chat/completions", json=body) as resp:
        lines = resp.iter_lines()
        while '"token_ids"' not in next(lines):
            pass
    deadline = time.monotonic() + 120
    while _metric(http, "osfarm_policy_streams_total", '{result="disconnected"}') < gone_before + 1:
        assert time.monotonic() < deadline, "the server never noticed the client went away"
        time.sleep(0.2)
    streamed = _metric(http, "osfarm_policy_completion_tokens_total") - tokens_before
    assert 1 <= streamed < max_tokens
    # the generation thread is free again: a request after it is answered in full
    _, per = _collect(api.chat.completions.create(model=BASE, messages=_chat(), max_tokens=4, temperature=0.0,
                                                  stream=True))
    assert len(per[0]["ids"]) == 4
    assert _metric(http, "osfarm_policy_inflight_requests") == 0
