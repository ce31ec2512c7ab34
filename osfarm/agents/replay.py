"""``replay``: plays back a task's reference solution (its ``trajectory`` file).

The ``trajectory`` field of a task is a path relative to the folder of the task file (e.g.
``solutions/<id>.json``; the suite root is tried next) or absolute. With a ``solutions`` folder
the solution is ``<solutions>/<task id>.json`` instead: OSWorld's own task files name a
trajectory folder that is not theirs to fill, and are read in place, never edited. The file is a
JSON list of steps; each step is a list of actions (pyautogui code strings or computer_13 dicts,
including WAIT/DONE/FAIL) or a single action. ``predict`` returns one step per call, then DONE
once the steps run out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from osfarm.agents.base import ActionSpace, BaseAgent, special
from osfarm.errors import OsfarmError
from osfarm.schema.actions import AgentAction, special_action


class ReplayError(OsfarmError, ValueError):
    """The task has no usable reference solution."""


def solution_path(task: Any, solutions: Path | None = None) -> Path:
    if solutions is not None:
        return Path(solutions) / f"{getattr(task, 'id', '?')}.json"
    ref = getattr(task, "trajectory", "") or ""
    if not ref:
        raise ReplayError(f"task {getattr(task, 'id', '?')}: no 'trajectory' (reference solution) to replay")
    if not isinstance(ref, str):  # OSWorld never reads the key, so a task file may hold anything there
        raise ReplayError(f"task {getattr(task, 'id', '?')}: 'trajectory' must be a path, got {type(ref).__name__}")
    p = Path(ref)
    if p.is_absolute():
        return p
    base = task.path.parent if getattr(task, "path", None) is not None else Path.cwd()
    for cand in (base / p, base.parent / p):  # the task's folder, then the suite root
        if cand.is_file():
            return cand
    return base / p


def load_solution(path: Path) -> list[list[AgentAction]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ReplayError(f"cannot read reference solution {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ReplayError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(data, list):
        raise ReplayError(f"{path}: a solution must be a JSON list of steps")
    steps: list[list[AgentAction]] = []
    for i, step in enumerate(data):
        actions = step if isinstance(step, list) else [step]
        for a in actions:
            if not isinstance(a, (str, dict)):
                raise ReplayError(f"{path}: step {i}: an action must be a code string or an object, got {a!r}")
        steps.append(actions)
    return steps


class ReplayAgent(BaseAgent):
    name = "replay"
    # It acts at machine speed, blind to the screen: let each step's observation wait longer for
    # the apps to go idle than a model's think time would (see osfarm.env.SETTLE_S).
    settle_s = 5.0

    def __init__(self, action_space: ActionSpace = "pyautogui", solutions: str | Path | None = None) -> None:
        self.action_space: ActionSpace = action_space
        special("DONE", action_space)
        self.solutions = Path(solutions) if solutions is not None else None
        if self.solutions is not None and not self.solutions.is_dir():
            raise ReplayError(f"solutions folder {self.solutions} does not exist")
        self.steps: list[list[AgentAction]] = []
        self.cursor = 0

    def reset(self, task: Any = None) -> None:
        self.cursor = 0
        self.steps = [] if task is None else load_solution(solution_path(task, self.solutions))

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        if self.cursor >= len(self.steps):
            return "DONE", [special("DONE", self.action_space)]
        actions = self.steps[self.cursor]
        self.cursor += 1
        verdict = next((special_action(a) for a in actions if special_action(a) in ("DONE", "FAIL")), None)
        return f"replay step {self.cursor}/{len(self.steps)}" + (f" ({verdict})" if verdict else ""), list(actions)
