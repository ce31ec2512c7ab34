"""UI-TARS / DART-GUI format: ``Thought: ...`` then ``Action: click(start_box='(x,y)')``.

The model sees the screenshot after its processor's smart resize (:mod:`geometry`) and answers
with absolute coordinates in that resized image (``coordinates="absolute"``, UI-TARS-1.5 and
DART), or in a 0-1000 grid (``"relative"``, UI-TARS-1.0). Points are mapped back to the screen,
and each action becomes pyautogui code or computer_13 dicts for our desktop.

Actions understood (aliases in brackets): click [left_single], left_double [double_click],
right_single [right_click], hover [move_to, mouse_move], drag [select] (start_box, end_box),
hotkey(key='ctrl c'), press [keydown, keyup] (key), type(content='...'; a trailing newline
presses Enter), scroll(start_box?, direction=up|down|left|right), wait(), finished(content?)
-> DONE, call_user() -> FAIL. A reply may hold several actions, one per paragraph. Points may be
written '(x,y)', '(x1,y1,x2,y2)' (the box's centre), with <|box_start|>/<|box_end|> tokens,
'[x, y]' or '<point>x y</point>'.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Literal

from osfarm.agents.base import ActionSpace, special
from osfarm.agents.prompts.base import ObservationKind, Parsed, ParseError, StepContext
from osfarm.agents.prompts.geometry import (
    FACTOR,
    MAX_PIXELS,
    MIN_PIXELS,
    smart_resize,
    to_screen,
)
from osfarm.schema.actions import KEY_NAMES, AgentAction

Coordinates = Literal["absolute", "relative"]
RELATIVE_GRID = 1000
SCROLL_CLICKS = 5

PROMPT = """You control a computer to carry out the user's task. Each turn you get the current \
screenshot (earlier turns show your previous answers) and reply with your reasoning and ONE next action.

## Reply format
```
Thought: ...
Action: ...
```

## Actions
click(start_box='(x1,y1)')
left_double(start_box='(x1,y1)')
right_single(start_box='(x1,y1)')
drag(start_box='(x1,y1)', end_box='(x2,y2)')
hotkey(key='ctrl c') # lowercase key names separated by spaces, at most 3 keys
type(content='xxx') # a Python string literal: escape quotes and newlines; end with \\n to press Enter
scroll(start_box='(x1,y1)', direction='down or up or right or left')
wait() # pause 5 s and look again
finished(content='xxx') # the task is done
call_user() # the task cannot be done, or you need the user

## Notes
- Write the Thought in {language}: a short plan, then the next action and its target in one sentence.
- Coordinates are pixels of the screenshot as you see it.

## Task
{instruction}"""

KEY_ALIASES = {"arrowleft": "left", "arrowright": "right", "arrowup": "up", "arrowdown": "down", "control": "ctrl",
               "page_down": "pagedown", "page_up": "pageup", "spacebar": "space", "escape": "esc",
               "return": "enter", "super_l": "win", "windows": "win", "delete": "delete", "del": "delete"}
CLICKS = {"click": ("left", 1), "left_single": ("left", 1), "left_double": ("left", 2), "double_click": ("left", 2),
          "right_single": ("right", 1), "right_click": ("right", 1), "middle_single": ("middle", 1)}
HOVER = ("hover", "move_to", "mouse_move")
DRAG = ("drag", "select")
KEYS = ("press", "keydown", "keyup", "key_down", "key_up")
KNOWN = (*CLICKS, *HOVER, *DRAG, "hotkey", *KEYS, "type", "scroll", "wait", "finished", "call_user")
POINT_ARGS = ("start_box", "point", "start_point")
END_ARGS = ("end_box", "end_point")
_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*\((.*)\)\s*$", re.DOTALL)
_NUM = re.compile(r"-?\d+(?:\.\d+)?")
_ACTION = re.compile(r"^\s*Action\s*:", re.MULTILINE | re.IGNORECASE)
_THOUGHT = re.compile(r"^\s*Thought\s*:\s*", re.MULTILINE | re.IGNORECASE)


def split_reply(reply: str) -> tuple[str | None, list[str]]:
    """(thought, action strings): the text after the last ``Action:``, one action per paragraph."""
    matches = list(_ACTION.finditer(reply))
    if not matches:
        raise ParseError("no 'Action:' line in the reply")
    m = matches[-1]
    before, after = reply[:m.start()], reply[m.end():]
    t = _THOUGHT.search(before)
    thought = before[t.end():].strip() if t else (before.strip() or None)
    body = after.strip()
    if body.startswith("```"):
        body = body.strip("`").strip()
    actions = [a.strip() for a in re.split(r"\n\s*\n", body) if a.strip()]
    if not actions:
        raise ParseError("nothing after 'Action:'")
    return thought, actions


def parse_call(src: str) -> tuple[str, dict[str, str]]:
    """``name(key='value', ...)`` -> (name, {key: value}); quotes inside ``content`` tolerated."""
    try:
        node = ast.parse(src.strip(), mode="eval").body
    except SyntaxError:
        node = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        kwargs: dict[str, str] = {}
        for kw in node.keywords:
            if kw.arg is None or not isinstance(kw.value, ast.Constant):
                raise ParseError(f"{src.strip()[:80]!r}: arguments must be key='value'")
            kwargs[kw.arg] = str(kw.value.value)
        if node.args:
            raise ParseError(f"{src.strip()[:80]!r}: arguments must be named (key='value')")
        return node.func.id, kwargs
    m = _CALL.match(src)
    if m is None:
        raise ParseError(f"cannot read the action {src.strip()[:80]!r} (expected name(key='value'))")
    name, args = m.group(1), m.group(2).strip()
    # Models write type(content='it's') with an unescaped quote: take all up to the last quote.
    cm = re.fullmatch(r"(content|key)\s*=\s*(['\"])(.*)\2", args, re.DOTALL)
    if cm:
        value = cm.group(3).replace("\\n", "\n").replace("\\'", "'").replace('\\"', '"')
        return name, {cm.group(1): value}
    raise ParseError(f"cannot read the arguments of {name}(...): {args[:80]!r}")


@dataclass
class UITarsFormat:
    coordinates: Coordinates = "absolute"
    factor: int = FACTOR
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    language: str = "English"
    name: str = "uitars"
    observations: tuple[ObservationKind, ...] = ("screenshot",)
    action_spaces: tuple[ActionSpace, ...] = ("pyautogui", "computer_13")

    def model_size(self, screen: tuple[int, int]) -> tuple[int, int]:
        """The image space the model's coordinates live in."""
        if self.coordinates == "relative":
            return RELATIVE_GRID, RELATIVE_GRID
        return smart_resize(*screen, factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def head(self, instruction: str, observation: ObservationKind, ctx: StepContext) -> list[dict]:
        text = PROMPT.format(language=self.language, instruction=instruction)
        return [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": [{"type": "text", "text": text}]}]

    def turn_text(self, a11y_table: str | None, observation: ObservationKind) -> str:
        return ""  # the user turns carry only the screenshot

    def point(self, value: str, arg: str, ctx: StepContext) -> tuple[int, int]:
        nums = [float(n) for n in _NUM.findall(value)]
        if len(nums) == 4:
            nums = [(nums[0] + nums[2]) / 2, (nums[1] + nums[3]) / 2]
        if len(nums) != 2:
            raise ParseError(f"{arg}={value!r}: expected a point '(x,y)' or a box '(x1,y1,x2,y2)'")
        x, y = nums
        mw, mh = self.model_size(ctx.screen)
        if not (0 <= x <= mw and 0 <= y <= mh):
            raise ParseError(f"{arg}=({x:g},{y:g}) is outside the model's {mw}x{mh} image")
        return to_screen(x, y, (mw, mh), ctx.screen)

    def parse(self, reply: str, ctx: StepContext) -> Parsed:
        if not (reply or "").strip():
            raise ParseError("empty reply")
        thought, sources = split_reply(reply)
        actions: list[AgentAction] = []
        for src in sources:
            actions += self.convert(*parse_call(src), ctx)
        return Parsed(actions, thought=thought)

    def _opt_arg(self, kwargs: dict[str, str], keys: tuple[str, ...]) -> str | None:
        for k in keys:
            if k in kwargs:
                return kwargs[k]
        return None

    def _arg(self, name: str, kwargs: dict[str, str], keys: tuple[str, ...]) -> str:
        value = self._opt_arg(kwargs, keys)
        if value is None:
            raise ParseError(f"{name}(...) needs {keys[0]}=")
        return value

    def convert(self, name: str, kwargs: dict[str, str], ctx: StepContext) -> list[AgentAction]:
        """One UI-TARS action -> actions of ``ctx.action_space``."""
        out = Emit(ctx.action_space)
        if name in CLICKS:
            button, n = CLICKS[name]
            x, y = self.point(self._arg(name, kwargs, POINT_ARGS), "start_box", ctx)
            return out.click(x, y, button, n)
        if name in HOVER:
            x, y = self.point(self._arg(name, kwargs, POINT_ARGS), "start_box", ctx)
            return out.move(x, y)
        if name in DRAG:
            x1, y1 = self.point(self._arg(name, kwargs, POINT_ARGS), "start_box", ctx)
            x2, y2 = self.point(self._arg(name, kwargs, END_ARGS), "end_box", ctx)
            return out.drag(x1, y1, x2, y2)
        if name == "hotkey":
            raw = self._arg(name, kwargs, ("key", "hotkey", "keys")) or ""
            keys = [key_name(k) for k in re.split(r"[\s+]+", raw.strip()) if k]
            if not keys:
                raise ParseError("hotkey(key=...) has no keys")
            return out.hotkey(keys)
        if name in KEYS:
            key = key_name(self._arg(name, kwargs, ("key",)) or "")
            return out.key(name.replace("_", ""), key)
        if name == "type":
            content = self._arg(name, kwargs, ("content", "text"))
            return out.type(content or "")
        if name == "scroll":
            box = self._opt_arg(kwargs, POINT_ARGS)
            at = self.point(box, "start_box", ctx) if box else None
            direction = (kwargs.get("direction") or "").strip().lower()
            if direction not in ("up", "down", "left", "right"):
                raise ParseError(f"scroll direction {direction!r}: expected up, down, left or right")
            return out.scroll(at, direction)
        if name == "wait":
            return [special("WAIT", ctx.action_space)]
        if name == "finished":
            return [special("DONE", ctx.action_space)]
        if name == "call_user":
            return [special("FAIL", ctx.action_space)]
        raise ParseError(f"unknown action {name!r}; expected one of {', '.join(KNOWN)}")


def key_name(key: str) -> str:
    k = key.strip().strip("'\"").lower()
    k = KEY_ALIASES.get(k, k)
    if k not in KEY_NAMES:
        raise ParseError(f"unknown key {key!r}")
    return k


@dataclass
class Emit:
    """Writes actions in one action space (pyautogui code or computer_13 dicts)."""

    space: ActionSpace

    def _code(self, *lines: str) -> list[AgentAction]:
        return ["import pyautogui\n" + "\n".join(lines)]

    def click(self, x: int, y: int, button: str, clicks: int) -> list[AgentAction]:
        if self.space == "pyautogui":
            return self._code(f"pyautogui.click({x}, {y}, clicks={clicks}, button={button!r})")
        if button == "right":
            return [{"action_type": "RIGHT_CLICK", "parameters": {"x": x, "y": y}}]
        if clicks == 2 and button == "left":
            return [{"action_type": "DOUBLE_CLICK", "parameters": {"x": x, "y": y}}]
        return [{"action_type": "CLICK", "parameters": {"x": x, "y": y, "button": button, "num_clicks": clicks}}]

    def move(self, x: int, y: int) -> list[AgentAction]:
        if self.space == "pyautogui":
            return self._code(f"pyautogui.moveTo({x}, {y})")
        return [{"action_type": "MOVE_TO", "parameters": {"x": x, "y": y}}]

    def drag(self, x1: int, y1: int, x2: int, y2: int) -> list[AgentAction]:
        if self.space == "pyautogui":
            return self._code(f"pyautogui.moveTo({x1}, {y1})",
                              f"pyautogui.dragTo({x2}, {y2}, duration=0.5, button='left')")
        return [{"action_type": "MOVE_TO", "parameters": {"x": x1, "y": y1}},
                {"action_type": "DRAG_TO", "parameters": {"x": x2, "y": y2}}]

    def hotkey(self, keys: list[str]) -> list[AgentAction]:
        if self.space == "pyautogui":
            return self._code(f"pyautogui.hotkey({', '.join(repr(k) for k in keys)})")
        if len(keys) == 1:
            return [{"action_type": "PRESS", "parameters": {"key": keys[0]}}]
        return [{"action_type": "HOTKEY", "parameters": {"keys": keys}}]

    def key(self, kind: str, key: str) -> list[AgentAction]:
        fn, typ = {"press": ("press", "PRESS"), "keydown": ("keyDown", "KEY_DOWN"), "keyup": ("keyUp", "KEY_UP")}[kind]
        if self.space == "pyautogui":
            return self._code(f"pyautogui.{fn}({key!r})")
        return [{"action_type": typ, "parameters": {"key": key}}]

    def type(self, content: str) -> list[AgentAction]:
        enter = content.endswith("\n")
        text = content[:-1] if enter else content
        if self.space == "pyautogui":
            lines = [f"pyautogui.write({text!r})"] if text else []
            return self._code(*lines, *(["pyautogui.press('enter')"] if enter else []))
        acts: list[AgentAction] = [{"action_type": "TYPING", "parameters": {"text": text}}] if text else []
        return acts + ([{"action_type": "PRESS", "parameters": {"key": "enter"}}] if enter else [])

    def scroll(self, at: tuple[int, int] | None, direction: str) -> list[AgentAction]:
        sign = 1 if direction in ("up", "right") else -1
        amount = sign * SCROLL_CLICKS
        vertical = direction in ("up", "down")
        if self.space == "pyautogui":
            fn = "scroll" if vertical else "hscroll"
            where = f", x={at[0]}, y={at[1]}" if at else ""
            return self._code(f"pyautogui.{fn}({amount}{where})")
        acts: list[AgentAction] = [{"action_type": "MOVE_TO", "parameters": {"x": at[0], "y": at[1]}}] if at else []
        params = {"dx": 0, "dy": amount} if vertical else {"dx": amount, "dy": 0}
        return acts + [{"action_type": "SCROLL", "parameters": params}]
