"""The APIs do what their OpenAPI documents say: schemathesis (``--checks all``: every status
documented, response bodies and headers as declared, schema-valid requests accepted, invalid ones
refused, 405 with the right ``Allow``, ...) against the farm, the policy server and a desktop's
guest server, with bounded examples and a fixed seed; 0 failures. Plus what the fuzzer may not hit
on its own: the bounds in the schema, malformed JSON, 405 + Allow, guest sessions of ended leases.

The farm here is a real farm process over osfarm/testing/memory_provider.py boxes (the API, auth, pool,
leases, registry, guest links are all real; only the boxes are small in-process servers), so the
fuzzer's hundreds of leases cost nothing. Settings per API: tests/contract/*.toml.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from osfarm.config import FarmSettings
from osfarm.farm.server import FarmServer
from osfarm.testing.farm_process import FarmProcess
from osfarm.testing.farms import running_farm
from osfarm.testing.memory_provider import MemoryProvider

ROOT = Path(__file__).resolve().parents[1]
SCHEMATHESIS = Path(os.environ.get("VIRTUAL_ENV") or ROOT / ".venv") / "bin" / "schemathesis"
CONTRACT = Path(__file__).resolve().parent / "contract"
SEED = os.environ.get("OSFARM_CONTRACT_SEED", "1")


def schemathesis(schema_url: str, config: Path | None, *extra: str, examples: int = 15, timeout: float = 600,
                 env: dict[str, str] | None = None) -> str:
    """Run ``schemathesis run`` and return its report; a failure of any check fails the test."""
    if not SCHEMATHESIS.exists():
        pytest.fail(f"schemathesis is not installed ({SCHEMATHESIS}): pip install -e '.[dev]'")
    cmd = [str(SCHEMATHESIS)]
    if config is not None:
        cmd += ["--config-file", str(config)]
    cmd += ["run", schema_url, "--checks", "all", "--max-examples", str(examples), "--seed", SEED, "--no-color",
            *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, **(env or {})})
    report = r.stdout + r.stderr
    assert r.returncode == 0, report[-12000:]
    assert " passed" in report and "failures" not in report.split("Test cases:")[-1], report[-4000:]
    return report


# -- the farm -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def memory_farm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FarmProcess]:
    with running_farm(process=True, provider="memory", state_dir=tmp_path_factory.mktemp("contract-farm"),
                      pool_min=4, pool_max=60) as farm:
        yield farm


@pytest.mark.timeout(600)
def test_the_farm_does_what_its_openapi_says(memory_farm: FarmProcess) -> None:
    report = schemathesis(f"{memory_farm.url}/openapi.json", CONTRACT / "farm.toml",
                          "-H", f"Authorization: Bearer {memory_farm.token}", examples=10)
    print(report[-1500:])


@pytest.mark.timeout(300)
def test_a_lease_takes_what_its_openapi_says(memory_farm: FarmProcess) -> None:
    """schemathesis' default checks and settings (tests/contract/farm-lease.toml adds only what no
    JSON Schema can state) on the routes that take a body of actions or a task, all on one held
    lease: every schema-valid step, reset and evaluation is taken, every other one refused, so the
    documented request schemas and what the server checks cannot drift apart."""
    with memory_farm.client() as c:
        lid = c.post("/v1/desktops", json={"wait_s": 30, "ttl_s": 3600}).json()["id"]
        try:
            report = schemathesis(f"{memory_farm.url}/openapi.json", CONTRACT / "farm-lease.toml",
                                  "-H", f"Authorization: Bearer {memory_farm.token}",
                                  "--include-path-regex", "^/v1/desktops/[^/]+/(step|reset|evaluate)$",
                                  "--phases", "examples,coverage,fuzzing", examples=25, timeout=240,
                                  env={"OSFARM_CONTRACT_LEASE": lid})
            print(report[-1000:])
            assert "3 selected" in report, report[:2000]
        finally:
            c.delete(f"/v1/desktops/{lid}")


def test_the_farm_schema_has_its_bounds_and_every_error(memory_farm: FarmProcess) -> None:
    with memory_farm.client() as c:
        schema = c.get("/openapi.json").json()
        lease = schema["components"]["schemas"]["LeaseRequest"]["properties"]
        ttl = next(s for s in lease["ttl_s"]["anyOf"] if s.get("type") == "number")
        assert ttl["minimum"] == 1 and ttl["maximum"] == 86400
        post = schema["paths"]["/v1/desktops"]["post"]["responses"]
        assert {"201", "400", "401", "413", "422", "429", "503"} <= set(post)
        step = schema["paths"]["/v1/desktops/{lease_id}/step"]["post"]["responses"]
        assert {"200", "400", "401", "403", "404", "410", "413", "422", "502", "504"} <= set(step)
        assert "401" not in schema["paths"]["/healthz"]["get"]["responses"]  # public
        links = schema["paths"]["/v1/desktops"]["post"]["responses"]["201"]["links"]
        assert links and all(v["parameters"] == {"lease_id": "$response.body#/id"} for v in links.values())
        # the bounds hold on the wire
        for body in ({"ttl_s": 5e-324}, {"ttl_s": 0.5}, {"ttl_s": 86401}, {"wait_s": "1"}, {"ttl_s": True}):
            r = c.post("/v1/desktops", json=body)
            assert r.status_code == 422 and "body." in r.json()["detail"], (body, r.text)
        r = c.post("/v1/desktops", content=b"{nope", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "malformed JSON" in r.json()["detail"]
        # 405 names every method of the path, not those of the first route that matched
        lid = c.post("/v1/desktops", json={"wait_s": 10}).json()["id"]
        r = c.request("PUT", f"/v1/desktops/{lid}")
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers
        r = c.request("PATCH", "/v1/desktops")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert c.delete(f"/v1/desktops/{lid}").status_code == 204


async def test_the_farm_drops_the_guest_connections_of_leases_that_ended(tmp_path: Path) -> None:
    settings = FarmSettings(port=0, token="contract-token", state_dir=tmp_path, pool_min=2, pool_max=4,
                            health_interval_s=0.2, lease_ttl_s=60)
    server = FarmServer(settings, MemoryProvider())
    await asyncio.to_thread(server.start, 60)
    try:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": "Bearer contract-token"},
                                     timeout=30) as c:
            ids = []
            for _ in range(3):
                lid = (await c.post("/v1/desktops", json={"ttl_s": 1})).json()["id"]
                assert (await c.get(f"/v1/desktops/{lid}/observation")).status_code == 200
                ids.append(lid)
            assert len(server.state._guests) == 3  # one pooled connection pair per leased desktop
            # the leases expire (no heartbeat): their connections go with them
            deadline = time.monotonic() + 15
            while server.state._guests and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert server.state._guests == {}
            assert [(await c.get(f"/v1/desktops/{lid}")).status_code for lid in ids] == [410, 410, 410]
    finally:
        await asyncio.to_thread(server.stop)


# -- the policy server -----------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_the_policy_server_does_what_its_openapi_says() -> None:
    pytest.importorskip("transformers")
    from osfarm.policy.process import PolicyProcess
    from osfarm.policy.tiny import tiny_model_dir

    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"contract-policy-{os.getpid()}.log"
    # a short context keeps CPU generations short; longer requests are refused (400, documented)
    server = PolicyProcess(tiny_model_dir(), 0, "policy", log, extra_args=["--max-model-len", "40"])
    try:
        asyncio.run(server.wait_ready(240))
        report = schemathesis(f"{server.url}/openapi.json", CONTRACT / "policy.toml", examples=5)
        print(report[-800:])
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.request("PUT", "/v1/chat/completions")
            assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == 405
            r = c.post("/v1/chat/completions", content=b"\xff\xfe", headers={"content-type": "application/json"})
            assert r.status_code == 400 and "error" in r.json()
            schema = c.get("/openapi.json").json()
            chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
            assert {"200", "400", "401", "404", "500"} <= set(chat)
    finally:
        server.stop()
        log.unlink(missing_ok=True)


# -- a desktop's guest server ---------------------------------------------------------------------

# Routes that wait by design for as long as the request allows (a window, a file, a verification:
# up to 600-3600 s): a fuzzer's boundary values would hold the run for hours. test_guest.py and
# test_task_routes.py cover them.
WAITING_ROUTES = "^/(v1/wait_for_|setup/open_file|setup/execute_with_verification|execute_with_verification)"


@pytest.mark.timeout(600)
def test_the_guest_server_does_what_its_openapi_says(farm: FarmServer) -> None:
    """Through the farm's passthrough, on a real sandbox desktop."""
    with httpx.Client(base_url=farm.url, headers={"Authorization": f"Bearer {farm.token}"}, timeout=120) as c:
        lid = c.post("/v1/desktops", json={"wait_s": 120, "ttl_s": 900}).json()["id"]
        try:
            base = f"{farm.url}/v1/desktops/{lid}/guest"
            report = schemathesis(f"{base}/v1/openapi.json", CONTRACT / "guest.toml", "--url", base,
                                  "--exclude-path-regex", WAITING_ROUTES, "-H", f"Authorization: Bearer {farm.token}",
                                  examples=4)
            print(report[-800:])
            r = c.put(f"/v1/desktops/{lid}/guest/screenshot")
            assert r.status_code == 405 and r.headers["allow"] == "GET", r.headers  # through the passthrough
            schema = c.get(f"/v1/desktops/{lid}/guest/v1/openapi.json").json()
            execute = schema["paths"]["/execute"]["post"]
            assert execute["requestBody"]["content"]["application/json"]["schema"]["required"] == ["command"]
            assert {"200", "400", "401", "413"} <= set(execute["responses"])
            assert "image/png" in schema["paths"]["/screenshot"]["get"]["responses"]["200"]["content"]
        finally:
            c.delete(f"/v1/desktops/{lid}")
