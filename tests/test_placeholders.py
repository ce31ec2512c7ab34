"""OSWorld's placeholders are substituted from the leased desktop's real values, where OSWorld
substitutes them (execute/command steps of config and postconfig) and nowhere else."""

from __future__ import annotations

from pathlib import Path

from osfarm.env import SyncTaskEnv
from osfarm.farm.server import FarmServer
from osfarm.tasks.model import parse_task
from osfarm.testing.farms import H, W

ALL = "{SCREEN_WIDTH}x{SCREEN_HEIGHT} {SCREEN_WIDTH_HALF}x{SCREEN_HEIGHT_HALF} {CLIENT_PASSWORD}"


def test_placeholders_take_the_desktops_values(farm: FarmServer, tmp_path: Path) -> None:
    task = parse_task({
        "id": "placeholders", "snapshot": "os", "instruction": "nothing", "source": "", "config": [
            {"type": "execute", "parameters": {"command": ["sh", "-c", f"echo '{ALL}' > ~/list.txt"]}},
            {"type": "command", "parameters": {"command": f"echo '{ALL}' > ~/shell.txt", "shell": "true"}},
            # OSWorld substitutes in execute/command only: a launch keeps the text as it is
            {"type": "launch", "parameters": {"command": ["sh", "-c", "echo '{SCREEN_WIDTH}' > ~/launch.txt"]}},
            {"type": "execute", "parameters": {"command": "sleep 0.5", "shell": True}}],
        "evaluator": {
            "postconfig": [{"type": "execute", "parameters": {"command": f"echo '{ALL}' > ~/post.txt",
                                                              "shell": True}}],
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": "cat ~/list.txt ~/shell.txt ~/launch.txt ~/post.txt",
                       "shell": True},
            "expected": {"type": "rule", "rules": {"expected": "".join(
                [f"{W}x{H} {W // 2}x{H // 2} password\n"] * 2
                + ["{SCREEN_WIDTH}\n", f"{W}x{H} {W // 2}x{H // 2} password\n"])}}},
    })
    assert (W, H) != (1920, 1080)  # OSWorld's default size would not tell the values apart
    with SyncTaskEnv(farm.url, farm.token, work_dir=tmp_path / "w") as env:
        env.reset(task)
        _obs, reward, terminated, _trunc, info = env.step("DONE")
        assert terminated and reward == 1.0, info
