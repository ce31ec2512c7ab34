"""Agents for the benchmark harness, built by name: ``make_agent("noop")``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from osfarm.agents.base import (
    ACTION_SPACES,
    ActionSpace,
    Agent,
    BaseAgent,
    special,
)
from osfarm.agents.choice import ChoiceAgent
from osfarm.agents.replay import ReplayAgent
from osfarm.agents.trivial import FailAgent, NoopAgent
from osfarm.agents.vlm import VLMAgent
from osfarm.errors import OsfarmError

AGENTS: dict[str, Callable[..., Agent]] = {
    "noop": NoopAgent,
    "fail": FailAgent,
    "replay": ReplayAgent,
    "vlm": VLMAgent,
    "choice": ChoiceAgent,
}
# Names reserved for agents that are planned but not written yet.
PLANNED: dict[str, str] = {}


class UnknownAgent(OsfarmError, ValueError):
    pass


def make_agent(name: str, **kw: Any) -> Agent:
    """Build the agent registered as ``name`` with keyword options (e.g. ``action_space``)."""
    if name in AGENTS:
        return AGENTS[name](**kw)
    if name in PLANNED:
        raise UnknownAgent(f"agent {name!r} ({PLANNED[name]}) is not built yet; available: {', '.join(AGENTS)}")
    raise UnknownAgent(f"unknown agent {name!r}; available: {', '.join(AGENTS)}")


__all__ = [
    "ACTION_SPACES",
    "AGENTS",
    "ActionSpace",
    "Agent",
    "BaseAgent",
    "ChoiceAgent",
    "FailAgent",
    "NoopAgent",
    "ReplayAgent",
    "UnknownAgent",
    "VLMAgent",
    "make_agent",
    "special",
]
