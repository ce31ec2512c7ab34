"""What every prompt format provides: the prompt text, the user turn of a step, and a parser.

A format turns one step's observation into chat content and the model's reply into actions of
the agent's action space. A reply that cannot be turned into actions raises :class:`ParseError`
with a message that says what was wrong (the runner records it as the step's ``action_error``
and the episode goes on, as in OSWorld where an unparsable reply runs no action).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from osfarm.agents.base import ActionSpace
from osfarm.errors import OsfarmError
from osfarm.schema.actions import AgentAction, Special

ObservationKind = Literal["screenshot", "a11y", "screenshot_a11y"]
OBSERVATIONS: tuple[ObservationKind, ...] = ("screenshot", "a11y", "screenshot_a11y")


class ParseError(OsfarmError, ValueError):
    """The model's reply has no valid action; the message says why."""


@dataclass(frozen=True)
class StepContext:
    screen: tuple[int, int]  # width, height of the screenshot the model saw (= the screen)
    action_space: ActionSpace


@dataclass
class Parsed:
    actions: list[AgentAction]
    thought: str | None = None
    notes: list[str] = field(default_factory=list)  # tolerated defects (e.g. an unclosed fence)


class PromptFormat(Protocol):
    name: str
    observations: tuple[ObservationKind, ...]  # the observation kinds this format can show
    action_spaces: tuple[ActionSpace, ...]  # the action spaces its parser can produce

    def head(self, instruction: str, observation: ObservationKind, ctx: StepContext) -> list[dict]:
        """The messages before the turns: system prompt and the task."""
        ...

    def turn_text(self, a11y_table: str | None, observation: ObservationKind) -> str:
        """The text of a step's user turn (the screenshot, if any, is added by the history)."""
        ...

    def parse(self, reply: str, ctx: StepContext) -> Parsed:
        ...


SPECIAL_WORDS: tuple[Special, ...] = ("WAIT", "DONE", "FAIL")


def bare_special(line: str) -> Special | None:
    """``DONE`` for a line that is only the word (tolerating backticks, quotes and a full stop)."""
    word = line.strip().strip("`'\".").strip()
    return word if word in SPECIAL_WORDS else None
