"""The task routes (reset + evaluate) against a real farm: uvicorn on 127.0.0.1, the sandbox
provider, a real 1024x768 desktop with a real terminal."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from osfarm.farm.server import FarmServer

OUT = "/home/user/Desktop/out.txt"


@pytest.fixture(scope="module")
def lid(api: httpx.Client) -> Iterator[str]:
    r = api.post("/v1/desktops", json={"ttl_s": 120})
    assert r.status_code == 201, r.text
    yield r.json()["id"]
    api.delete(f"/v1/desktops/{r.json()['id']}")


def task(config: list[dict[str, Any]], evaluator: dict[str, Any], tid: str = "osfarm-task-routes-1") -> dict[str, Any]:
    return {"id": tid, "snapshot": "os", "instruction": "copy in.txt to out.txt with the terminal",
            "config": config, "evaluator": evaluator}


def detail(r: httpx.Response) -> str:
    body = r.json()
    assert isinstance(body.get("detail"), str), body
    return body["detail"]


def copy_task(local: str) -> dict[str, Any]:
    """``local``: a file of the farm's task cache (``task_cache_dir/<task id>/``): the API takes no host path."""
    return task(
        [{"type": "upload_file", "parameters": {"files": [{"local_path": local, "path": "/home/user/Desktop/in.txt"}]}},
         {"type": "launch", "parameters": {"command": ["xfce4-terminal", "--disable-server"]}},
         {"type": "activate_window", "parameters": {"window_name": "xfce4-terminal", "by_class": True}}],
        {"postconfig": [{"type": "execute", "parameters": {
            "command": f"for i in $(seq 50); do [ -s {OUT} ] && break; sleep 0.1; done; true", "shell": True}}],
         "func": "exact_match",
         "result": {"type": "vm_command_line", "command": f"cat {OUT} 2>/dev/null || printf missing", "shell": True},
         "expected": {"type": "rule", "rules": {"expected": "payload-42\n"}}},
    )


def test_reset_step_evaluate(api: httpx.Client, lid: str, farm: FarmServer) -> None:
    cached = farm.settings.resolved_task_cache_dir() / "osfarm-task-routes-1" / "in.txt"
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text("payload-42\n")
    t = copy_task("in.txt")
    r = api.post(f"/v1/desktops/{lid}/reset", json={"task": t})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["task_id"] == t["id"] and body["t_ms"] > 0
    assert [(s["index"], s["type"], s["ok"]) for s in body["steps"]] == [
        (0, "upload_file", True), (1, "launch", True), (2, "activate_window", True)]
    # Unsolved: the file is not there yet.
    r = api.post(f"/v1/desktops/{lid}/evaluate", json={"task": t})
    assert r.status_code == 200, r.text
    assert r.json()["score"] == 0.0 and r.json()["metrics"] == ["exact_match"]
    # The agent types into the real terminal through the step route.
    cmd = f"cp ~/Desktop/in.txt {OUT}\n"
    r = api.post(f"/v1/desktops/{lid}/step", json={"actions": [f"import pyautogui; pyautogui.typewrite({cmd!r})"]})
    assert r.status_code == 200, r.text
    r = api.post(f"/v1/desktops/{lid}/evaluate", json={"task": t, "last_action": "DONE"})
    assert r.status_code == 200, r.text
    assert r.json()["score"] == 1.0, r.json()
    # A reset gives a fresh desktop: the file the agent made is gone, so the score drops again.
    r = api.post(f"/v1/desktops/{lid}/reset", json={"task": task([], t["evaluator"])})
    assert r.status_code == 200 and r.json()["steps"] == [], r.text
    t0 = time.monotonic()
    r = api.post(f"/v1/desktops/{lid}/evaluate", json={"task": t})
    assert r.status_code == 200 and r.json()["score"] == 0.0, r.text
    assert time.monotonic() - t0 < 30


def test_infeasible_scored_from_last_action(api: httpx.Client, lid: str) -> None:
    t = task([], {"func": "infeasible"}, tid="osfarm-infeasible")
    r = api.post(f"/v1/desktops/{lid}/evaluate", json={"task": t, "last_action": "FAIL"})
    assert r.status_code == 200 and r.json()["score"] == 1.0, r.text
    r = api.post(f"/v1/desktops/{lid}/evaluate", json={"task": t, "last_action": {"action_type": "FAIL"}})
    assert r.status_code == 200 and r.json()["score"] == 1.0, r.text
    r = api.post(f"/v1/desktops/{lid}/evaluate", json={"task": t, "last_action": "DONE"})
    assert r.status_code == 200 and r.json()["score"] == 0.0, r.text


def test_bad_task_json_names_the_path(api: httpx.Client, lid: str) -> None:
    t = task([], {"func": 7})
    r = api.post(f"/v1/desktops/{lid}/reset", json={"task": t})
    assert r.status_code == 422 and "$.evaluator.func" in detail(r), r.text
    bad = task([{"type": "launch", "parameters": "xterm"}], {"func": "infeasible"})
    r = api.post(f"/v1/desktops/{lid}/evaluate", json={"task": bad})
    assert r.status_code == 422 and "$.config[0].parameters" in detail(r), r.text
    r = api.post(f"/v1/desktops/{lid}/reset", json={"task": task([{"type": "googledrive", "parameters": {}}],
                                                                  {"func": "infeasible"})})
    assert r.status_code == 422 and "needs a Google account" in detail(r) and "$.config[0]" in detail(r)
    r = api.post(f"/v1/desktops/{lid}/reset", json={"nope": 1})
    assert r.status_code == 422 and "body.task" in detail(r)


def test_missing_asset_and_failing_step(api: httpx.Client, lid: str) -> None:
    url = "https://osfarm.invalid/task-routes/absent.xlsx"
    t = task([{"type": "download", "parameters": {"files": [{"url": url, "path": "/home/user/absent.xlsx"}]}}],
             {"func": "infeasible"})
    r = api.post(f"/v1/desktops/{lid}/reset", json={"task": t})
    assert r.status_code == 424 and url in detail(r) and "step 0 (download)" in detail(r), r.text
    t = task([{"type": "sleep", "parameters": {"seconds": 0}},
              {"type": "execute", "parameters": {"command": "exit 3", "shell": True,
                                                 "until": {"returncode": 0}}}], {"func": "infeasible"})
    r = api.post(f"/v1/desktops/{lid}/reset", json={"task": t})
    assert r.status_code == 502 and "step 1 (execute)" in detail(r), r.text


def test_getter_crash_is_502(api: httpx.Client, lid: str) -> None:
    t = task([], {"func": "exact_match", "result": {"type": "vm_file", "dest": "x"},  # no path: KeyError
                  "expected": {"type": "rule", "rules": {"expected": "x"}}})
    r = api.post(f"/v1/desktops/{lid}/evaluate", json={"task": t})
    assert r.status_code == 502 and "vm_file" in detail(r), r.text


def test_unknown_lease_is_404(api: httpx.Client) -> None:
    t = task([], {"func": "infeasible"})
    for route in ("reset", "evaluate"):
        r = api.post(f"/v1/desktops/nope-lease/{route}", json={"task": t})
        assert r.status_code == 404 and "nope-lease" in detail(r), r.text
