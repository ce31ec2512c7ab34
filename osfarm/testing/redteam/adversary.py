"""The adversarial agent of the red-team suite: a real agent (``osfarm.agents.base.BaseAgent``),
run by the normal runner (``osfarm.runner.episode.run_episode``) on a leased desktop, whose
actions are pyautogui-space Python code: each step is one probe from :mod:`probes`.

A probe's code attacks from inside the box as the agent can (as ``user``, and as the box's
root through ``sudo`` with OSWorld's password) and ends by raising ``HELD: ...`` (every attempt
was refused) or ``BREACH: ...`` (one worked, and what it got). The runner records a raised
exception as the step's ``action_error``, the agent's failure, and the episode goes on: the
verdicts are read back from the episode's steps (:func:`verdicts`).
"""

from __future__ import annotations

import re
from typing import Any

from osfarm.agents.base import BaseAgent
from osfarm.runner.episode import EpisodeResult

VERDICT = re.compile(r"Exception: (HELD|BREACH): (.*)", re.DOTALL)


class AdversaryAgent(BaseAgent):
    """Plays ``codes`` one per step, then ``DONE`` (so the task's evaluation runs)."""

    name = "adversary"  # action_space: BaseAgent's pyautogui, the code it plays

    def __init__(self, codes: list[str]):
        self.codes = list(codes)
        self._i = 0

    def reset(self, task: Any = None) -> None:
        self._i = 0

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[Any]]:
        if self._i >= len(self.codes):
            return "done", ["DONE"]
        code = self.codes[self._i]
        self._i += 1
        return f"probe {self._i}", [code]


def verdicts(res: EpisodeResult) -> list[tuple[str, str]]:
    """(HELD|BREACH|NONE, detail) per probe step, in order."""
    out = []
    for step in res.steps:
        if step.actions and step.actions[0] in ("DONE", "FAIL"):
            continue
        m = VERDICT.search(step.action_error or "")
        out.append((m.group(1), m.group(2).strip()) if m else ("NONE", step.action_error or "no verdict"))
    return out
