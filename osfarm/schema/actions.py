"""The action vocabulary shared by the guest server, the farm and the clients.

Two action spaces, as in OSWorld:

* ``computer_13``: ``{"action_type": "CLICK", "parameters": {"x": 10, "y": 20}}`` and friends,
  executed in-process through XTest by the guest.
* ``pyautogui``: a string of Python code run in the guest's long-lived interpreter, or one of the
  special strings ``WAIT``, ``DONE``, ``FAIL``.

Everything here is pure data and validation; nothing touches a display.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    field_validator,
)

from osfarm.errors import OsfarmError

# pyautogui's KEYBOARD_KEYS (the names computer_13 agents use), plus a few common aliases.
KEY_NAMES: frozenset[str] = frozenset(
    [chr(c) for c in range(0x20, 0x7F)]
    + [
        "\t", "\n", "\r", "accept", "add", "alt", "altleft", "altright", "apps", "backspace",
        "browserback", "browserfavorites", "browserforward", "browserhome", "browserrefresh",
        "browsersearch", "browserstop", "capslock", "clear", "convert", "ctrl", "ctrlleft",
        "ctrlright", "decimal", "del", "delete", "divide", "down", "end", "enter", "esc",
        "escape", "execute", "f1", "f2", "f3", "f4", "f5", "f6", "f7", "f8", "f9", "f10", "f11",
        "f12", "f13", "f14", "f15", "f16", "f17", "f18", "f19", "f20", "f21", "f22", "f23",
        "f24", "final", "fn", "hanguel", "hangul", "hanja", "help", "home", "insert", "junja",
        "kana", "kanji", "launchapp1", "launchapp2", "launchmail", "launchmediaselect", "left",
        "modechange", "multiply", "nexttrack", "nonconvert", "num0", "num1", "num2", "num3",
        "num4", "num5", "num6", "num7", "num8", "num9", "numlock", "pagedown", "pageup", "pause",
        "pgdn", "pgup", "playpause", "prevtrack", "print", "printscreen", "prntscrn", "prtsc",
        "prtscr", "return", "right", "scrolllock", "select", "separator", "shift", "shiftleft",
        "shiftright", "sleep", "space", "stop", "subtract", "tab", "up", "volumedown",
        "volumemute", "volumeup", "win", "winleft", "winright", "yen", "command", "option",
        "optionleft", "optionright", "super", "meta", "cmd",
    ]
)

SPECIAL_CODES: frozenset[str] = frozenset({"WAIT", "DONE", "FAIL"})

Button = Literal["left", "middle", "right"]


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer as JSON Schema has it: 5 and 5.0 (what some JSON encoders write), not 5.5; strict
# validation still refuses "5" and true.
JsonInt = Annotated[int, BeforeValidator(_integral)]


def _check_key(key: str) -> str:
    """A key name of :data:`KEY_NAMES`, in any ASCII case (``Enter``, ``CTRL``)."""
    if key not in KEY_NAMES and not (key.isascii() and key.lower() in KEY_NAMES):
        raise ValueError(f"unknown key {key!r}; use pyautogui key names such as 'enter', 'ctrl', 'a'")
    return key


def _any_case(name: str) -> str:
    return "".join(f"[{c}{c.upper()}]" if c.isalpha() else re.escape(c) for c in name)


# What _check_key accepts, as a JSON Schema pattern (the same in ECMA 262 and Python): one ASCII
# character (letters in either case are both in KEY_NAMES) or a longer name in any ASCII case.
KEY_PATTERN = r"^(?:[\t\n\r\x20-\x7e]|" + "|".join(
    _any_case(n) for n in sorted((k for k in KEY_NAMES if len(k) > 1), key=lambda k: (-len(k), k))) + ")$"
_KEY_SCHEMA = {"type": "string", "pattern": KEY_PATTERN,
               "description": "a pyautogui key name ('enter', 'ctrl', 'a', 'f5', ...), in any ASCII case"}
KeyName = Annotated[str, WithJsonSchema(_KEY_SCHEMA)]


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


# A point must lie on the desktop's screen (check_on_screen, once its size is known); the schema
# states the lower bound.
_X = "pixels from the screen's left edge: 0 <= x < its width"
_Y = "pixels from the screen's top edge: 0 <= y < its height"


class PointParams(_Params):
    x: JsonInt = Field(description=_X, json_schema_extra={"minimum": 0})
    y: JsonInt = Field(description=_Y, json_schema_extra={"minimum": 0})


class OptionalPointParams(_Params):
    x: JsonInt | None = Field(default=None, description=_X + " (none: where the pointer is)",
                          json_schema_extra={"minimum": 0})
    y: JsonInt | None = Field(default=None, description=_Y + " (none: where the pointer is)",
                          json_schema_extra={"minimum": 0})


class ClickParams(OptionalPointParams):
    button: Button = "left"
    num_clicks: JsonInt = Field(default=1, ge=1, le=3)


class ButtonParams(_Params):
    button: Button = "left"


class ScrollParams(_Params):
    dx: JsonInt = 0
    dy: JsonInt = 0


class TypingParams(_Params):
    text: str


class KeyParams(_Params):
    key: KeyName

    _key = field_validator("key")(_check_key)


class HotkeyParams(_Params):
    keys: list[KeyName] = Field(min_length=1)

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: list[str]) -> list[str]:
        return [_check_key(k) for k in v]


class NoParams(_Params):
    pass


class _Action(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MoveTo(_Action):
    action_type: Literal["MOVE_TO"]
    parameters: PointParams


class Click(_Action):
    action_type: Literal["CLICK"]
    parameters: ClickParams = ClickParams()


class MouseDown(_Action):
    action_type: Literal["MOUSE_DOWN"]
    parameters: ButtonParams = ButtonParams()


class MouseUp(_Action):
    action_type: Literal["MOUSE_UP"]
    parameters: ButtonParams = ButtonParams()


class RightClick(_Action):
    action_type: Literal["RIGHT_CLICK"]
    parameters: OptionalPointParams = OptionalPointParams()


class DoubleClick(_Action):
    action_type: Literal["DOUBLE_CLICK"]
    parameters: OptionalPointParams = OptionalPointParams()


class DragTo(_Action):
    action_type: Literal["DRAG_TO"]
    parameters: PointParams


class Scroll(_Action):
    action_type: Literal["SCROLL"]
    parameters: ScrollParams = ScrollParams()


class Typing(_Action):
    action_type: Literal["TYPING"]
    parameters: TypingParams


class Press(_Action):
    action_type: Literal["PRESS"]
    parameters: KeyParams


class KeyDown(_Action):
    action_type: Literal["KEY_DOWN"]
    parameters: KeyParams


class KeyUp(_Action):
    action_type: Literal["KEY_UP"]
    parameters: KeyParams


class Hotkey(_Action):
    action_type: Literal["HOTKEY"]
    parameters: HotkeyParams


class Control(_Action):
    """WAIT, DONE or FAIL: no input is sent; DONE and FAIL end the episode."""

    action_type: Literal["WAIT", "DONE", "FAIL"]
    parameters: NoParams = NoParams()


# One model per action_type, so the union's discriminator maps each value to its own schema (tools
# that read the OpenAPI, schemathesis among them, keep one value per schema of a mapping).
class Wait(Control):
    action_type: Literal["WAIT"]


class Done(Control):
    action_type: Literal["DONE"]


class Fail(Control):
    action_type: Literal["FAIL"]


Computer13Action = Annotated[
    MoveTo | Click | MouseDown | MouseUp | RightClick | DoubleClick | DragTo | Scroll | Typing
    | Press | KeyDown | KeyUp | Hotkey | Wait | Done | Fail,
    Field(discriminator="action_type"),
]

ACTION_TYPES: tuple[str, ...] = (
    "MOVE_TO", "CLICK", "MOUSE_DOWN", "MOUSE_UP", "RIGHT_CLICK", "DOUBLE_CLICK", "DRAG_TO",
    "SCROLL", "TYPING", "PRESS", "KEY_DOWN", "KEY_UP", "HOTKEY", "WAIT", "DONE", "FAIL",
)


class CodeAction(_Action):
    """pyautogui code (or WAIT/DONE/FAIL) run in the guest's long-lived interpreter."""

    code: str = Field(min_length=1)

    @property
    def special(self) -> str | None:
        c = self.code.strip()
        return c if c in SPECIAL_CODES else None


Action = Computer13Action | CodeAction

# What an agent returns and TaskEnv.step takes: a typed Action, or the forms OSWorld's agents return
# (a pyautogui code string or WAIT/DONE/FAIL; a computer_13 dict). The string and dict forms are
# OSWorld's edge, kept as sent: the episode record stores them and OSWorld's evaluators read the last
# one (``last_action == "FAIL"``); parse_action reads all three.
AgentAction = Action | str | dict[str, Any]
Special = Literal["WAIT", "DONE", "FAIL"]
SPECIAL_ACTIONS: tuple[Special, ...] = ("WAIT", "DONE", "FAIL")
Ending = Literal["DONE", "FAIL"]
ENDINGS: tuple[Ending, ...] = ("DONE", "FAIL")


def special_action(action: AgentAction) -> Special | None:
    """``"DONE"`` for ``"DONE"``, ``{"action_type": "DONE"}``, ``Done()`` or ``CodeAction(code="DONE")``;
    None for an ordinary action."""
    kind: object
    if isinstance(action, str):
        kind = action
    elif isinstance(action, dict):
        kind = action.get("action_type")
    elif isinstance(action, CodeAction):
        kind = action.special
    else:
        kind = action.action_type
    return next((s for s in SPECIAL_ACTIONS if s == kind), None)


def action_json(action: AgentAction) -> str | dict[str, Any]:
    """The action as JSON carries it (a request's ``actions`` item, a record's step): typed ones dumped."""
    if isinstance(action, BaseModel):
        return action.model_dump(mode="json")
    return action

_computer13 = TypeAdapter(Computer13Action)
# Already an action: parse_action passes these through.
_ACTION_MODELS = (MoveTo, Click, MouseDown, MouseUp, RightClick, DoubleClick, DragTo, Scroll, Typing, Press, KeyDown,
                  KeyUp, Hotkey, Wait, Done, Fail, CodeAction)

# What str.strip() removes (every str.isspace() character lies below U+3001), so that the pattern
# of a code string says what parse_action's "empty code string" check refuses, in ECMA 262 and Python.
_SPACES = "".join(f"\\u{c:04x}" for c in range(0x3001) if chr(c).isspace())
CodeText = Annotated[str, WithJsonSchema({
    "type": "string", "pattern": f"[^{_SPACES}]",
    "description": "pyautogui code run in the desktop, or WAIT, DONE, FAIL (not only whitespace)"})]


def _as_sent(value: Any) -> Any:
    return value


# One action as a request carries it. Its JSON schema is the union parse_action reads (a code
# string, {code}, a computer_13 object); the value is kept as sent and parsed by parse_actions
# (strict=True), whose errors name the field, once the screen it must lie on is known.
WireAction = Annotated[Any, PlainValidator(_as_sent, json_schema_input_type=CodeText | CodeAction | Computer13Action)]


class ActionError(OsfarmError, ValueError):
    """An action that cannot be run; ``field`` is the dotted path of the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def parse_action(raw: Any, field: str = "action", strict: bool = False) -> Computer13Action | CodeAction:
    """Turn a JSON value into an action, or raise ActionError naming the bad field.

    A string is pyautogui code (or WAIT/DONE/FAIL); a dict with ``action_type`` is computer_13;
    a dict with ``code`` is pyautogui code. ``strict`` takes values as :data:`WireAction`'s schema
    types them (``"5"``, ``true`` or ``5.0`` is no coordinate): what an HTTP request gets.
    """
    if isinstance(raw, str):
        if not raw.strip():
            raise ActionError(field, "empty code string")
        return CodeAction(code=raw)
    if isinstance(raw, _ACTION_MODELS):
        return raw
    if not isinstance(raw, dict):
        raise ActionError(field, f"expected a computer_13 object or a code string, got {type(raw).__name__}")
    if "code" in raw and "action_type" not in raw:
        try:
            return CodeAction.model_validate(raw, strict=strict)
        except ValidationError as e:
            raise _first_error(e, field) from None
    at = raw.get("action_type")
    if at is None:
        raise ActionError(f"{field}.action_type", "missing; expected one of " + ", ".join(ACTION_TYPES))
    if at not in ACTION_TYPES:
        raise ActionError(f"{field}.action_type",
                          f"unknown action type {at!r}; expected one of " + ", ".join(ACTION_TYPES))
    try:
        return _computer13.validate_python(raw, strict=strict)
    except ValidationError as e:
        raise _first_error(e, field) from None


def _first_error(e: ValidationError, field: str) -> ActionError:
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"] if str(p) not in ACTION_TYPES]
    path = ".".join([field, *loc])
    return ActionError(path, err["msg"])


def check_on_screen(action: Computer13Action | CodeAction, width: int, height: int, field: str = "action") -> None:
    """Raise ActionError if a computer_13 action points outside a width x height screen."""
    params = getattr(action, "parameters", None)
    for axis, limit in (("x", width), ("y", height)):
        v = getattr(params, axis, None)
        if v is not None and not 0 <= v < limit:
            raise ActionError(f"{field}.parameters.{axis}", f"{v} is off screen (screen is {width}x{height})")


def parse_actions(raws: Sequence[Any], width: int, height: int, field: str = "actions",
                  strict: bool = False) -> list[Action]:
    """Parse and check a batch of actions for a width x height screen, all before any runs (so
    a bad batch has no partial effect); ActionError names the first bad one (``actions.<i>...``)."""
    actions: list[Action] = []
    for i, raw in enumerate(raws):
        action = parse_action(raw, f"{field}.{i}", strict)
        check_on_screen(action, width, height, f"{field}.{i}")
        actions.append(action)
    return actions


def is_terminal(action: Action) -> Ending | None:
    """'DONE' or 'FAIL' if the action ends the episode, else None."""
    special = special_action(action)
    return "DONE" if special == "DONE" else "FAIL" if special == "FAIL" else None
