"""OSWorld's computer_13 prompt: the model answers with JSON action dicts.

``{"action_type": "CLICK", "parameters": {"x": 10, "y": 20}}`` and the other 12 action types
(plus WAIT/DONE/FAIL), in a ```json block, as one object or a list. Every action is checked
against the computer_13 space the desktop accepts (:mod:`osfarm.schema.actions`) and against the
screen, so a wrong action is a parse error of this step, not a rejected step at the desktop.

Tolerated, as models write them: a block without a language tag, a bare JSON reply without any
fence, an object in the middle of prose, trailing commas, Python literals (single quotes, True),
and an unclosed final fence.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from osfarm.agents.base import ActionSpace, special
from osfarm.agents.prompts.base import (
    ObservationKind,
    Parsed,
    ParseError,
    StepContext,
    bare_special,
)
from osfarm.agents.prompts.pyautogui_code import ASK, SEES, fenced_blocks
from osfarm.schema.actions import ActionError, AgentAction, check_on_screen, parse_action

JSON_TAGS = ("", "json", "json5", "javascript", "python")
_TRAILING_COMMA = re.compile(r",(\s*[}\]])")

SYSTEM = """You are an agent that completes tasks on a Linux desktop (Debian, {width}x{height} screen) by \
controlling the mouse and keyboard. {sees}

Answer each step with the next action(s) as JSON in a ```json code block: one object, or a list of \
objects run in order. Each object is {{"action_type": TYPE, "parameters": {{...}}}} with TYPE one of:
MOVE_TO {{x, y}}; CLICK {{x?, y?, button? ("left"|"right"|"middle"), num_clicks? (1-3)}}; \
MOUSE_DOWN {{button?}}; MOUSE_UP {{button?}}; RIGHT_CLICK {{x?, y?}}; DOUBLE_CLICK {{x?, y?}}; \
DRAG_TO {{x, y}} (drag from the pointer to x, y); SCROLL {{dx?, dy?}} (dy > 0 scrolls up); \
TYPING {{text}}; PRESS {{key}}; KEY_DOWN {{key}}; KEY_UP {{key}}; HOTKEY {{keys: [..]}}.
Keys use pyautogui's names ("enter", "ctrl", "a", "f5"). Coordinates are screen pixels, \
0 <= x < {width}, 0 <= y < {height}.
Special answers (no parameters): {{"action_type": "WAIT"}} to wait, {{"action_type": "FAIL"}} when the \
task cannot be done, {{"action_type": "DONE"}} when the task is complete.
The password of the user is 'password'.

You are asked to complete the following task: {instruction}"""


def _balanced(text: str) -> str | None:
    """The first balanced {...} or [...] span of ``text`` (strings respected), if any."""
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        return None
    start = min(starts)
    depth, quote, esc = 0, "", False
    for i in range(start, len(text)):
        c = text[i]
        if quote:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def load_json_lenient(src: str, where: str) -> Any:
    """JSON, else JSON without trailing commas, else a Python literal; ParseError naming ``where``."""
    try:
        return json.loads(src)
    except json.JSONDecodeError as first:
        try:
            return json.loads(_TRAILING_COMMA.sub(r"\1", src))
        except json.JSONDecodeError:
            pass
        try:
            return ast.literal_eval(src)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise ParseError(
                f"{where}: invalid JSON: {first.msg} at line {first.lineno} column {first.colno}"
            ) from None


def _candidates(text: str) -> list[tuple[str, str]]:
    """(where, source) of each JSON value the reply offers."""
    blocks = [(tag, body, closed) for tag, body, closed in fenced_blocks(text)]
    out = []
    for n, (tag, body, closed) in enumerate(blocks, 1):
        if tag in JSON_TAGS or bare_special(body):
            out.append((f"block {n}" + ("" if closed else " (unclosed ```)"), body.strip()))
    if out:
        return out
    stripped = text.strip()
    if stripped[:1] in "{[":
        return [("reply", stripped)]
    span = _balanced(text)
    return [("reply", span)] if span else []


def to_actions(value: Any, ctx: StepContext, where: str) -> list[AgentAction]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ParseError(f"{where}: an empty list of actions")
    actions: list[AgentAction] = []
    for n, raw in enumerate(items, 1):
        field = f"action {n}" if len(items) > 1 else "action"
        if isinstance(raw, str) and (word := bare_special(raw)):
            actions.append(special(word, "computer_13"))
            continue
        try:
            if not isinstance(raw, dict):
                raise ActionError(field, f"expected a computer_13 object, got {type(raw).__name__} {raw!r:.60}")
            act = parse_action(raw, field)
            check_on_screen(act, *ctx.screen, field=field)
        except ActionError as e:
            raise ParseError(f"{where}: {e}") from None
        d = act.model_dump(mode="json")
        if d.get("parameters") == {}:
            d.pop("parameters")
        actions.append(d)
    return actions


def parse_json_reply(reply: str, ctx: StepContext) -> Parsed:
    text = (reply or "").strip()
    if not text:
        raise ParseError("empty reply")
    word = bare_special(text)
    if word:
        return Parsed([special(word, "computer_13")])
    actions: list[AgentAction] = []
    for where, src in _candidates(text):
        word = bare_special(src)
        if word:
            actions.append(special(word, "computer_13"))
            continue
        actions += to_actions(load_json_lenient(src, where), ctx, where)
    if actions:
        return Parsed(actions)
    last = bare_special(text.splitlines()[-1])
    if last:
        return Parsed([special(last, "computer_13")], notes=["special answer outside a code block"])
    raise ParseError("no JSON action in the reply (expected a ```json block with {\"action_type\": ...})")


class Computer13Format:
    name = "computer_13"
    observations: tuple[ObservationKind, ...] = ("screenshot", "a11y", "screenshot_a11y")
    action_spaces: tuple[ActionSpace, ...] = ("computer_13",)

    def head(self, instruction: str, observation: ObservationKind, ctx: StepContext) -> list[dict]:
        w, h = ctx.screen
        text = SYSTEM.format(width=w, height=h, sees=SEES[observation], instruction=instruction)
        return [{"role": "system", "content": text}]

    def turn_text(self, a11y_table: str | None, observation: ObservationKind) -> str:
        return ASK[observation].format(tree=a11y_table or "(no accessibility tree)")

    def parse(self, reply: str, ctx: StepContext) -> Parsed:
        return parse_json_reply(reply, ctx)
