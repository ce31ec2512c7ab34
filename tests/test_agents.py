"""Agent protocol and the two trivial agents."""

from __future__ import annotations

import pytest

from osfarm.agents import (
    Agent,
    FailAgent,
    NoopAgent,
    UnknownAgent,
    make_agent,
)
from osfarm.schema.actions import Click, CodeAction, Done, action_json, is_terminal, parse_action, special_action

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


def test_typed_actions_are_the_same_vocabulary_as_osworlds_forms() -> None:
    # an agent may return typed actions: the specials, the JSON sent and the parse agree with the dict forms
    assert special_action(Done(action_type="DONE")) == "DONE"
    assert special_action(CodeAction(code=" FAIL\n")) == "FAIL"
    assert special_action(CodeAction(code="pyautogui.click(1, 2)")) is None
    click = parse_action({"action_type": "CLICK", "parameters": {"x": 1, "y": 2}})
    assert isinstance(click, Click) and parse_action(click) is click
    assert action_json(click) == {"action_type": "CLICK", "parameters": {"x": 1, "y": 2, "button": "left",
                                                                         "num_clicks": 1}}
    assert action_json("WAIT") == "WAIT"
    assert is_terminal(click) is None and is_terminal(parse_action("DONE")) == "DONE"


def test_unknown_action_space_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown action space"):
        NoopAgent(action_space="mouse_only")  # type: ignore[arg-type]


def test_unknown_agent_names_list_the_available_ones() -> None:
    with pytest.raises(UnknownAgent, match="unknown agent 'gpt9'.*noop, fail, replay"):
        make_agent("gpt9")


def test_replay_reads_a_solutions_folder_by_task_id(tmp_path) -> None:
    # OSWorld's task files name a trajectory folder ("trajectories/"); the solution lives elsewhere.
    from types import SimpleNamespace

    from osfarm.agents.replay import ReplayError
    from osfarm.runner.run import RunOptions

    (tmp_path / "sol").mkdir()
    (tmp_path / "sol" / "t-1.json").write_text('[["pyautogui.press(\'f2\')"], ["DONE"]]')
    task = SimpleNamespace(id="t-1", trajectory="trajectories/", path=tmp_path / "os" / "t-1.json")
    agent = make_agent("replay", solutions=tmp_path / "sol")
    agent.reset(task)
    assert agent.predict("", OBS)[1] == ["pyautogui.press('f2')"] and agent.predict("", OBS)[1] == ["DONE"]
    with pytest.raises(ReplayError, match="t-2.json"):
        agent.reset(SimpleNamespace(id="t-2", trajectory="trajectories/", path=None))
    with pytest.raises(ReplayError, match="does not exist"):
        make_agent("replay", solutions=tmp_path / "absent")
    opts = RunOptions(suite=tmp_path, agent="noop", out=tmp_path, solutions=tmp_path / "sol")
    with pytest.raises(ValueError, match="replay agent"):
        opts.agent_options()
