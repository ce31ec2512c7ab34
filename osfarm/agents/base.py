"""The agent contract, as in OSWorld: one ``predict`` call per step.

``predict(instruction, obs)`` returns ``(response_text, actions)``. Actions are, for the
``pyautogui`` action space, Python code strings run in the desktop; for ``computer_13``, dicts
``{"action_type": ..., "parameters": {...}}``, or typed actions (:data:`osfarm.schema.actions.Action`).
In both spaces ``WAIT``, ``DONE`` and ``FAIL`` are special: the plain string, or (computer_13) a dict
whose ``action_type`` is that name — OSWorld accepts both forms, so
:func:`osfarm.schema.actions.special_action` recognises both. The vocabulary
(:data:`~osfarm.schema.actions.AgentAction`) is the wire layer's.

``obs`` is ``{"screenshot": PNG bytes, "accessibility_tree": str | None, "terminal": str | None,
"instruction": str}`` (:meth:`osfarm.schema.observation.AgentObservation.as_dict`).

:class:`Agent` names every member the runner uses; :class:`BaseAgent` gives the optional ones
their defaults, so an agent writes ``name``, ``reset`` and ``predict`` (or ``apredict``) only.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from osfarm.env import SETTLE_S
from osfarm.schema.actions import AgentAction, Special
from osfarm.schema.episode import ModelCall

if TYPE_CHECKING:
    from osfarm.tasks.model import Task

ActionSpace = Literal["pyautogui", "computer_13"]
ACTION_SPACES: tuple[ActionSpace, ...] = ("pyautogui", "computer_13")


@runtime_checkable
class Agent(Protocol):
    name: str
    action_space: ActionSpace
    wants_a11y: bool  # observations carry the accessibility tree
    settle_s: float  # how long an observation may wait for the screen to settle (osfarm.env.SETTLE_S)
    # the model call behind the last predict (request messages, response text, token ids,
    # log-probs, policy version, parse_error), or None for agents without a model
    last_model_call: ModelCall | None

    def reset(self, task: Task | None = None) -> None:
        """Forget the previous episode; ``task`` is the one about to run (agents may ignore it)."""
        ...

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        """One step: the model's response text and the actions to execute, in order."""
        ...

    async def apredict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        """``predict`` for the event loop (the runner awaits this). An :class:`osfarm.errors.InfraError`
        (e.g. a policy server that stays unreachable) is the harness's failure, not the agent's."""
        ...

    async def aclose(self) -> None:
        """Release what the agent holds (connections); called once its episode is over."""
        ...


class BaseAgent:
    """Defaults for :class:`Agent`'s optional members: no a11y tree, the env's settle time, no
    model call, ``apredict`` running the blocking ``predict`` in a worker thread, nothing to close."""

    name: str = "agent"
    action_space: ActionSpace = "pyautogui"
    wants_a11y: bool = False
    settle_s: float = SETTLE_S
    last_model_call: ModelCall | None = None

    def reset(self, task: Task | None = None) -> None:
        pass

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        raise NotImplementedError(f"{type(self).__name__} implements neither predict nor apredict")

    async def apredict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        return await asyncio.to_thread(self.predict, instruction, obs)

    async def aclose(self) -> None:
        pass


def special(name: Special, action_space: ActionSpace) -> AgentAction:
    """The special action in the form native to ``action_space``."""
    if action_space not in ACTION_SPACES:
        raise ValueError(f"unknown action space {action_space!r}; expected one of {ACTION_SPACES}")
    return {"action_type": name} if action_space == "computer_13" else name


__all__ = ["ACTION_SPACES", "ActionSpace", "Agent", "BaseAgent", "special"]
