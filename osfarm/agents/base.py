"""The agent contract, as in OSWorld: one ``predict`` call per step.

``predict(instruction, obs)`` returns ``(response_text, actions)``. Actions are, for the
``pyautogui`` action space, Python code strings run in the desktop; for ``computer_13``, dicts
``{"action_type": ..., "parameters": {...}}``. In both spaces ``WAIT``, ``DONE`` and ``FAIL`` are
special: the plain string, or (computer_13) a dict whose ``action_type`` is that name — OSWorld
accepts both forms, so :func:`special_action` recognises both.

``obs`` is ``{"screenshot": PNG bytes, "accessibility_tree": str | None, "terminal": str | None,
"instruction": str}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from osfarm.tasks.model import Task

ActionSpace = Literal["pyautogui", "computer_13"]
ACTION_SPACES: tuple[ActionSpace, ...] = ("pyautogui", "computer_13")
Special = Literal["WAIT", "DONE", "FAIL"]
SPECIAL_ACTIONS: tuple[Special, ...] = ("WAIT", "DONE", "FAIL")

Action = str | dict[str, Any]


@runtime_checkable
class Agent(Protocol):
    name: str
    action_space: ActionSpace

    def reset(self, task: Task | None = None) -> None:
        """Forget the previous episode; ``task`` is the one about to run (agents may ignore it)."""
        ...

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[Action]]:
        """One step: the model's response text and the actions to execute, in order."""
        ...


def special_action(action: Action) -> Special | None:
    """``"DONE"`` for ``"DONE"`` or ``{"action_type": "DONE"}``; None for an ordinary action."""
    kind = action.get("action_type") if isinstance(action, dict) else action
    return kind if kind in SPECIAL_ACTIONS else None  # type: ignore[return-value]


def special(name: Special, action_space: ActionSpace) -> Action:
    """The special action in the form native to ``action_space``."""
    if action_space not in ACTION_SPACES:
        raise ValueError(f"unknown action space {action_space!r}; expected one of {ACTION_SPACES}")
    return {"action_type": name} if action_space == "computer_13" else name
