"""Agents that end every episode at once: baselines and harness smoke tests.

``NoopAgent`` says DONE (scores only tasks already solved by their initial state);
``FailAgent`` says FAIL (scores exactly the ``infeasible`` tasks).
"""

from __future__ import annotations

from typing import Any

from osfarm.agents.base import ActionSpace, BaseAgent, special
from osfarm.schema.actions import AgentAction, Special


class _ImmediateAgent(BaseAgent):
    verdict: Special

    def __init__(self, action_space: ActionSpace = "pyautogui") -> None:
        self.action_space: ActionSpace = action_space
        special(self.verdict, action_space)  # rejects an unknown action space now, not mid-run
        self.steps = 0

    def reset(self, task: Any = None) -> None:
        self.steps = 0

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        self.steps += 1
        return self.verdict, [special(self.verdict, self.action_space)]


class NoopAgent(_ImmediateAgent):
    name = "noop"
    verdict: Special = "DONE"


class FailAgent(_ImmediateAgent):
    name = "fail"
    verdict: Special = "FAIL"
