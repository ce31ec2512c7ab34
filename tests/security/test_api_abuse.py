"""Hostile API clients (issue 13, red team): per-client tokens, someone else's lease, quotas, TTLs,
huge bodies, host paths in requests. The farm is the real one (FastAPI app, auth, body limits,
pool, uvicorn on 127.0.0.1) over osfarm/testing/memory_provider.py boxes, so no desktop is needed; every
probe must be refused with a clear status and message, and the farm must keep serving."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from osfarm.client import Farm, LeaseQuotaError, RequestTooLargeError
from osfarm.config import ConfigError, FarmSettings
from osfarm.farm.api import create_app
from osfarm.farm.server import FarmServer
from osfarm.http.principals import token_digest
from osfarm.testing.farms import running_farm
from osfarm.testing.memory_provider import MemoryProvider

ADMIN = "admin-token-0123456789"
ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789"
EVE = "eve-viewer-token-0123456789"
MAX_BODY = 64 * 1024
MAX_UPLOAD = 256 * 1024


@pytest.fixture(scope="module")
def farm() -> Iterator[FarmServer]:
    with tempfile.TemporaryDirectory(prefix="osfsec") as d:
        tokens_file = Path(d) / "tokens.yaml"
        tokens_file.write_text(f"clients:\n  - name: bob\n    role: client\n    sha256: {token_digest(BOB)}\n")
        settings = FarmSettings(
            token=ADMIN, tokens=f"alice:client:{ALICE}:1:600,eve:viewer:sha256:{token_digest(EVE)}",
            tokens_file=tokens_file, state_dir=Path(d) / "state", pool_min=2, pool_max=4, width=1024, height=768,
            lease_ttl_s=120, max_body_bytes=MAX_BODY, max_upload_bytes=MAX_UPLOAD, port=0)
        with running_farm(settings=settings, provider=MemoryProvider(), start_timeout_s=60) as server:
            yield server


def api(farm: FarmServer, token: str) -> httpx.Client:
    return httpx.Client(base_url=farm.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def detail(r: httpx.Response) -> str:
    body = r.json()
    assert isinstance(body.get("detail"), str), body
    return body["detail"]


def still_serving(farm: FarmServer) -> None:
    """The farm answers and hands out and takes back a desktop."""
    with api(farm, ADMIN) as c:
        assert c.get("/healthz").json()["ready"] is True
        r = c.post("/v1/desktops", json={"ttl_s": 30})
        assert r.status_code == 201, r.text
        assert c.delete(f"/v1/desktops/{r.json()['id']}").status_code == 204


@pytest.fixture
def alice_lease(farm: FarmServer) -> Iterator[str]:
    with api(farm, ALICE) as c:
        r = c.post("/v1/desktops", json={"ttl_s": 60})
        assert r.status_code == 201, r.text
        assert r.json()["client"] == "alice"
        yield r.json()["id"]
        c.delete(f"/v1/desktops/{r.json()['id']}")


def test_another_clients_lease_is_a_404_like_an_unknown_id(farm: FarmServer, alice_lease: str) -> None:
    lid = alice_lease
    probes: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", f"/v1/desktops/{lid}", {}),
        ("POST", f"/v1/desktops/{lid}/heartbeat", {"json": {"ttl_s": 30}}),
        ("POST", f"/v1/desktops/{lid}/step", {"json": {"actions": [{"action_type": "WAIT"}]}}),
        ("GET", f"/v1/desktops/{lid}/observation", {}),
        ("GET", f"/v1/desktops/{lid}/screenshot", {}),
        ("GET", f"/v1/desktops/{lid}/guest/v1/health", {}),
        ("POST", f"/v1/desktops/{lid}/evaluate", {"json": {"task": {"id": "t", "instruction": "i",
                                                                     "evaluator": {"func": "infeasible"}}}}),
        ("DELETE", f"/v1/desktops/{lid}", {}),
    ]
    with api(farm, BOB) as bob:
        for method, path, kw in probes:
            r = bob.request(method, path, **kw)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
            unknown = bob.request(method, path.replace(lid, "A" * 24), **kw)
            assert unknown.status_code == 404
            # the same answer as an id that never existed: nothing tells bob the lease is there
            assert detail(r).replace(lid, "A" * 24) == detail(unknown), (detail(r), detail(unknown))
    # Basic auth (OSWorld's controller puts the token in the URL) resolves to bob just the same
    r = httpx.get(f"{farm.url}/v1/desktops/{lid}/guest/v1/health", auth=("osfarm", BOB), timeout=30)
    assert r.status_code == 404, r.text
    r = httpx.get(f"{farm.url}/v1/desktops/{lid}/guest/v1/health", auth=("osfarm", ALICE), timeout=30)
    assert r.status_code == 200, r.text  # the holder's passthrough works
    # bob's DELETE did nothing; alice and the admin still see the lease
    with api(farm, ALICE) as alice, api(farm, ADMIN) as admin:
        assert alice.get(f"/v1/desktops/{lid}").status_code == 200
        assert admin.get(f"/v1/desktops/{lid}").json()["client"] == "alice"
        assert alice.delete(f"/v1/desktops/{lid}").status_code == 204
        assert alice.get(f"/v1/desktops/{lid}").status_code == 410  # its own ended lease: gone
    with api(farm, BOB) as bob:
        assert bob.get(f"/v1/desktops/{lid}").status_code == 404  # someone else's ended lease: still unknown
    still_serving(farm)


@pytest.mark.parametrize("path", ["v1/session/warm_reset", "v1/session/baseline", "v1//session/warm_reset/",
                                  "v1/x/../session/baseline"])
def test_the_guests_farm_only_routes_are_refused_through_the_passthrough(farm: FarmServer, alice_lease: str,
                                                                         path: str) -> None:
    """A warm reset re-arms the guest with the caller's token: through the passthrough a lease
    holder could set the guest's token (cutting the farm off its desktop) or the baseline."""
    with api(farm, ALICE) as alice, api(farm, ADMIN) as admin:
        for c in (alice, admin):
            r = c.post(f"/v1/desktops/{alice_lease}/guest/{path}", json={"token": "x" * 32})
            assert r.status_code == 403, r.text
            assert "farm's own route" in detail(r)
        # the desktop is untouched: its guest still answers the farm
        assert alice.get(f"/v1/desktops/{alice_lease}/guest/v1/health").status_code == 200


def test_pool_shows_lease_ids_to_admins_and_holders_only(farm: FarmServer, alice_lease: str) -> None:
    def ids(token: str) -> set[str]:
        with api(farm, token) as c:
            r = c.get("/v1/pool")
            assert r.status_code == 200, r.text
            return {d["lease_id"] for d in r.json()["desktops"] if d["lease_id"]}

    assert alice_lease in ids(ADMIN)
    assert ids(ALICE) == {alice_lease}
    assert ids(BOB) == set()
    assert ids(EVE) == set()
    with api(farm, ALICE) as c:
        assert c.get("/v1/whoami").json() == {"name": "alice", "role": "client", "max_leases": 1,
                                              "max_ttl_s": 600.0, "leases": 1}


def test_a_viewer_is_read_only(farm: FarmServer, alice_lease: str) -> None:
    with api(farm, EVE) as eve:
        assert eve.get("/v1/pool").status_code == 200
        assert eve.get("/metrics").status_code == 200
        r = eve.post("/v1/desktops", json={})
        assert r.status_code == 403 and "read-only" in detail(r), r.text
        r = eve.get(f"/v1/desktops/{alice_lease}")
        assert r.status_code == 403 and "read-only" in detail(r), r.text


def test_lease_quota_per_client(farm: FarmServer) -> None:
    with api(farm, ALICE) as c:
        first = c.post("/v1/desktops", json={"ttl_s": 60})
        assert first.status_code == 201, first.text
        r = c.post("/v1/desktops", json={"ttl_s": 60, "wait_s": 0})
        assert r.status_code == 429 and "max_leases" in detail(r) and "alice" in detail(r), r.text
        assert r.headers["x-osfarm-quota"] == "max_leases=1" and "retry-after" not in r.headers
        with Farm(farm.url, ALICE) as client, pytest.raises(LeaseQuotaError, match="quota"):
            client.lease(ttl_s=60)
        assert c.delete(f"/v1/desktops/{first.json()['id']}").status_code == 204
        # requests racing each other: the quota counts the ones still waiting too
        got: list[int] = []

        def ask() -> None:
            with api(farm, ALICE) as cc:
                got.append(cc.post("/v1/desktops", json={"ttl_s": 60}).status_code)

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(got) == [201, 429, 429, 429], got
        for d in c.get("/v1/pool").json()["desktops"]:
            if d["lease_id"]:
                c.delete(f"/v1/desktops/{d['lease_id']}")
    with api(farm, BOB) as c:  # no quota of its own: the pool bounds it
        leases = [c.post("/v1/desktops", json={"ttl_s": 60}) for _ in range(2)]
        assert [r.status_code for r in leases] == [201, 201]
        for r in leases:
            c.delete(f"/v1/desktops/{r.json()['id']}")
    still_serving(farm)


def test_ttl_beyond_the_clients_max_is_422(farm: FarmServer) -> None:
    with api(farm, ALICE) as c:
        r = c.post("/v1/desktops", json={"ttl_s": 601})
        assert r.status_code == 422 and "body.ttl_s" in detail(r) and "max_ttl_s" in detail(r), r.text
        r = c.post("/v1/desktops", json={})
        assert r.status_code == 201 and r.json()["ttl_s"] == 120, r.text  # the farm's default, under the max
        lid = r.json()["id"]
        r = c.post(f"/v1/desktops/{lid}/heartbeat", json={"ttl_s": 5000})
        assert r.status_code == 422 and "max_ttl_s" in detail(r), r.text
        assert c.post(f"/v1/desktops/{lid}/heartbeat", json={"ttl_s": 600}).json()["ttl_s"] == 600
        c.delete(f"/v1/desktops/{lid}")


def _raw_request(farm: FarmServer, head: str) -> bytes:
    """Send only a request head (announcing a huge body that never comes) and read the answer."""
    host, port = farm.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def test_huge_bodies_are_413_without_being_read(farm: FarmServer, alice_lease: str) -> None:
    # 100 GB announced: refused from the head alone (the farm never waits for, or stores, the body)
    for path in ("/v1/desktops", f"/v1/desktops/{alice_lease}/step", f"/v1/desktops/{alice_lease}/guest/setup/upload"):
        reply = _raw_request(farm, f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
                                   f"Content-Type: application/json\r\nContent-Length: {100 << 30}\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"limit" in reply and (b"max_body_bytes" in reply or b"max_upload_bytes" in reply), reply
    with api(farm, ALICE) as c:
        # a body without Content-Length (chunked) is cut off at the limit
        def chunks() -> Iterator[bytes]:
            yield b'{"actions": ["'
            for _ in range(64):
                yield b"x" * 16384
            yield b'"]}'

        r = c.post(f"/v1/desktops/{alice_lease}/step", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "max_body_bytes" in detail(r) and "64 KiB" in detail(r), r.text
        # uploads through the guest passthrough have their own, larger limit
        r = c.post(f"/v1/desktops/{alice_lease}/guest/setup/upload", content=b"x" * (MAX_UPLOAD + 1))
        assert r.status_code == 413 and "max_upload_bytes" in detail(r), r.text
        r = c.post(f"/v1/desktops/{alice_lease}/guest/setup/upload", content=b"x" * (MAX_BODY * 2))
        assert r.status_code != 413, r.text  # over the API's limit, under the upload limit: reaches the guest
        with Farm(farm.url, ALICE) as client, pytest.raises(RequestTooLargeError, match="max_body_bytes"):
            client.desktop(alice_lease).step(["x" * MAX_BODY])
        assert c.get(f"/v1/desktops/{alice_lease}").status_code == 200
    still_serving(farm)


def test_unknown_tokens_and_bad_token_sources(farm: FarmServer, tmp_path: Path) -> None:
    for token in ("nope", ALICE + "x", token_digest(ALICE)):  # a digest is not a token
        r = httpx.get(f"{farm.url}/v1/pool", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 401, (token, r.text)
    bad = tmp_path / "tokens.yaml"
    bad.write_text("clients:\n  - name: x\n    role: client\n    sha256: abc\n")
    with pytest.raises(ConfigError, match=rf"{bad}:4: clients.0.sha256"):
        create_app(FarmSettings(token=ADMIN, tokens_file=bad, state_dir=tmp_path))
    bad.write_text("clients:\n  - name: x\n    role: root\n    sha256: " + "0" * 64 + "\n")
    with pytest.raises(ConfigError, match=rf"{bad}:3: clients.0.role"):
        create_app(FarmSettings(token=ADMIN, tokens_file=bad, state_dir=tmp_path))
    with pytest.raises(ConfigError, match="the same token as 'a'"):
        create_app(FarmSettings(token=ADMIN, tokens=f"a:client:{BOB},b:client:{BOB}", state_dir=tmp_path))
    with pytest.raises(ConfigError, match="OSFARM_TOKENS: entry 1 .* role 'boss'"):
        create_app(FarmSettings(token=ADMIN, tokens=f"a:boss:{BOB}", state_dir=tmp_path))


TASK = {"id": "sec-1", "instruction": "i", "evaluator": {"func": "infeasible"}}


@pytest.mark.parametrize(("body", "needle"), [
    ({"task": TASK, "cache_dir": "/etc"}, "body.cache_dir: the farm API takes no host path"),
    ({"task": TASK, "offline": False}, "body.offline"),
    ({"task": TASK, "cache": "/etc"}, "body.cache"),
    ({"task": {**TASK, "id": "../../etc/cron.d"}}, "$.id"),
    ({"task": {**TASK, "id": "a/b"}}, "$.id"),
    ({"task": {**TASK, "config": [{"type": "execute", "parameters": {"command": "id", "stdout": "/etc/cron.d/x"}}]}},
     "$.config[0].parameters.stdout"),
    ({"task": {**TASK, "config": [{"type": "upload_file", "parameters": {"files": [
        {"local_path": "/etc/passwd", "path": "/home/user/p"}]}}]}}, "$.config[0].parameters.files[0].local_path"),
    ({"task": {**TASK, "evaluator": {"func": "exact_match",
                                     "result": {"type": "vm_file", "path": "/a", "dest": "../../x"},
                                     "expected": {"type": "rule", "rules": {"expected": "x"}}}}},
     "$.evaluator.result.dest"),
])
def test_task_routes_take_no_host_path(farm: FarmServer, alice_lease: str, body: dict[str, Any], needle: str) -> None:
    with api(farm, ALICE) as c:
        for route in ("reset", "evaluate"):
            r = c.post(f"/v1/desktops/{alice_lease}/{route}", json=body)
            assert r.status_code == 422 and needle in detail(r), (route, r.text)
    assert not Path("/etc/cron.d/x").exists()
    still_serving(farm)


def test_a_file_url_outside_the_task_cache_is_refused(farm: FarmServer, alice_lease: str) -> None:
    """``file:///etc/passwd`` would upload the host's file into the desktop the agent drives."""
    steps = [{"type": "download", "parameters": {"files": [{"url": "file:///etc/passwd", "path": "/home/user/p"}]}}]
    with api(farm, ALICE) as c:
        r = c.post(f"/v1/desktops/{alice_lease}/reset", json={"task": {**TASK, "config": steps}})
        assert r.status_code == 422 and "file:///etc/passwd" in detail(r) and "outside" in detail(r), r.text
        assert "$.config[0].parameters" in detail(r)
    still_serving(farm)


def test_tokens_cli_keeps_only_digests(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from osfarm.cli import app
    from osfarm.farm.api import farm_tokens

    file = tmp_path / "tokens.yaml"
    r = CliRunner().invoke(app, ["tokens", "add", "carol", "--file", str(file), "--max-leases", "2",
                                 "--max-ttl", "900"])
    assert r.exit_code == 0, r.output
    token = r.stdout.strip().splitlines()[-1]
    assert len(token) >= 40 and token not in file.read_text() and token_digest(token) in file.read_text()
    assert file.stat().st_mode & 0o077 == 0  # 0600
    carol = farm_tokens(FarmSettings(token=ADMIN, tokens_file=file, state_dir=tmp_path)).resolve(token)
    assert carol is not None
    assert (carol.name, carol.role, carol.max_leases, carol.max_ttl_s) == ("carol", "client", 2, 900)
    r = CliRunner().invoke(app, ["tokens", "add", "carol", "--file", str(file)])
    assert r.exit_code == 2 and "exists" in r.output
    r = CliRunner().invoke(app, ["tokens", "hash"], input=token + "\n")
    assert r.stdout.strip() == f"sha256:{token_digest(token)}"
    r = CliRunner().invoke(app, ["tokens", "remove", "carol", "--file", str(file)])
    assert r.exit_code == 0 and "carol" not in file.read_text()


def test_serve_off_loopback_without_tls_warns_and_a_bad_token_file_stops_it(tmp_path: Path) -> None:
    """Runs `osfarm serve` far enough to see both: the warning comes first, then the token file
    (an unknown role) stops it before any desktop or socket exists."""
    import subprocess
    import sys

    bad = tmp_path / "tokens.yaml"
    bad.write_text("clients:\n  - name: x\n    role: root\n    sha256: " + "0" * 64 + "\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OSFARM_")},
           "OSFARM_STATE_DIR": str(tmp_path / "s"), "OSFARM_TOKENS_FILE": str(bad), "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "osfarm.cli", "serve", "--host", "0.0.0.0", "--allow-remote",
                        "--port", "0"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "WITHOUT TLS" in r.stderr and "clear text" in r.stderr, r.stderr
    assert f"{bad}:3: clients.0.role" in r.stderr and "Traceback" not in r.stderr, r.stderr


async def _asgi_status(asgi: Any, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """One request to an ASGI app whose body never comes (receive would block): status and body."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body was read")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asgi({"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""},
               receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_the_guest_server_limits_bodies_too(tmp_path: Path) -> None:
    import asyncio

    from osfarm.desktop.guest.guest import MAX_BODY_BYTES, MAX_UPLOAD_BYTES
    from osfarm.desktop.guest.guest import create_app as guest_app

    app = guest_app("guest-token-0123456789", ":0", home=str(tmp_path), work_dir=str(tmp_path / "w"),
                    warm_code_runner=False)
    auth = (b"authorization", b"Bearer guest-token-0123456789")
    for path, size in (("/setup/execute", MAX_BODY_BYTES + 1), ("/v1/step", MAX_BODY_BYTES + 1),
                       ("/setup/upload", MAX_UPLOAD_BYTES + 1), ("/setup/upload", 100 << 30)):
        status, body = asyncio.run(_asgi_status(app, "POST", path, [auth, (b"content-length", str(size).encode())]))
        assert status == 413 and b"limit" in body, (path, status, body)
    # the token first: a stranger learns nothing, not even the limit
    status, _ = asyncio.run(_asgi_status(app, "POST", "/setup/upload", [(b"content-length", str(100 << 30).encode())]))
    assert status == 401
