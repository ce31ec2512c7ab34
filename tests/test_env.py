"""TaskEnv against a real farm: uvicorn on 127.0.0.1, sandbox desktops, the tasks of suites/mini.

reset leases a fresh desktop and runs the task's setup; step drives the real desktop; the reward
is 0 until DONE/FAIL or max_steps end the episode, then the task's real evaluator scores it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from osfarm.client import AsyncFarm
from osfarm.env import EpisodeTimeout, InfraError, SyncTaskEnv, TaskEnv
from osfarm.farm.server import FarmServer
from osfarm.providers.sandbox import SANDBOX_ENV
from osfarm.schema.actions import Done, KeyParams, Press
from osfarm.schema.observation import AgentObservation
from osfarm.tasks.filecache import suite_cache
from osfarm.tasks.suite import load_suite
from osfarm.testing.boxes import box_processes

SUITE = Path(__file__).resolve().parent.parent / "suites" / "mini"
HELLO, MKDIR, INFEASIBLE = (f"5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0a0{i}" for i in (1, 2, 3))
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def suite() -> Any:
    return load_suite(SUITE)


def leases(farm: FarmServer) -> int:
    r = httpx.get(f"{farm.url}/v1/pool", headers={"Authorization": f"Bearer {farm.token}"})
    r.raise_for_status()
    return int(r.json()["leases"])


def test_episode_reward_only_at_the_end_and_done_terminates(farm: FarmServer, suite: Any, tmp_path: Path) -> None:
    task = suite[HELLO]
    cache = suite_cache(suite, SUITE, None, tmp_path, True)

    async def go() -> None:
        async with TaskEnv(farm.url, farm.token, cache=cache, max_steps=5) as env:
            obs, info = await env.reset(task)
            assert isinstance(obs, AgentObservation) and obs.screenshot.startswith(PNG)
            assert obs.instruction == task.instruction and (obs.screen.width, obs.screen.height) == (1024, 768)
            assert obs.as_dict().keys() == {"screenshot", "accessibility_tree", "terminal", "instruction"}
            assert info["task_id"] == HELLO and info["desktop"]["provider"] == "sandbox"
            assert [(s["type"], s["ok"]) for s in info["setup"]] == [("launch", True), ("activate_window", True)]
            assert set(env.timings) == {"lease", "setup"}
            assert leases(farm) == 1

            obs2, reward, terminated, truncated, info = await env.step([
                {"action_type": "TYPING", "parameters": {"text": "echo 'hello osfarm' > ~/Desktop/hello.txt"}},
                Press(action_type="PRESS", parameters=KeyParams(key="enter"))])  # a typed action beside a dict
            assert (reward, terminated, truncated) == (0.0, False, False)
            assert info["index"] == 1 and info["action_error"] is None and info["t_env_ms"] > 0
            assert info["actions"][1] == {"action_type": "PRESS", "parameters": {"key": "enter"}}  # sent as JSON
            assert "score" not in info and env.score is None
            assert obs2.screenshot.startswith(PNG) and obs2.screenshot != obs.screenshot  # the terminal shows the line

            _, reward, terminated, truncated, info = await env.step(Done(action_type="DONE"))
            assert (reward, terminated, truncated) == (1.0, True, False)
            assert info["done"] == "DONE" and info["score"] == 1.0
            assert set(env.timings) == {"lease", "setup", "agent", "evaluate"}
            assert await env.evaluate() == 1.0  # the score again, nothing re-run
            with pytest.raises(RuntimeError, match="ended"):
                await env.step("WAIT")
        assert leases(farm) == 0  # the context manager released the desktop

    asyncio.run(go())


def test_fail_terminates_and_scores_infeasible_tasks(farm: FarmServer, suite: Any) -> None:
    async def go() -> None:
        async with AsyncFarm(farm.url, farm.token) as client:
            async with TaskEnv(client) as env:  # a given client is used, not closed
                await env.reset(suite[INFEASIBLE])
                _, reward, terminated, truncated, info = await env.step({"action_type": "FAIL"})
                assert (reward, terminated, truncated, info["done"]) == (1.0, True, False, "FAIL")
                assert env.last_action == {"action_type": "FAIL"}
                # reset on the same env: a fresh desktop, the previous lease released
                assert env.desktop is not None
                first = env.desktop.id
                await env.reset(suite[INFEASIBLE])
                assert env.desktop.id != first and env.score is None and env.steps == 0
                _, reward, terminated, _, _ = await env.step(["pyautogui.moveTo(5, 5)", "DONE"])
                assert (reward, terminated) == (0.0, True)  # DONE is not the answer to an infeasible task
            assert (await client.pool()).leases == 0

    asyncio.run(go())


def test_max_steps_truncates_and_evaluates(farm: FarmServer, suite: Any) -> None:
    async def go() -> None:
        async with TaskEnv(farm.url, farm.token, max_steps=2) as env:
            await env.reset(suite[MKDIR])
            _, reward, terminated, truncated, info = await env.step([])  # an empty step waits
            assert (reward, terminated, truncated) == (0.0, False, False) and info["actions"] == ["WAIT"]
            _, reward, terminated, truncated, info = await env.step(
                ["pyautogui.write('mkdir -p ~/projects/osfarm\\n')"])
            assert (terminated, truncated) == (False, True)
            assert reward == 1.0 and info["score"] == 1.0  # evaluated at the cut: the folder is there

    asyncio.run(go())


def test_rejected_and_failing_actions_are_the_agents_not_infra(farm: FarmServer, suite: Any) -> None:
    async def go() -> None:
        async with TaskEnv(farm.url, farm.token, max_steps=3) as env:
            obs, _ = await env.reset(suite[INFEASIBLE])
            # off screen: the farm refuses the request (422), nothing ran, the episode goes on
            same, reward, terminated, truncated, info = await env.step(
                {"action_type": "CLICK", "parameters": {"x": 5000, "y": 10}})
            assert (reward, terminated, truncated) == (0.0, False, False)
            assert info["rejected"] and info["action_error"].startswith("422: ") and info["t_env_ms"] is None
            assert same is obs
            # code that raises: it ran and failed; the step answers with the error
            _, _, terminated, _, info = await env.step("raise ValueError('boom')")
            assert not terminated and not info["rejected"]
            assert info["action_error"].startswith("action 0: ") and "boom" in info["action_error"]
            _, reward, terminated, truncated, _ = await env.step("FAIL")
            assert (reward, terminated, truncated) == (1.0, True, False)

    asyncio.run(go())


def test_time_limit_truncates_without_a_score(farm: FarmServer, suite: Any) -> None:
    async def go() -> None:
        async with TaskEnv(farm.url, farm.token, time_limit_s=30, code_timeout_s=120) as env:
            await env.reset(suite[INFEASIBLE])
            t0 = time.monotonic()
            _, reward, terminated, truncated, info = await env.step("import time; time.sleep(60)")
            assert time.monotonic() - t0 < 40
            assert (reward, terminated, truncated) == (0.0, False, True) and info["time_limit"]
            with pytest.raises(EpisodeTimeout):
                await env.evaluate()

    asyncio.run(go())


def test_infra_errors_are_not_the_agents(farm: FarmServer, suite: Any) -> None:
    missing = {"id": "osfarm-env-missing-asset", "snapshot": "os", "instruction": "nothing", "config": [
        {"type": "download", "parameters": {"files": [
            {"url": "https://osfarm.invalid/not-cached.txt", "path": "/home/user/Desktop/x.txt"}]}}],
        "evaluator": {"func": "infeasible"}}

    async def go() -> None:
        async with TaskEnv(farm.url, farm.token) as env:
            with pytest.raises(InfraError) as e:
                await env.reset(missing)  # offline, and the file is in no cache
            assert e.value.phase == "setup" and "osfarm.invalid/not-cached.txt" in str(e.value)
            assert env.desktop is not None and env.desktop.provider == "sandbox"  # it had a desktop
            # the same env goes on with the next task
            await env.reset(suite[INFEASIBLE])
            assert (await env.step("FAIL"))[1] == 1.0
        async with TaskEnv(farm.url, "not-the-token") as env:
            with pytest.raises(InfraError) as e:
                await env.reset(suite[INFEASIBLE])
            assert e.value.phase == "lease" and "401" in str(e.value)

    asyncio.run(go())
    assert leases(farm) == 0


def test_a_desktop_lost_before_its_evaluation_is_infra_not_a_zero(farm: FarmServer, suite: Any) -> None:
    """The desktop dies after the agent's last action: the evaluator's getter cannot run its
    command and returns None (OSWorld's way), which exact_match scores 0. That zero is the
    harness's, not the agent's: the episode is an infra error (found by tests/chaos)."""

    async def go() -> None:
        async with TaskEnv(farm.url, farm.token, max_steps=5) as env:
            await env.reset(suite[MKDIR])
            assert env.desktop is not None
            box_dir = f"{farm.settings.state_dir}/sandbox/{env.desktop.desktop_id}"
            xvfb = [p for p in box_processes(Path(farm.settings.state_dir))
                    if p.name() == "Xvfb" and p.environ().get(SANDBOX_ENV) == box_dir]
            assert len(xvfb) == 1
            os.kill(xvfb[0].pid, signal.SIGKILL)  # from the host: the agent cannot end its session
            with pytest.raises(InfraError) as e:
                await env.evaluate()  # the episode ends here (as DONE would, without its step)
            assert e.value.phase == "evaluate", e.value
            assert env.score is None

    asyncio.run(go())
    assert leases(farm) == 0


def test_sync_twin(farm: FarmServer, suite: Any) -> None:
    with SyncTaskEnv(farm.url, farm.token, max_steps=4) as env:
        obs, info = env.reset(suite[INFEASIBLE])
        assert obs.screenshot.startswith(PNG) and info["task_id"] == INFEASIBLE
        _, reward, terminated, truncated, _ = env.step("WAIT")
        assert (reward, terminated, truncated) == (0.0, False, False)
        _, reward, terminated, _, _ = env.step("FAIL")
        assert (reward, terminated) == (1.0, True)
        assert env.evaluate() == 1.0 and env.score == 1.0 and env.steps == 2
        assert leases(farm) == 1
    assert leases(farm) == 0
    with pytest.raises(RuntimeError, match="closed"):
        env.reset(suite[INFEASIBLE])
