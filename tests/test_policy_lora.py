"""vLLM's runtime LoRA adapter API on the CPU policy server: a real `osfarm policy serve
--enable-lora` process with the tiny model, adapters built with PEFT.

An adapter's log-probs are checked against an independent forward pass of base + adapter, merged.
Like vLLM, answers for an adapter carry no policy version. The tests share one server and run in
file order (each leaves the adapters it loaded unloaded, except where it says otherwise).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from test_policy_server import Reference, _chat, _perturbed_copy

from osfarm.policy.tiny import tiny_model_dir
from osfarm.testing.lora_adapters import lora_adapter, misfit_adapter
from osfarm.testing.vlm_servers import policy_server

BASE = "tiny"  # the served name of vlm_servers.policy_server's model
MAX_LORAS = 2


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="module")
def server() -> Iterator[httpx.Client]:
    with (
        policy_server(extra=("--enable-lora", "--max-loras", str(MAX_LORAS))) as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def adapters(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Two different adapters for the tiny model: name -> (adapter dir, merged model dir)."""
    root = tmp_path_factory.mktemp("lora")
    return {name: lora_adapter(tiny_dir, root / name, seed=seed) for name, seed in (("A", 0), ("B", 1))}


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> Reference:
    return Reference(tiny_dir)


@pytest.fixture(scope="module")
def merged_refs(adapters: dict[str, tuple[Path, Path]], tiny_dir: Path) -> dict[str, Reference]:
    return {name: Reference(merged, tiny_dir) for name, (_, merged) in adapters.items()}


def _load(client: httpx.Client, name: str, path: Path | str, **extra) -> httpx.Response:
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


def _unload(client: httpx.Client, name: str) -> httpx.Response:
    return client.post("/v1/unload_lora_adapter", json={"lora_name": name})


def _complete(client: httpx.Client, model: str, **body) -> httpx.Response:
    payload = {"model": model, "messages": _chat(), "max_tokens": 8, "temperature": 0.0, "logprobs": True, **body}
    return client.post("/v1/chat/completions", json=payload)


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _ids_logprobs(body: dict) -> tuple[list[int], torch.Tensor]:
    [choice] = body["choices"]
    return choice["token_ids"], torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])


def _ref_logprobs(ref: Reference, ids: list[int]) -> torch.Tensor:
    return ref.logprobs(_chat(), ids)[torch.arange(len(ids)), torch.tensor(ids)]


def _matches(body: dict, ref: Reference) -> bool:
    ids, got = _ids_logprobs(body)
    return bool(torch.allclose(got, _ref_logprobs(ref, ids), atol=2e-3))


def _refused(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status
    assert "Traceback" not in r.text
    assert "X-Policy-Version" not in r.headers  # the adapter routes never carry a version
    return err["message"]


def _metric(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


# ---- without --enable-lora ------------------------------------------------------------------


def test_without_enable_lora_the_endpoints_refuse(tiny_dir: Path, adapters: dict) -> None:
    from starlette.testclient import TestClient

    from osfarm.policy.engine import PolicyEngine
    from osfarm.policy.server import create_app

    client = TestClient(create_app(PolicyEngine(tiny_dir, served_name=BASE)))
    for r in (_load(client, "pol-v1", adapters["A"][0]), _unload(client, "pol-v1")):
        assert "--enable-lora" in _refused(r, 404, None)
    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == [BASE]


# ---- load, serve, replace, unload -----------------------------------------------------------


def test_adapter_serves_base_plus_adapter_without_a_version(
    server: httpx.Client, adapters: dict, reference: Reference, merged_refs: dict[str, Reference]
) -> None:
    base_before = _ok(_complete(server, BASE))
    loaded_before = _metric(server, 'osfarm_policy_lora_loads_total{result="ok"}')

    r = _load(server, "pol-v1", adapters["A"][0])
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'pol-v1' added successfully."
    assert r.headers["content-type"].startswith("text/plain")
    assert "X-Policy-Version" not in r.headers

    cards = {c["id"]: c for c in _ok(server.get("/v1/models"))["data"]}
    assert set(cards) == {BASE, "pol-v1"}
    assert cards["pol-v1"]["parent"] == BASE and cards["pol-v1"]["root"] == str(adapters["A"][0])
    assert cards["pol-v1"]["policy_version"] is None
    assert cards[BASE]["parent"] is None and isinstance(cards[BASE]["policy_version"], int)

    # the adapter's answer: base + A merged, greedy, and no version anywhere
    resp = _complete(server, "pol-v1")
    body = _ok(resp)
    assert body["model"] == "pol-v1"
    assert "policy_version" not in body and "X-Policy-Version" not in resp.headers
    ids, got = _ids_logprobs(body)
    want = merged_refs["A"].logprobs(_chat(), ids)
    assert torch.allclose(got, want[torch.arange(len(ids)), torch.tensor(ids)], atol=2e-3), (got, want)
    assert want.argmax(dim=-1).tolist() == ids
    assert not torch.allclose(got, _ref_logprobs(reference, ids), atol=1e-2)  # not the base model's

    # the base model is untouched and still reports its version
    resp = _complete(server, BASE)
    base = _ok(resp)
    assert base["model"] == BASE and isinstance(base["policy_version"], int)
    assert resp.headers["X-Policy-Version"] == str(base["policy_version"])
    assert base["choices"][0]["token_ids"] == base_before["choices"][0]["token_ids"]
    assert _matches(base, reference)

    assert _metric(server, "osfarm_policy_lora_adapters") == 1
    assert _metric(server, 'osfarm_policy_lora_loads_total{result="ok"}') == loaded_before + 1


def test_adapter_request_errors_carry_no_version(server: httpx.Client) -> None:
    r = _complete(server, "pol-v1", temperature=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert "X-Policy-Version" not in r.headers
    r = _complete(server, BASE, temperature=-1)
    assert r.status_code == 400 and "X-Policy-Version" in r.headers


def test_same_name_needs_load_inplace_which_swaps_the_weights(
    server: httpx.Client, adapters: dict, merged_refs: dict[str, Reference]
) -> None:
    message = _refused(_load(server, "pol-v1", adapters["B"][0]), 400, "lora_name")
    assert "already been loaded" in message and "load_inplace" in message
    assert _matches(_ok(_complete(server, "pol-v1")), merged_refs["A"])  # still A

    r = _load(server, "pol-v1", adapters["B"][0], load_inplace=True)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'pol-v1' added successfully."
    body = _ok(_complete(server, "pol-v1"))
    assert _matches(body, merged_refs["B"]) and not _matches(body, merged_refs["A"])
    [card] = [c for c in _ok(server.get("/v1/models"))["data"] if c["id"] == "pol-v1"]
    assert card["root"] == str(adapters["B"][0])
    assert _metric(server, "osfarm_policy_lora_adapters") == 1


def test_requests_during_an_inplace_swap_run_on_one_adapter_or_the_other(
    server: httpx.Client, adapters: dict, merged_refs: dict[str, Reference]
) -> None:
    results: list[dict] = []

    def ask() -> None:
        results.append(_ok(_complete(server, "pol-v1", max_tokens=16)))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    assert _load(server, "pol-v1", adapters["A"][0], load_inplace=True).status_code == 200
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 2
    for body in results:  # whole answers from one set of weights, never a mix
        assert "policy_version" not in body
        assert _matches(body, merged_refs["A"]) or _matches(body, merged_refs["B"])
    assert _matches(_ok(_complete(server, "pol-v1")), merged_refs["A"])


def test_unload(server: httpx.Client) -> None:
    r = _unload(server, "pol-v1")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'pol-v1' removed successfully."
    assert "X-Policy-Version" not in r.headers
    assert [c["id"] for c in _ok(server.get("/v1/models"))["data"]] == [BASE]

    gone = _complete(server, "pol-v1")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    assert f"`{BASE}`" in gone.json()["error"]["message"]  # names what is served

    message = _refused(_unload(server, "pol-v1"), 404, "lora_name")
    assert "'pol-v1'" in message and "cannot be found" in message
    assert _metric(server, "osfarm_policy_lora_adapters") == 0


# ---- refusals -------------------------------------------------------------------------------


def test_bad_adapters_are_400_naming_lora_path_and_the_server_goes_on(
    server: httpx.Client, adapters: dict, tmp_path: Path
) -> None:
    refused = _metric(server, 'osfarm_policy_lora_loads_total{result="refused"}')
    failed = _metric(server, 'osfarm_policy_lora_loads_total{result="failed"}')
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("not an adapter")
    misfit = misfit_adapter(adapters["A"][0], tmp_path / "misfit")
    cases = [(tmp_path / "nope", "does not exist"), (tmp_path / "junk", "adapter_config.json"),
             (misfit, "size mismatch")]
    for path, why in cases:
        message = _refused(_load(server, "pol-bad", path), 400, "lora_path")
        assert message.startswith("lora_path") and str(path) in message and why in message, message
    assert _metric(server, 'osfarm_policy_lora_loads_total{result="refused"}') == refused + 2
    assert _metric(server, 'osfarm_policy_lora_loads_total{result="failed"}') == failed + 1

    # nothing was registered, and the server still serves
    assert [c["id"] for c in _ok(server.get("/v1/models"))["data"]] == [BASE]
    assert _complete(server, "pol-bad").status_code == 404
    assert _ok(_complete(server, BASE, max_tokens=2))["choices"]


def test_malformed_load_and_unload_requests(server: httpx.Client, adapters: dict) -> None:
    assert _refused(server.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path")
    assert _refused(_load(server, "", adapters["A"][0]), 400, "lora_name")
    assert _refused(server.post("/v1/unload_lora_adapter", json={}), 400, "lora_name")
    assert "base model" in _refused(_load(server, BASE, adapters["A"][0]), 400, "lora_name")
    # vLLM's other fields are accepted and ignored
    r = _load(server, "pol-x", adapters["A"][0], base_model_name=BASE, lora_int_id=7, whatever={"a": 1})
    assert r.status_code == 200, r.text
    r = server.post("/v1/unload_lora_adapter", json={"lora_name": "pol-x", "lora_int_id": 3})
    assert r.status_code == 200, r.text


def test_max_loras(server: httpx.Client, adapters: dict) -> None:
    a, b = adapters["A"][0], adapters["B"][0]
    assert _load(server, "pol-1", a).status_code == 200
    assert _load(server, "pol-2", b).status_code == 200
    message = _refused(_load(server, "pol-3", a), 400, "lora_name")
    assert f"--max-loras {MAX_LORAS}" in message
    assert _load(server, "pol-2", a, load_inplace=True).status_code == 200  # a replacement is not one more
    assert _unload(server, "pol-1").status_code == 200
    assert _load(server, "pol-3", a).status_code == 200
    assert [c["id"] for c in _ok(server.get("/v1/models"))["data"]] == [BASE, "pol-2", "pol-3"]
    assert _metric(server, "osfarm_policy_lora_adapters") == 2
    for name in ("pol-2", "pol-3"):
        assert _unload(server, name).status_code == 200


# ---- adapters apply to the base the server started with (keep last: it reloads) ---------------


def test_adapters_apply_to_the_base_not_to_a_reloaded_checkpoint(
    server: httpx.Client, adapters: dict, tiny_dir: Path, tmp_path: Path, merged_refs: dict[str, Reference]
) -> None:
    v0 = _ok(server.get("/health"))["policy_version"]
    new_dir = _perturbed_copy(tiny_dir, tmp_path / "v1", scale=0.5, seed=3)
    assert _ok(server.post("/v1/weights/reload", json={"path": str(new_dir), "version": v0 + 1}))["version"] == v0 + 1
    assert _load(server, "pol-v9", adapters["A"][0]).status_code == 200
    assert _matches(_ok(_complete(server, "pol-v9")), merged_refs["A"])  # base + A, not reloaded + A
    base = _ok(_complete(server, BASE))
    assert base["policy_version"] == v0 + 1 and _matches(base, Reference(new_dir, tiny_dir))
    assert _unload(server, "pol-v9").status_code == 200
