"""``osfarm.osworld.DesktopEnv``, OSWorld's DesktopEnv on the farm, driven only through OSWorld's API.

The loop below does what OSWorld's ``lib_run_single.run_single_example`` does (written from its
documented behaviour: reset with the task config, a wait, the agent's ``predict`` -> ``env.step``
for each action with ``sleep_after_execution``, a screenshot per step ``step_N_<timestamp>.png``,
a ``traj.jsonl`` line per step, ``evaluate``, ``result.txt``, ``recording.mp4`` from
``end_recording``), with a scripted agent, on real OSWorld task files from
../shared/osworld/examples that our offline desktops host (their setups need no download). The
results land in OSWorld's layout, ``<action_space>/<observation_type>/<model>/<domain>/<id>/``;
a solving script scores 1, one that does nothing 0. The shared farm's desktops serve it.
"""

from __future__ import annotations

import datetime
import http.client
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from osfarm.client import guest_route
from osfarm.farm.server import FarmServer
from osfarm.osworld import DesktopEnv

EXAMPLES = Path(__file__).resolve().parents[2] / "shared" / "osworld" / "examples"
# "rename the directory todo_list_Jan_1 to todo_list_Jan_2": setup makes it with sudo, the
# score is a vm_command_line check
RENAME = EXAMPLES / "os" / "e0df059f-28a6-4169-924f-b9623e7184cc.json"
# "switch on the Bluetooth": infeasible, FAIL is the right answer
BLUETOOTH = EXAMPLES / "os" / "b3d4a89c-53f2-4d6b-8b6a-541fb5d205fa.json"

RENAME_CODE = ("import os; d = os.path.expanduser('~/Desktop'); "
               "os.rename(os.path.join(d, 'todo_list_Jan_1'), os.path.join(d, 'todo_list_Jan_2'))")
# per task id: the actions of each predict call
SOLVE = {RENAME.stem: [["pyautogui.moveTo(10, 10)", "WAIT"], [RENAME_CODE], ["DONE"]], BLUETOOTH.stem: [["FAIL"]]}
NOOP = {RENAME.stem: [["DONE"]], BLUETOOTH.stem: [["DONE"]]}

pytestmark = pytest.mark.skipif(not EXAMPLES.is_dir(), reason=f"OSWorld's task files are not in {EXAMPLES}")


class ScriptedAgent:
    """OSWorld's agent contract: ``reset(logger, vm_ip=...)``, ``predict(instruction, obs)`` ->
    ``(response, actions)``. Like OSWorld's agents, it reaches the guest at ``vm_ip:5000``."""

    def __init__(self, name: str, scripts: dict[str, list[list[str]]]):
        self.name, self.scripts = name, scripts
        self.task_id, self.turn, self.vm_ip = "", 0, ""
        self.guest_answers: list[tuple[str, int, bytes]] = []

    def reset(self, _logger: logging.Logger | None = None, vm_ip: str = "", task_id: str = "") -> None:
        self.vm_ip, self.task_id, self.turn = vm_ip, task_id, 0

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[str]]:
        assert obs["instruction"] == instruction and obs["screenshot"][:8] == b"\x89PNG\r\n\x1a\n"
        if self.turn == 0:  # what an agent asks the guest itself, at OSWorld's address
            r = httpx.get(f"http://{self.vm_ip}:5000/screenshot", timeout=60)
            self.guest_answers.append(("screenshot", r.status_code, r.content[:8]))
            r = httpx.post(f"http://{self.vm_ip}:5000/execute", json={"command": "ls ~/Desktop", "shell": True},
                           timeout=60)
            self.guest_answers.append(("execute", r.status_code, r.content))
        script = self.scripts[self.task_id]
        actions = script[min(self.turn, len(script) - 1)]
        self.turn += 1
        return f"turn {self.turn}", actions


def run_single_example(agent: ScriptedAgent, env: DesktopEnv, example: dict[str, Any], max_steps: int,
                       instruction: str, args: SimpleNamespace, example_result_dir: Path, scores: list[float]) -> None:
    """One task as OSWorld's runner runs it (its order of calls and its files)."""
    agent.reset(vm_ip=env.vm_ip, task_id=example["id"])
    obs = env.reset(task_config=example)
    assert obs["instruction"] == instruction
    time.sleep(args.wait_after_reset_s)  # OSWorld's is 60 s, for its VM to settle; a farm desktop is ready
    obs = env._get_obs()
    done, step_idx = False, 0
    env.controller.start_recording()
    while not done and step_idx < max_steps:
        response, actions = agent.predict(instruction, obs)
        for action in actions:
            stamp = datetime.datetime.now().strftime("%Y%m%d@%H%M%S%f")
            obs, reward, done, info = env.step(action, args.sleep_after_execution)
            shot = f"step_{step_idx + 1}_{stamp}.png"
            (example_result_dir / shot).write_bytes(obs["screenshot"])
            with open(example_result_dir / "traj.jsonl", "a") as f:
                f.write(json.dumps({"step_num": step_idx + 1, "action_timestamp": stamp, "action": action,
                                    "response": response, "reward": reward, "done": done, "info": info,
                                    "screenshot_file": shot}) + "\n")
            if done:
                break
        step_idx += 1
    result = env.evaluate()
    scores.append(result)
    (example_result_dir / "result.txt").write_text(f"{result}\n")
    env.controller.end_recording(str(example_result_dir / "recording.mp4"))


@pytest.fixture
def farm_env(farm: FarmServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[DesktopEnv]:
    """The drop-in as OSWorld's run.py makes it; the farm comes from OSFARM_URL / OSFARM_TOKEN."""
    monkeypatch.setenv("OSFARM_URL", farm.url)
    monkeypatch.setenv("OSFARM_TOKEN", farm.token)
    env = DesktopEnv(provider_name="docker", path_to_vm=None, action_space="pyautogui", screen_size=(1920, 1080),
                     headless=True, os_type="Ubuntu", require_a11y_tree=False, cache_dir=str(tmp_path / "cache"),
                     offline=True)
    try:
        yield env
    finally:
        env.close()


@pytest.mark.acceptance
@pytest.mark.timeout(600)
def test_osworld_runner_loop_writes_osworlds_results(farm_env: DesktopEnv, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    env = farm_env
    args = SimpleNamespace(action_space="pyautogui", observation_type="screenshot", max_steps=5,
                           sleep_after_execution=0.5, wait_after_reset_s=0, result_dir=tmp_path / "results")
    examples = [json.loads(p.read_text()) for p in (RENAME, BLUETOOTH)]
    scores: dict[str, list[float]] = {}
    for agent in (ScriptedAgent("scripted-solve", SOLVE), ScriptedAgent("scripted-noop", NOOP)):
        scores[agent.name] = []
        for example in examples:
            domain = example["snapshot"]
            out = args.result_dir / args.action_space / args.observation_type / agent.name / domain / example["id"]
            out.mkdir(parents=True)
            run_single_example(agent, env, example, args.max_steps, example["instruction"], args, out,
                               scores[agent.name])
        # the agent reached the guest at vm_ip:5000, on the desktop its task was set up on
        assert [(what, status) for what, status, _ in agent.guest_answers] == [
            ("screenshot", 200), ("execute", 200)] * 2, agent.guest_answers
        assert agent.guest_answers[0][2] == b"\x89PNG\r\n\x1a\n"
        assert "todo_list_Jan_1" in json.loads(agent.guest_answers[1][2])["output"]
    assert scores == {"scripted-solve": [1.0, 1.0], "scripted-noop": [0.0, 0.0]}
    assert env.action_history == ["DONE"] and env.instruction == examples[1]["instruction"]
    with pytest.raises(ValueError, match="^action: action_space 'pyautogui' takes pyautogui code"):
        env.step({"action_type": "CLICK", "parameters": {"x": 1, "y": 1}})  # a computer_13 action
    assert any("screen_size" in r.getMessage() for r in caplog.records)  # 1920x1080 asked, the farm's is not
    assert env.controller.get_vm_screen_size() == {"width": env.screen_size[0], "height": env.screen_size[1]}
    assert env.provider == "sandbox"  # what the farm gave, whatever provider_name said

    # OSWorld's layout, file by file
    solved = args.result_dir / "pyautogui" / "screenshot" / "scripted-solve" / "os" / RENAME.stem
    assert (solved / "result.txt").read_text() == "1.0\n"
    lines = [json.loads(line) for line in (solved / "traj.jsonl").read_text().splitlines()]
    assert [(x["step_num"], x["action"], x["done"]) for x in lines] == [
        (1, "pyautogui.moveTo(10, 10)", False), (1, "WAIT", False), (2, RENAME_CODE, False), (3, "DONE", True)]
    assert lines[-1]["info"] == {"done": True} and all(x["reward"] == 0 for x in lines)
    for x in lines:
        assert x["screenshot_file"].startswith(f"step_{x['step_num']}_")
        assert (solved / x["screenshot_file"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (solved / "recording.mp4").stat().st_size > 0
    infeasible = args.result_dir / "pyautogui" / "screenshot" / "scripted-solve" / "os" / BLUETOOTH.stem
    assert [json.loads(x)["info"] for x in (infeasible / "traj.jsonl").read_text().splitlines()] == [{"fail": True}]
    for task in (RENAME, BLUETOOTH):
        noop = args.result_dir / "pyautogui" / "screenshot" / "scripted-noop" / "os" / task.stem
        assert (noop / "result.txt").read_text() == "0.0\n"
        assert sorted(p.suffix for p in noop.iterdir()) == [".jsonl", ".mp4", ".png", ".txt"]

    # a path the agent chooses stays on the lease's guest routes: resolved, ../.. would reach the
    # farm's own API with the env's token (http.client sends the path as written, as curl --path-as-is)
    conn = http.client.HTTPConnection(env.vm_ip, env.server_port, timeout=30)
    try:
        conn.request("GET", "/../../../../v1/pool")
        r = conn.getresponse()
        assert (r.status, b"segment" in r.read()) == (400, True)
    finally:
        conn.close()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"action_space": "som"}, "action_space"),
    ({"provider_name": "hyperv"}, "provider_name"),
    ({"os_type": "Windows"}, "os_type"),
    ({"screen_size": (0, 1080)}, "screen_size"),
])
def test_what_osfarm_cannot_do_is_refused_naming_the_argument(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        DesktopEnv(**kwargs, farm_url="http://127.0.0.1:9", farm_token="unused")


def test_before_reset_the_guest_address_answers_503_and_step_is_refused() -> None:
    env = DesktopEnv(action_space="computer_13", farm_url="http://127.0.0.1:9", farm_token="unused")  # never dialled
    try:
        assert env.vm_ip.startswith("127.") and env.server_port == 5000
        r = httpx.get(f"http://{env.vm_ip}:{env.server_port}/screenshot", timeout=30)
        assert r.status_code == 503 and "reset" in r.json()["detail"]
        # the agent's code decides what it posts here: a body past the guest's own cap is never buffered
        big = httpx.post(f"http://{env.vm_ip}:{env.server_port}/execute", content=b"x" * (16 * 2**20 + 1), timeout=30)
        assert big.status_code == 413 and "MAX_BODY_BYTES" in big.text
        with pytest.raises(RuntimeError, match="reset"):
            env.step({"action_type": "CLICK", "parameters": {"x": 1, "y": 1}})
        with pytest.raises(RuntimeError, match="reset"):
            env.controller.get_screenshot()
    finally:
        env.close()
    with pytest.raises(RuntimeError, match="closed"):
        env.reset(task_config=json.loads(BLUETOOTH.read_text()))


@pytest.mark.parametrize("path", ["../../v1/pool", "/a/./b", "/%2e%2e/v1/pool", "/x/..?q=1"])
def test_guest_routes_with_dot_segments_are_refused(path: str) -> None:
    with pytest.raises(ValueError, match="^path: "):
        guest_route(path)
    assert guest_route("/screenshot?x=..") == "/guest/screenshot?x=.."  # a query is not a path
