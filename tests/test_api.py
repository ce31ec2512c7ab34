"""The farm REST API against a real farm: uvicorn on a loopback port, the real sandbox
provider, real desktops (Xvfb + openbox + apps). All traffic goes to 127.0.0.1."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image, ImageChops

from osfarm.farm.server import FarmServer
from osfarm.providers.sandbox import SANDBOX_ENV
from osfarm.testing.boxes import box_processes
from osfarm.testing.farms import H, W


@pytest.fixture
def lease(api: httpx.Client) -> Iterator[dict[str, Any]]:
    r = api.post("/v1/desktops", json={"owner": "alice", "ttl_s": 120})
    assert r.status_code == 201, r.text
    info = r.json()
    yield info
    api.delete(f"/v1/desktops/{info['id']}")


def png_size(data: bytes) -> tuple[int, int]:
    return Image.open(io.BytesIO(data)).size


def changed_pixels(a: bytes, b: bytes) -> int:
    ia, ib = Image.open(io.BytesIO(a)).convert("RGB"), Image.open(io.BytesIO(b)).convert("RGB")
    diff = ImageChops.difference(ia, ib).convert("L").point(lambda v: 255 if v > 24 else 0)
    return diff.histogram()[255]


def detail(r: httpx.Response) -> str:
    body = r.json()
    assert isinstance(body.get("detail"), str), body
    return body["detail"]


# ---- service routes ---------------------------------------------------------------------------


def test_healthz_needs_no_token(farm: FarmServer) -> None:
    r = httpx.get(farm.url + "/healthz")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["provider"] == "sandbox" and body["ready"] is True


@pytest.mark.parametrize(
    "method,path",
    [("GET", "/v1/pool"), ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"),
     ("POST", "/v1/desktops"), ("POST", "/v1/desktops/x/step"), ("GET", "/v1/desktops/x/observation"),
     ("GET", "/v1/desktops/x/screenshot"), ("POST", "/v1/desktops/x/heartbeat"), ("DELETE", "/v1/desktops/x"),
     ("POST", "/v1/desktops/x/guest/execute"), ("GET", "/no/such/route")],
)  # fmt: skip
def test_every_route_needs_the_token(farm: FarmServer, method: str, path: str) -> None:
    r = httpx.request(method, farm.url + path, json={})
    assert r.status_code == 401
    assert "missing bearer token" in detail(r)
    assert any(v.startswith("Basic") for v in r.headers.get_list("www-authenticate"))
    r = httpx.request(method, farm.url + path, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and detail(r) == "invalid token"
    r = httpx.request(method, farm.url + path, auth=("osfarm", "wrong"))
    assert r.status_code == 401 and detail(r) == "invalid token"


def test_auth_schemes(farm: FarmServer) -> None:
    assert httpx.get(farm.url + "/v1/pool", auth=("anyone", farm.token)).status_code == 200
    r = httpx.get(farm.url + "/v1/pool", headers={"Authorization": "Basic !!notbase64"})
    assert r.status_code == 401 and "malformed" in detail(r)
    r = httpx.get(farm.url + "/v1/pool", headers={"Authorization": f"Token {farm.token}"})
    assert r.status_code == 401 and "unsupported auth scheme" in detail(r)


def test_docs_and_openapi(api: httpx.Client) -> None:
    r = api.get("/docs")
    assert r.status_code == 200 and "swagger" in r.text.lower()
    spec = api.get("/openapi.json").json()
    paths = spec["paths"]
    for p in ("/v1/desktops", "/v1/desktops/{lease_id}/step", "/v1/desktops/{lease_id}/observation",
              "/v1/desktops/{lease_id}/screenshot", "/v1/desktops/{lease_id}/heartbeat", "/v1/desktops/{lease_id}",
              "/v1/desktops/{lease_id}/guest/{path}", "/v1/pool", "/healthz", "/metrics"):  # fmt: skip
        assert p in paths, p
    schemas = spec["components"]["schemas"]
    for name in ("LeaseRequest", "LeaseInfo", "StepRequest", "StepResult", "Observation", "PoolStatus", "ErrorBody"):
        assert name in schemas, name
    # OSWorld task routes (tests/test_task_routes.py exercises them)
    assert "/v1/desktops/{lease_id}/reset" in paths and "/v1/desktops/{lease_id}/evaluate" in paths


def test_pool_status(farm: FarmServer, api: httpx.Client) -> None:
    body = api.get("/v1/pool").json()
    assert body["pool_min"] == farm.settings.pool_min and body["pool_max"] == farm.settings.pool_max
    assert body["counts"]["ready"] + body["counts"]["starting"] + body["counts"]["resetting"] >= 1
    assert all({"id", "state"} <= set(d) for d in body["desktops"])


def test_metrics(api: httpx.Client) -> None:
    r = api.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'osfarm_desktops{state="ready"}' in r.text
    assert "osfarm_step_seconds_count" in r.text


def test_unknown_route_and_method(api: httpx.Client) -> None:
    r = api.get("/v2/nothing")
    assert r.status_code == 404 and "/v2/nothing" in detail(r)
    r = api.put("/v1/pool")
    assert r.status_code == 405 and "PUT" in detail(r)


# ---- the happy path ---------------------------------------------------------------------------


def _step_count(api: httpx.Client) -> float:
    for line in api.get("/metrics").text.splitlines():
        if line.startswith("osfarm_step_seconds_count"):
            return float(line.split()[-1])
    raise AssertionError("no osfarm_step_seconds_count")


def test_lease_step_observe_screenshot_heartbeat_release(api: httpx.Client) -> None:
    r = api.post("/v1/desktops", json={"owner": "bob", "ttl_s": 60})
    assert r.status_code == 201, r.text
    info = r.json()
    lid = info["id"]
    assert info["screen"] == {"width": W, "height": H}
    assert info["guest_url"] == f"/v1/desktops/{lid}/guest"
    assert info["owner"] == "bob" and info["expires_at"] > time.time() + 50
    assert api.get(f"/v1/desktops/{lid}").json()["desktop_id"] == info["desktop_id"]

    before = api.get(f"/v1/desktops/{lid}/screenshot")
    assert before.status_code == 200 and before.headers["content-type"] == "image/png"
    assert png_size(before.content) == (W, H)

    # Open a terminal through the OSWorld passthrough and wait for its window (native route).
    r = api.post(f"/v1/desktops/{lid}/guest/setup/launch", json={"command": ["xfce4-terminal"]})
    assert r.status_code == 200, r.text
    r = api.post(f"/v1/desktops/{lid}/guest/v1/wait_for_window", json={"wm_class": "xfce4-terminal", "timeout": 30})
    assert r.json()["ok"], r.text

    steps_before = _step_count(api)
    # Type into the terminal: the file it writes proves keystrokes and Enter reached the shell.
    r = api.post(f"/v1/desktops/{lid}/step", json={
        "actions": [
            {"action_type": "TYPING", "parameters": {"text": "echo hello from osfarm > ~/typed.txt"}},
            {"action_type": "PRESS", "parameters": {"key": "enter"}},
        ],
        "observe": {"format": "png", "windows": True},
    })  # fmt: skip
    assert r.status_code == 200, r.text
    result = r.json()
    assert [a["ok"] for a in result["results"]] == [True, True]
    assert result["observation"]["screen"] == {"width": W, "height": H}
    assert _step_count(api) == steps_before + 1

    r = api.post(f"/v1/desktops/{lid}/guest/v1/wait_for_file",
                 json={"path": "~/typed.txt", "min_size": 1, "timeout": 20})
    assert r.json()["ok"], r.text
    r = api.post(f"/v1/desktops/{lid}/guest/file", data={"file_path": "~/typed.txt"})
    assert r.status_code == 200 and r.content == b"hello from osfarm\n"

    after = api.get(f"/v1/desktops/{lid}/screenshot", params={"format": "png"}).content
    assert changed_pixels(before.content, after) > 5000  # a terminal window appeared

    obs = api.get(f"/v1/desktops/{lid}/observation", params={"format": "jpeg", "scale": 0.5, "windows": "true"})
    assert obs.status_code == 200, obs.text
    o = obs.json()
    assert o["format"] == "jpeg" and (o["width"], o["height"]) == (W // 2, H // 2)
    assert any("terminal" in w["wm_class"].lower() for w in o["windows"])
    jpeg = api.get(f"/v1/desktops/{lid}/screenshot", params={"format": "jpeg", "scale": 0.25})
    assert jpeg.headers["content-type"] == "image/jpeg" and png_size(jpeg.content) == (W // 4, H // 4)

    r = api.post(f"/v1/desktops/{lid}/heartbeat", json={"ttl_s": 300})
    assert r.status_code == 200 and r.json()["expires_at"] > time.time() + 290
    r = api.post(f"/v1/desktops/{lid}/heartbeat")  # body optional
    assert r.status_code == 200 and r.json()["ttl_s"] == 300

    r = api.delete(f"/v1/desktops/{lid}")
    assert r.status_code == 204 and r.content == b""
    r = api.post(f"/v1/desktops/{lid}/step", json={"actions": ["WAIT"]})
    assert r.status_code == 410 and "released" in detail(r)


def test_lease_without_body_uses_defaults(api: httpx.Client) -> None:
    r = api.post("/v1/desktops")
    assert r.status_code == 201, r.text
    assert r.json()["ttl_s"] == 120 and r.json()["owner"] is None
    assert api.delete(f"/v1/desktops/{r.json()['id']}").status_code == 204


def test_step_code_and_done(api: httpx.Client, lease: dict[str, Any]) -> None:
    lid = lease["id"]
    actions = ["import pyautogui; pyautogui.moveTo(100, 120)", {"action_type": "DONE"}]
    r = api.post(f"/v1/desktops/{lid}/step", json={"actions": actions})
    assert r.status_code == 200, r.text
    assert r.json()["done"] == "DONE"
    o = api.get(f"/v1/desktops/{lid}/observation", params={"screenshot": "false"}).json()
    assert o["cursor"] == [100, 120] and o["screenshot"] is None


# ---- the OSWorld controller through the passthrough ---------------------------------------------


class MiniPythonController:
    """The shape of OSWorld's PythonController: a base URL plus plain HTTP calls.

    The token rides in the URL's userinfo, which httpx (like requests) sends as Basic auth.
    """

    def __init__(self, http_server: str):
        self.http_server = http_server
        self.http = httpx.Client(timeout=90)

    def execute(self, command: list[str] | str, shell: bool = False) -> dict[str, Any]:
        r = self.http.post(self.http_server + "/execute", json={"command": command, "shell": shell})
        r.raise_for_status()
        return r.json()

    def get_screenshot(self) -> bytes | None:
        r = self.http.get(self.http_server + "/screenshot")
        return r.content if r.status_code == 200 else None

    def get_file(self, file_path: str) -> bytes | None:
        r = self.http.post(self.http_server + "/file", data={"file_path": file_path})
        return r.content if r.status_code == 200 else None

    def upload_file(self, file_path: str, data: bytes) -> str:
        r = self.http.post(self.http_server + "/setup/upload", data={"file_path": file_path},
                           files={"file_data": ("blob", data, "application/octet-stream")})  # fmt: skip
        r.raise_for_status()
        return r.text

    def get_platform(self) -> str:
        return self.http.get(self.http_server + "/platform").text


def test_osworld_controller_through_passthrough(farm: FarmServer, lease: dict[str, Any]) -> None:
    base = farm.url.replace("http://", f"http://osfarm:{farm.token}@") + lease["guest_url"]
    ctl = MiniPythonController(base)
    try:
        assert ctl.get_platform() == "Linux"
        out = ctl.execute(["python3", "-c", "import os; print(os.environ['DISPLAY'], os.getcwd())"])
        assert out["returncode"] == 0 and out["output"].startswith(":"), out
        out = ctl.execute("xdpyinfo | grep dimensions", shell=True)
        assert "1024x768 pixels" in out["output"], out
        shot = ctl.get_screenshot()
        assert shot is not None and png_size(shot) == (W, H)
        blob = os.urandom(3 * 1024 * 1024)  # big enough to stream in many chunks both ways
        assert "3145728" in ctl.upload_file("/home/user/Documents/blob.bin", blob)
        got = ctl.get_file("~/Documents/blob.bin")
        assert got is not None and hashlib.sha256(got).digest() == hashlib.sha256(blob).digest()
        assert ctl.get_file("/home/user/nope.txt") is None
        # The guest's own error status and body come back unchanged.
        r = ctl.http.post(base + "/file", data={"file_path": "/home/user/nope.txt"})
        assert r.status_code == 404
        # Query strings survive the passthrough.
        r = ctl.http.get(base + "/v1/screenshot", params={"format": "jpeg", "scale": "0.5"})
        assert r.headers["content-type"] == "image/jpeg" and png_size(r.content) == (W // 2, H // 2)
    finally:
        ctl.http.close()


# ---- bad input: never a 500, always a detail naming the field -------------------------------------

BAD_LEASE_BODIES = [
    (b"{not json", 400, "malformed JSON"),
    (b'{"ttl_s": -1}', 422, "body.ttl_s: Input should be greater than or equal to 1"),
    (b'{"ttl_s": 5e-324}', 422, "body.ttl_s: Input should be greater than or equal to 1"),  # born expired
    (b'{"wait_s": "5"}', 422, "body.wait_s: Input should be a valid number"),  # what the schema says, strictly
    (b'{"ttl_s": "soon"}', 422, "body.ttl_s"),
    (b'{"wait_s": 1e9}', 422, "body.wait_s"),
    (b'{"owner": 5}', 422, "body.owner"),
    (b'{"ttl": 5}', 422, "body.ttl"),
    (b"[1, 2]", 422, "body"),
]


@pytest.mark.parametrize("body,status,needle", BAD_LEASE_BODIES)
def test_bad_lease_request(api: httpx.Client, body: bytes, status: int, needle: str) -> None:
    r = api.post("/v1/desktops", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert needle in detail(r)


BAD_STEPS: list[tuple[Any, int, str]] = [
    (b"{oops", 400, "malformed JSON"),
    ({}, 422, "body.actions: Field required"),
    ({"actions": "CLICK"}, 422, "body.actions"),
    ({"actions": []}, 422, "body.actions"),
    ({"actions": [{"action_type": "TELEPORT"}]}, 422, "actions.0.action_type: unknown action type 'TELEPORT'"),
    ({"actions": [{"parameters": {}}]}, 422, "actions.0.action_type: missing"),
    ({"actions": [{"action_type": "CLICK", "parameters": {"x": 5000, "y": 10}}]}, 422,
     "actions.0.parameters.x: 5000 is off screen"),
    ({"actions": ["WAIT", {"action_type": "MOVE_TO", "parameters": {"x": 1, "y": -3}}]}, 422,
     "actions.1.parameters.y: -3 is off screen"),
    ({"actions": [{"action_type": "MOVE_TO", "parameters": {"x": "left", "y": 1}}]}, 422, "actions.0.parameters.x"),
    ({"actions": [{"action_type": "TYPING"}]}, 422, "actions.0.parameters"),
    ({"actions": [{"action_type": "PRESS", "parameters": {"key": "hyperdrive"}}]}, 422, "actions.0.parameters.key"),
    ({"actions": [{"action_type": "CLICK", "parameters": {"bogus": 1}}]}, 422, "actions.0.parameters.bogus"),
    ({"actions": [42]}, 422, "actions.0: expected a computer_13 object or a code string"),
    ({"actions": ["   "]}, 422, "actions.0: empty code string"),
    ({"actions": ["WAIT"], "observe": {"scale": 5}}, 422, "body.observe.scale"),
    ({"actions": ["WAIT"], "code_timeout": 0}, 422, "body.code_timeout"),
]


@pytest.mark.parametrize("body,status,needle", BAD_STEPS)
def test_bad_step(api: httpx.Client, lease: dict[str, Any], body: Any, status: int, needle: str) -> None:
    url = f"/v1/desktops/{lease['id']}/step"
    r = api.post(url, content=body) if isinstance(body, bytes) else api.post(url, json=body)
    assert r.status_code == status, r.text
    assert needle in detail(r)


def test_bad_query_params(api: httpx.Client, lease: dict[str, Any]) -> None:
    lid = lease["id"]
    for path, params, needle in [
        ("observation", {"scale": "abc"}, "query.scale"),
        ("observation", {"scale": "2"}, "query.scale"),
        ("observation", {"format": "bmp"}, "query.format"),
        ("observation", {"a11y": "maybe"}, "query.a11y"),
        ("observation", {"quality": "0"}, "query.quality"),
        ("screenshot", {"format": "gif"}, "query.format"),
        ("screenshot", {"scale": "0"}, "query.scale"),
        ("screenshot", {"quality": "101"}, "query.quality"),
    ]:
        r = api.get(f"/v1/desktops/{lid}/{path}", params=params)
        assert r.status_code == 422, (path, params, r.text)
        assert needle in detail(r), (path, params, r.text)


def test_bad_heartbeat(api: httpx.Client, lease: dict[str, Any]) -> None:
    url = f"/v1/desktops/{lease['id']}/heartbeat"
    r = api.post(url, json={"ttl_s": 0})
    assert r.status_code == 422 and "body.ttl_s" in detail(r)
    r = api.post(url, content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in detail(r)
    r = api.post(url, json={"ttl_s": 10, "extra": True})
    assert r.status_code == 422 and "body.extra" in detail(r)


def _desktop_calls(lid: str) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        ("GET", f"/v1/desktops/{lid}", {}),
        ("POST", f"/v1/desktops/{lid}/step", {"json": {"actions": ["WAIT"]}}),
        ("GET", f"/v1/desktops/{lid}/observation", {}),
        ("GET", f"/v1/desktops/{lid}/screenshot", {}),
        ("POST", f"/v1/desktops/{lid}/heartbeat", {"json": {}}),
        ("POST", f"/v1/desktops/{lid}/guest/execute", {"json": {"command": ["true"]}}),
        ("GET", f"/v1/desktops/{lid}/guest/screenshot", {}),
        ("DELETE", f"/v1/desktops/{lid}", {}),
    ]


def test_unknown_desktop_is_404_everywhere(api: httpx.Client) -> None:
    for method, path, kw in _desktop_calls("no-such-lease"):
        r = api.request(method, path, **kw)
        assert r.status_code == 404, (method, path, r.text)
        assert "no-such-lease" in detail(r)


def test_foreign_owner_is_403_everywhere(api: httpx.Client, lease: dict[str, Any]) -> None:
    for method, path, kw in _desktop_calls(lease["id"]):
        r = api.request(method, path, headers={"X-Osfarm-Owner": "mallory"}, **kw)
        assert r.status_code == 403, (method, path, r.text)
        assert "another owner" in detail(r)
    # The right owner works, and the foreign DELETE above did not release it.
    r = api.get(f"/v1/desktops/{lease['id']}/observation", headers={"X-Osfarm-Owner": "alice"},
                params={"screenshot": "false"})
    assert r.status_code == 200


def test_released_lease_is_410_everywhere(api: httpx.Client) -> None:
    lid = api.post("/v1/desktops", json={}).json()["id"]
    assert api.delete(f"/v1/desktops/{lid}").status_code == 204
    for method, path, kw in _desktop_calls(lid):
        r = api.request(method, path, **kw)
        assert r.status_code == 410, (method, path, r.text)
        assert "released" in detail(r)


def test_lease_expires_without_heartbeat(api: httpx.Client) -> None:
    lid = api.post("/v1/desktops", json={"ttl_s": 1}).json()["id"]  # the shortest lease (ttl_s >= 1)
    deadline = time.monotonic() + 10
    while (r := api.get(f"/v1/desktops/{lid}")).status_code == 200:
        assert time.monotonic() < deadline, "lease never expired"
        time.sleep(0.05)
    assert r.status_code == 410 and "expired" in detail(r)
    r = api.post(f"/v1/desktops/{lid}/heartbeat")
    assert r.status_code == 410


def test_capacity_429_with_retry_after(farm: FarmServer, api: httpx.Client) -> None:
    ids = []
    try:
        for _ in range(farm.settings.pool_max):
            r = api.post("/v1/desktops", json={"wait_s": 60})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        r = api.post("/v1/desktops", json={"wait_s": 0})
        assert r.status_code == 429, r.text
        assert "leased" in detail(r)
        assert int(r.headers["retry-after"]) >= 1
    finally:
        for lid in ids:
            api.delete(f"/v1/desktops/{lid}")


def test_crashed_guest_is_410_and_replaced(api: httpx.Client, farm: FarmServer) -> None:
    info = api.post("/v1/desktops", json={"wait_s": 60}).json()
    lid = info["id"]
    # The agent cannot kill its desktop's session (it runs as the box's guest, out of the agent's
    # reach: tests/security): the session dies from outside, as when the X server crashes.
    box_dir = f"{farm.settings.state_dir}/sandbox/{info['desktop_id']}"
    xvfb = [p for p in box_processes(Path(farm.settings.state_dir))
            if p.name() == "Xvfb" and p.environ().get(SANDBOX_ENV) == box_dir]
    assert len(xvfb) == 1
    os.kill(xvfb[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    probe = {"command": "true", "shell": True}
    while (r := api.post(f"/v1/desktops/{lid}/guest/execute", json=probe)).status_code == 200:
        assert time.monotonic() < deadline, "the crash was not noticed in 30 s"
        time.sleep(0.2)
    assert r.status_code == 410, r.text
    assert "crashed" in detail(r)
    r = api.post(f"/v1/desktops/{lid}/step", json={"actions": ["WAIT"]})
    assert r.status_code == 410 and "crashed" in detail(r)
    # The pool replaces the desktop: a new lease works.
    r = api.post("/v1/desktops", json={"wait_s": 60})
    assert r.status_code == 201, r.text
    new = r.json()
    assert new["desktop_id"] != info["desktop_id"]
    r = api.post(f"/v1/desktops/{new['id']}/step", json={"actions": ["WAIT"]})
    assert r.status_code == 200, r.text
    api.delete(f"/v1/desktops/{new['id']}")
