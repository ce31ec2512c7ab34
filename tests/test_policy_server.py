"""The CPU policy server, end to end: a real `osfarm policy serve` process with the tiny model.

Log-probs and token ids are checked against an independent forward pass of the same weights;
reloads against perturbed copies of the weights written to disk.
"""

from __future__ import annotations

import base64
import io
import math
import threading
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from osfarm.policy.processing import load_processor
from osfarm.policy.tiny import tiny_model_dir
from osfarm.testing.lora_adapters import lora_adapter
from osfarm.testing.vlm_servers import policy_server
from osfarm.trainer.learner import Learner, encode_sample
from osfarm.trainer.samples import Sample


def _screenshot_url(seed: int = 0) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (1280, 720), (40 + seed, 90, 160))
    draw = ImageDraw.Draw(img)
    draw.rectangle((100, 100, 500, 300), fill=(230, 230, 230))
    draw.text((120, 120), "File  Edit  View", fill=(0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


SCREEN = _screenshot_url()


def _chat(text: str = "Click the Save button.") -> list[dict]:
    return [
        {"role": "system", "content": "You are a GUI agent."},
        {"role": "user",
         "content": [{"type": "image_url", "image_url": {"url": SCREEN}}, {"type": "text", "text": text}]},
    ]


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="module")
def server(tiny_dir: Path):
    """`osfarm policy serve` on a free loopback port (with a small artificial latency)."""
    extra = ("--served-model-name", "tiny", "--delay-ms", "5", "--delay-sigma", "0.5")
    with policy_server(model=str(tiny_dir), extra=extra) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


class Reference:
    """The same weights in this process: log-probs of given tokens by one forward pass."""

    def __init__(self, model_dir: Path, processor_dir: Path | None = None):
        from transformers import Qwen2VLForConditionalGeneration

        self.model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
        self.processor = load_processor(processor_dir or model_dir)

    def logprobs(self, messages: list[dict], token_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        """[T, V] log-probs of the distribution at each generated position (the trainer's path:
        the learner's encode_sample, then one forward pass)."""
        enc = encode_sample(self.processor, messages, token_ids)
        prompt_len = enc.prompt_len
        with torch.no_grad():
            logits = self.model(**enc.inputs).logits[0].float()
        # the token at position p is predicted by the logits at p - 1
        steps = logits[prompt_len - 1 : prompt_len - 1 + len(token_ids)]
        return torch.log_softmax(steps / (temperature if temperature > 0 else 1.0), dim=-1)


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> Reference:
    return Reference(tiny_dir)


def _complete(client: httpx.Client, **body) -> httpx.Response:
    payload = {"model": "tiny", "messages": _chat(), "max_tokens": 12, **body}
    return client.post("/v1/chat/completions", json=payload)


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


# ---- the API surface ------------------------------------------------------------------------


def test_models_health_docs_metrics(server: httpx.Client) -> None:
    models = _ok(server.get("/v1/models"))
    assert models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == "tiny" and card["object"] == "model"
    assert isinstance(card["policy_version"], int) and card["max_model_len"] > 0
    health = _ok(server.get("/health"))
    assert health["status"] == "ok" and health["model"] == "tiny"
    assert server.get("/health").headers["X-Policy-Version"] == str(health["policy_version"])
    assert "/v1/chat/completions" in _ok(server.get("/openapi.json"))["paths"]
    assert server.get("/docs").status_code == 200
    assert "osfarm_policy_version" in server.get("/metrics").text


def test_chat_with_screenshot_returns_openai_shape_with_token_ids(server: httpx.Client) -> None:
    r = _complete(server, logprobs=True, top_logprobs=3, return_tokens_as_token_ids=True, return_token_ids=True, seed=1)
    body = _ok(r)
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert r.headers["X-Policy-Version"] == str(body["policy_version"])
    assert body["logprobs_mode"] == "processed"
    [choice] = body["choices"]
    ids = choice["token_ids"]
    assert 1 <= len(ids) <= 12
    assert choice["finish_reason"] in ("stop", "length")
    assert (choice["finish_reason"] == "length") == (len(ids) == 12 and ids[-1] not in (0, 2))
    assert isinstance(choice["message"]["content"], str) and choice["message"]["role"] == "assistant"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{i}" for i in ids]
    for c in content:
        assert c["logprob"] <= 0.0
        assert len(c["top_logprobs"]) == 3
        tops = [t["logprob"] for t in c["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and c["logprob"] <= tops[0] + 1e-6
        assert all(t["token"].startswith("token_id:") for t in c["top_logprobs"])
    usage = body["usage"]
    assert usage["completion_tokens"] == len(ids)
    # the screenshot became image tokens: 1280x720 -> the tiny processor's pixel budget (hundreds of tokens)
    assert usage["prompt_tokens"] == len(body["prompt_token_ids"]) > 100
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # without return_tokens_as_token_ids the token field is the token's text
    plain = _ok(_complete(server, logprobs=True, seed=1))
    assert plain["choices"][0]["token_ids"] == ids
    assert all(not c["token"].startswith("token_id:") for c in plain["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_logprobs_are_those_of_the_sampling_distribution(
    server: httpx.Client, reference: Reference, temperature: float
) -> None:
    """Returned log-probs == log_softmax(logits / T) of the returned ids, by an independent forward pass
    (T = 1 for greedy: docs/policy.md); and greedy ids are the argmax."""
    body = _ok(_complete(server, temperature=temperature, logprobs=True, seed=7, max_tokens=10))
    [choice] = body["choices"]
    ids = choice["token_ids"]
    got = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    ref = reference.logprobs(_chat(), ids, temperature)
    want = ref[torch.arange(len(ids)), torch.tensor(ids)]
    assert torch.allclose(got, want, atol=2e-3), (got, want)
    if temperature == 0.0:
        assert ref.argmax(dim=-1).tolist() == ids


def test_the_learner_encodes_and_scores_as_the_server(server: httpx.Client, tiny_dir: Path) -> None:
    """The trainer's learner, given the messages of a request (two screenshots, an assistant turn)
    and the server's answer, rebuilds the server's prompt ids exactly and scores the sampled tokens
    with the server's log-probs: the importance weights of a fresh sample are 1."""
    messages = [
        *_chat("Open the File menu."),
        {"role": "assistant", "content": "pyautogui.click(120, 120)"},
        {"role": "user", "content": [{"type": "text", "text": "Now save."},
                                     {"type": "image_url", "image_url": {"url": _screenshot_url(30)}}]},
    ]
    body = _ok(_complete(server, messages=messages, temperature=1.0, logprobs=True, return_token_ids=True,
                         seed=5, max_tokens=8))
    [choice] = body["choices"]
    server_lps = [c["logprob"] for c in choice["logprobs"]["content"]]
    learner = Learner(tiny_dir)
    sample = Sample(messages=messages, response_token_ids=choice["token_ids"], behav_logprobs=server_lps,
                    policy_version=0, advantage=0.0, reward=0.0, task_id="t", group_id="g", episode_id="e",
                    step_index=0)
    enc = learner.encode(sample)
    assert enc.inputs["input_ids"][0, : enc.prompt_len].tolist() == body["prompt_token_ids"]
    assert int(enc.inputs["image_grid_thw"].shape[0]) == 2
    assert torch.allclose(torch.tensor(learner.score(sample)), torch.tensor(server_lps), atol=2e-3)


def test_top_p_samples_inside_the_nucleus(server: httpx.Client, reference: Reference) -> None:
    body = _ok(_complete(server, temperature=1.0, top_p=0.3, logprobs=True, seed=3, max_tokens=8))
    [choice] = body["choices"]
    ids = choice["token_ids"]
    raw = reference.logprobs(_chat(), ids, 1.0)
    for t, tok in enumerate(ids):
        probs = raw[t].exp()
        # mass of the tokens strictly more likely than the sampled one: below top_p if it was in the nucleus
        above = probs[probs > probs[tok]].sum().item()
        assert above < 0.3 + 1e-4
        # renormalised over the nucleus: the reported log-prob is higher than the model's own
        assert choice["logprobs"]["content"][t]["logprob"] > raw[t, tok].item()


def test_n_choices_and_seed_determinism(server: httpx.Client) -> None:
    a = _ok(_complete(server, n=3, seed=11, temperature=1.0))
    b = _ok(_complete(server, n=3, seed=11, temperature=1.0))
    c = _ok(_complete(server, n=3, seed=12, temperature=1.0))
    assert [ch["index"] for ch in a["choices"]] == [0, 1, 2]
    ids_a = [ch["token_ids"] for ch in a["choices"]]
    assert ids_a == [ch["token_ids"] for ch in b["choices"]]
    assert ids_a != [ch["token_ids"] for ch in c["choices"]]
    assert len({tuple(x) for x in ids_a}) > 1  # n samples, not n copies
    assert a["usage"]["completion_tokens"] == sum(len(x) for x in ids_a)
    # greedy: n identical choices
    g = _ok(_complete(server, n=2, temperature=0.0, logprobs=True))
    assert [ch["index"] for ch in g["choices"]] == [0, 1]
    assert g["choices"][0]["token_ids"] == g["choices"][1]["token_ids"]
    assert g["choices"][0]["logprobs"] == g["choices"][1]["logprobs"]


def test_stop_string_cuts_text_and_keeps_generated_ids(server: httpx.Client, reference: Reference) -> None:
    full = _ok(_complete(server, temperature=0.0, max_tokens=12))["choices"][0]
    tok = reference.processor.tokenizer
    ids = full["token_ids"]
    # a stop string: the text the 4th..6th generated tokens add (absent from the text before them)
    prefix = tok.decode(ids[:3], skip_special_tokens=True)
    added = tok.decode(ids[:6], skip_special_tokens=True)[len(prefix) :]
    stop = added.strip() or added
    if not stop or stop in prefix:
        pytest.skip("the greedy output has no distinct stop string to use")
    cut = _ok(_complete(server, temperature=0.0, max_tokens=12, stop=[stop]))["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert stop not in cut["message"]["content"]
    assert full["message"]["content"].startswith(cut["message"]["content"])
    assert cut["token_ids"] == ids[: len(cut["token_ids"])] and len(cut["token_ids"]) <= 6


# ---- bad requests name their field ------------------------------------------------------------


@pytest.mark.parametrize(
    "patch, status, param",
    [
        ({"messages": None}, 400, "messages"),
        ({"messages": []}, 400, "messages"),
        ({"temperature": -1}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"n": 0}, 400, "n"),
        ({"max_tokens": "many"}, 400, "max_tokens"),
        ({"top_logprobs": 50}, 400, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"seed": 2**64}, 400, "seed"),
        ({"model": "gpt-9"}, 404, "model"),
        ({"max_tokens": 30000}, 400, "max_tokens"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400, "messages[0].content"),
        ({"messages": [{"role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         400, "messages[0].content[0].image_url.url"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}]},
         400, "messages[0].content[0].image_url.url"),
    ],
)
def test_bad_requests_are_4xx_naming_the_field(server: httpx.Client, patch: dict, status: int, param: str) -> None:
    payload = {"model": "tiny", "messages": _chat(), "max_tokens": 4, **patch}
    payload = {k: v for k, v in payload.items() if v is not None}
    r = server.post("/v1/chat/completions", json=payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert err["message"].startswith(param)
    assert "Traceback" not in r.text


def test_artificial_delay_is_applied_and_counted(server: httpx.Client) -> None:
    _ok(_complete(server, max_tokens=1))
    metrics = server.get("/metrics").text
    count = [line for line in metrics.splitlines() if line.startswith("osfarm_policy_artificial_delay_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1


# ---- weight reloads (these change the served version: keep them last) -------------------------


def _perturbed_copy(src: Path, dst: Path, scale: float, seed: int, as_state_dict: bool = False) -> Path:
    from safetensors.torch import save_file
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = model.lm_head.weight
        head.add_(torch.randn(head.shape, generator=gen) * scale)
    if as_state_dict:
        dst.mkdir(parents=True)
        path = dst / "weights.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        return path
    model.save_pretrained(dst)  # weights + config only: the server keeps its processor
    return dst


def test_reload_swaps_weights_and_version(
    server: httpx.Client, reference: Reference, tiny_dir: Path, tmp_path: Path
) -> None:
    v0 = _ok(server.get("/health"))["policy_version"]
    before = _ok(_complete(server, temperature=0.0, logprobs=True, max_tokens=6))
    assert before["policy_version"] == v0
    new_dir = _perturbed_copy(tiny_dir, tmp_path / "v1", scale=0.5, seed=1)
    r = server.post("/v1/weights/reload", json={"path": str(new_dir), "version": v0 + 1})
    body = _ok(r)
    assert body["version"] == v0 + 1 and body["previous_version"] == v0
    assert r.headers["X-Policy-Version"] == str(v0 + 1)
    after = _ok(_complete(server, temperature=0.0, logprobs=True, max_tokens=6))
    assert after["policy_version"] == v0 + 1
    lp_before = [c["logprob"] for c in before["choices"][0]["logprobs"]["content"]]
    lp_after = [c["logprob"] for c in after["choices"][0]["logprobs"]["content"]]
    assert before["choices"][0]["token_ids"] != after["choices"][0]["token_ids"] or not all(
        math.isclose(a, b, abs_tol=1e-3) for a, b in zip(lp_before, lp_after, strict=False)
    )
    # the new log-probs are those of the new weights
    new_ref = Reference(new_dir, tiny_dir)
    ids = after["choices"][0]["token_ids"]
    want = new_ref.logprobs(_chat(), ids)[torch.arange(len(ids)), torch.tensor(ids)]
    assert torch.allclose(torch.tensor(lp_after), want, atol=2e-3)
    assert _ok(server.get("/v1/models"))["data"][0]["policy_version"] == v0 + 1

    # a safetensors state dict works too
    sd = _perturbed_copy(tiny_dir, tmp_path / "v2", scale=0.5, seed=2, as_state_dict=True)
    assert _ok(server.post("/v1/weights/reload", json={"path": str(sd), "version": v0 + 1}))["version"] == v0 + 1

    # a PEFT LoRA adapter: applied to the base weights and merged
    lora_dir, merged = lora_adapter(tiny_dir, tmp_path / "lora")
    assert _ok(server.post("/v1/weights/reload", json={"path": str(lora_dir), "version": v0 + 2}))["version"] == v0 + 2
    with_lora = _ok(_complete(server, temperature=0.0, logprobs=True, max_tokens=6))
    ids = with_lora["choices"][0]["token_ids"]
    got = torch.tensor([c["logprob"] for c in with_lora["choices"][0]["logprobs"]["content"]])
    want = Reference(merged, tiny_dir).logprobs(_chat(), ids)[torch.arange(len(ids)), torch.tensor(ids)]
    assert torch.allclose(got, want, atol=2e-3)

    # refused reloads name their field and leave the served weights alone
    stale = server.post("/v1/weights/reload", json={"path": str(new_dir), "version": v0 + 1})
    assert stale.status_code == 409 and stale.json()["error"]["param"] == "version"
    missing = server.post("/v1/weights/reload", json={"path": str(tmp_path / "nope"), "version": v0 + 3})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "path"
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("not weights")
    junk = server.post("/v1/weights/reload", json={"path": str(tmp_path / "junk"), "version": v0 + 3})
    assert junk.status_code == 400 and junk.json()["error"]["param"] == "path"
    bad = server.post("/v1/weights/reload", json={"path": str(new_dir), "version": "latest"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "version"
    assert _ok(server.get("/health"))["policy_version"] == v0 + 2

    # rollback to the original weights (force): greedy output as before
    back = server.post("/v1/weights/reload", json={"path": str(tiny_dir), "version": v0, "force": True})
    assert _ok(back)["version"] == v0
    again = _ok(_complete(server, temperature=0.0, logprobs=True, max_tokens=6))
    assert again["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_requests_during_a_reload_report_the_weights_they_ran_on(
    server: httpx.Client, reference: Reference, tiny_dir: Path, tmp_path: Path
) -> None:
    """Whatever the interleaving, each response's version names the weights that produced its log-probs."""
    v0 = _ok(server.get("/health"))["policy_version"]
    new_dir = _perturbed_copy(tiny_dir, tmp_path / "next", scale=0.5, seed=5)
    results: list[dict] = []

    def ask() -> None:
        results.append(_ok(_complete(server, temperature=0.0, logprobs=True, max_tokens=24)))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    _ok(server.post("/v1/weights/reload", json={"path": str(new_dir), "version": v0 + 1}))
    for t in threads:
        t.join(timeout=300)
    refs = {v0: reference, v0 + 1: Reference(new_dir, tiny_dir)}
    assert len(results) == 3
    for body in results:
        ids = body["choices"][0]["token_ids"]
        got = torch.tensor([c["logprob"] for c in body["choices"][0]["logprobs"]["content"]])
        ref = refs[body["policy_version"]].logprobs(_chat(), ids)
        assert torch.allclose(got, ref[torch.arange(len(ids)), torch.tensor(ids)], atol=2e-3)
