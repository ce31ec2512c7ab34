"""End to end: real sandbox desktops driven by the VLM agent through the real CPU policy server
(tiny random model). Its actions are nonsense; the loop must hold and every step's record must
be complete. And the policy server going down ends episodes as infra errors, the run going on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from osfarm.farm.server import FarmServer
from osfarm.runner.cli import eval_command
from osfarm.runner.results import read_episodes
from osfarm.testing.vlm_servers import FaultProxy, closed_port_url, policy_server

SUITE = Path(__file__).resolve().parent.parent / "suites" / "mini"
HELLO, INFEASIBLE = "5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0a01", "5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0a03"
FAST_RETRIES = ["--agent-opt", "retries=1", "--agent-opt", "backoff_s=0.05", "--agent-opt", "backoff_max_s=0.1"]

app = typer.Typer()
app.command()(eval_command)
app.command("unused")(lambda: None)


@pytest.fixture(scope="module")
def policy() -> Iterator[str]:
    with policy_server() as url:
        yield url


def run_eval(out: Path, farm: FarmServer, model_url: str, tasks: list[str], *args: str) -> dict:
    index = out.parent / f"{out.name}-index.json"
    index.write_text(json.dumps({"os": tasks}))
    argv = ["eval-command", "--suite", str(SUITE), "--index", str(index), "--out", str(out), "--envs", "1",
            "--no-progress", "--url", farm.url, "--token", farm.token, "--agent", "vlm", "--model-url", model_url,
            "--model", "tiny", *args]
    r = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads((out / "results.json").read_text())


@pytest.mark.timeout(600)
def test_vlm_agent_drives_a_desktop_through_the_policy_server(farm: FarmServer, policy: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_eval(out, farm, policy, [HELLO, INFEASIBLE], "--max-steps", "3", "--prompt-format", "uitars",
                   "--agent-opt", "max_tokens=16", "--agent-opt", "max_pixels=200704", "--agent-opt", "min_pixels=3136",
                   "--agent-opt", "history_images=2")
    assert res["n_tasks"] == 2 and res["infra_errors"] == 0, res
    recs = {r["task_id"]: r for r in read_episodes(out / "episodes.jsonl")}
    assert set(recs) == {HELLO, INFEASIBLE}
    for rec in recs.values():
        assert rec["status"] in ("success", "failure") and rec["agent"] == "vlm"
        assert rec["policy"] == {"name": "tiny", "version_start": 0, "version_end": 0}
        assert 1 <= len(rec["steps"]) <= 3
        for s in rec["steps"]:
            m = s["model"]
            assert m["policy_version"] == 0
            ids, lps = m["response_token_ids"], m["response_logprobs"]
            assert ids and len(ids) == len(lps) <= 16 and all(isinstance(i, int) for i in ids)
            assert isinstance(m["response_text"], str)
            assert s["action_error"] is None or s["action_error"].startswith(("parse error: ", "action "))
            if s["action_error"] and s["action_error"].startswith("parse error: "):
                assert s["actions"] == []
            # the request is a JSON blob; its screenshot parts are blob refs, the last one the step's observation
            req = json.loads((out / m["request"]["path"]).read_text())
            assert req[0]["role"] == "system" and "data:" not in json.dumps(req)
            shots = [p["image_url"]["blob"] for msg in req if isinstance(msg["content"], list)
                     for p in msg["content"] if p["type"] == "image_url"]
            assert 1 <= len(shots) <= 2 and all((out / ref["path"]).is_file() for ref in shots)
            assert shots[-1]["sha256"] == s["observation"]["screenshot"]["sha256"]
        # OSWorld's layout still holds: one traj line per step with the raw response
        traj = (out / "os" / rec["task_id"] / "traj.jsonl").read_text().splitlines()
        assert [json.loads(x)["response"] for x in traj] == [s["model"]["response_text"] for s in rec["steps"]]


@pytest.mark.timeout(600)
def test_policy_server_down_is_an_infra_error_and_the_run_goes_on(
    farm: FarmServer, policy: str, tmp_path: Path
) -> None:
    # nobody listens: both episodes end as infra errors naming the cause; the run still finishes
    out = tmp_path / "down"
    res = run_eval(out, farm, closed_port_url(), [INFEASIBLE, HELLO], "--max-steps", "2", "--retries", "0",
                   *FAST_RETRIES)
    assert res["n_tasks"] == 2 and res["infra_errors"] == 2
    for t in res["tasks"]:
        assert t["status"] == "infra_error" and "policy server unreachable: " in t["error"]
        assert "ConnectError" in t["error"]
    assert not (out / "os" / HELLO / "result.txt").exists()  # --resume runs them again

    # the server goes away mid-episode: the first step is recorded, then the episode is an infra error
    with FaultProxy(policy, fail_after=1, fault="drop") as proxy:
        out = tmp_path / "mid"
        res = run_eval(out, farm, proxy.url, [INFEASIBLE], "--max-steps", "3", "--retries", "0",
                       "--prompt-format", "pyautogui", "--agent-opt", "max_tokens=8", *FAST_RETRIES)
    (t,) = res["tasks"]
    assert t["status"] == "infra_error" and "step 2: policy server unreachable" in t["error"]
    assert proxy.forwarded == 1 and proxy.requests == 3  # one good call, then a call and its one retry
    (rec,) = read_episodes(out / "episodes.jsonl")
    assert rec["status"] == "infra_error" and len(rec["steps"]) == 1
    assert rec["steps"][0]["model"]["policy_version"] == 0 and rec["policy"]["version_start"] == 0
