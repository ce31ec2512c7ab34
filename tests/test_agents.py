"""Agent protocol and the two trivial agents."""

from __future__ import annotations

import pytest

from osfarm.agents import (
    Agent,
    FailAgent,
    NoopAgent,
    UnknownAgent,
    make_agent,
    special_action,
)

OBS = {"screenshot": b"\x89PNG", "accessibility_tree": None, "terminal": None, "instruction": "x"}


@pytest.mark.parametrize(("name", "verdict"), [("noop", "DONE"), ("fail", "FAIL")])
def test_trivial_agents_end_at_once_pyautogui(name: str, verdict: str) -> None:
    agent = make_agent(name)
    assert isinstance(agent, Agent) and agent.name == name and agent.action_space == "pyautogui"
    agent.reset(None)
    response, actions = agent.predict("do something", OBS)
    assert actions == [verdict] and response == verdict
    assert special_action(actions[0]) == verdict


@pytest.mark.parametrize(("cls", "verdict"), [(NoopAgent, "DONE"), (FailAgent, "FAIL")])
def test_trivial_agents_computer_13(cls: type, verdict: str) -> None:
    agent = make_agent(cls.name, action_space="computer_13")
    assert type(agent) is cls
    _, actions = agent.predict("do something", OBS)
    assert actions == [{"action_type": verdict}]
    assert special_action(actions[0]) == verdict


def test_special_action_recognises_only_specials() -> None:
    assert special_action("WAIT") == "WAIT"
    assert special_action("import pyautogui; pyautogui.click(1, 2)") is None
    assert special_action({"action_type": "CLICK", "parameters": {"x": 1, "y": 2}}) is None


def test_unknown_action_space_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown action space"):
        NoopAgent(action_space="mouse_only")  # type: ignore[arg-type]


def test_unknown_agent_names_list_the_available_ones() -> None:
    with pytest.raises(UnknownAgent, match="unknown agent 'gpt9'.*noop, fail, replay"):
        make_agent("gpt9")
