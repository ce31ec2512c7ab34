"""What a step's actions did on the screen, as marks to draw over its screenshot: click points,
drags, typed text, keys, scrolls.

Actions come as computer_13 objects or pyautogui code. Code is read with :mod:`ast` (never run):
calls such as ``pyautogui.click(100, 200)``, ``pyautogui.dragTo(x=5, y=6)``,
``pyautogui.write('hi')`` or ``pyautogui.hotkey('ctrl', 'c')`` with literal arguments become
marks; anything else (variables, loops) is shown as code only. The marks are plain data; the
page draws them as SVG (escaped like any other text).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

MAX_LABEL = 80
_POINTER_CALLS = {
    "click": "click", "leftClick": "click", "doubleClick": "double click", "tripleClick": "triple click",
    "rightClick": "right click", "middleClick": "middle click", "moveTo": "move", "mouseDown": "press",
    "mouseUp": "release",
}  # fmt: skip
_DRAG_CALLS = {"dragTo"}
_REL_CALLS = {"moveRel": "move", "move": "move", "dragRel": "drag"}
_TYPE_CALLS = {"write", "typewrite"}
_KEY_CALLS = {"press", "keyDown", "keyUp"}
_C13_POINTER = {
    "CLICK": "click", "DOUBLE_CLICK": "double click", "RIGHT_CLICK": "right click", "MOVE_TO": "move",
    "MOUSE_DOWN": "press", "MOUSE_UP": "release",
}  # fmt: skip


@dataclass(frozen=True)
class Mark:
    kind: str  # point | drag | text | keys | scroll | special
    label: str
    x: float | None = None
    y: float | None = None
    x2: float | None = None  # drag end
    y2: float | None = None


def _clip(text: str) -> str:
    text = text.replace("\n", "⏎")
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 1] + "…"


class _Pen:
    """Follows the pointer through a step's actions, so a drag or a click without coordinates
    starts where the previous action left the pointer."""

    def __init__(self) -> None:
        self.x: float | None = None
        self.y: float | None = None
        self.marks: list[Mark] = []

    def point(self, label: str, x: Any, y: Any) -> None:
        if _num(x) and _num(y):
            self.x, self.y = float(x), float(y)
        if self.x is None or self.y is None:
            self.marks.append(Mark("keys", label))  # a click at an unknown place: text only
        else:
            self.marks.append(Mark("point", label, self.x, self.y))

    def drag(self, x: Any, y: Any, rel: bool = False) -> None:
        if not (_num(x) and _num(y)):
            return
        if rel:
            if self.x is None or self.y is None:
                return
            x, y = self.x + float(x), self.y + float(y)
        if self.x is None or self.y is None:
            self.marks.append(Mark("point", "drag to", float(x), float(y)))
        else:
            self.marks.append(Mark("drag", "drag", self.x, self.y, float(x), float(y)))
        self.x, self.y = float(x), float(y)

    def text(self, kind: str, label: str) -> None:
        self.marks.append(Mark(kind, _clip(label), self.x, self.y))


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def marks_of(actions: list[Any]) -> list[Mark]:
    pen = _Pen()
    for a in actions if isinstance(actions, list) else [actions]:
        if isinstance(a, str):
            _code_marks(a, pen)
        elif isinstance(a, dict) and "code" in a and isinstance(a["code"], str):
            _code_marks(a["code"], pen)
        elif isinstance(a, dict):
            _c13_marks(a, pen)
    return pen.marks


def _c13_marks(a: dict[str, Any], pen: _Pen) -> None:
    t = a.get("action_type")
    params = a.get("parameters")
    p: dict[str, Any] = params if isinstance(params, dict) else {}
    if t in _C13_POINTER:
        label = _C13_POINTER[t]
        if t == "CLICK" and p.get("button") not in (None, "left"):
            label = f"{p['button']} click"
        if t == "CLICK" and isinstance(p.get("num_clicks"), int) and p["num_clicks"] > 1:
            label = f"{label} ×{p['num_clicks']}"
        pen.point(label, p.get("x"), p.get("y"))
    elif t == "DRAG_TO":
        pen.drag(p.get("x"), p.get("y"))
    elif t == "TYPING":
        pen.text("text", f"type “{p.get('text', '')}”")
    elif t in ("PRESS", "KEY_DOWN", "KEY_UP"):
        pen.text("keys", f"{str(t).lower().replace('_', ' ')} {p.get('key', '')}")
    elif t == "HOTKEY":
        given = p.get("keys")
        keys: list[Any] = given if isinstance(given, list) else []
        pen.text("keys", "keys " + "+".join(str(k) for k in keys))
    elif t == "SCROLL":
        pen.text("scroll", f"scroll dx={p.get('dx', 0)} dy={p.get('dy', 0)}")
    elif t in ("WAIT", "DONE", "FAIL"):
        pen.text("special", str(t))


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _args(call: ast.Call) -> tuple[list[Any], dict[str, Any]]:
    return [_literal(a) for a in call.args], {k.arg: _literal(k.value) for k in call.keywords if k.arg}


def _code_marks(code: str, pen: _Pen) -> None:
    stripped = code.strip()
    if stripped in ("WAIT", "DONE", "FAIL"):
        pen.text("special", stripped)
        return
    try:
        tree = ast.parse(code[:100_000])
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    calls.sort(key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))
    for call in calls:
        assert isinstance(call.func, ast.Attribute)
        name = call.func.attr
        args, kw = _args(call)
        pos = args + [None, None]
        x, y = kw.get("x", pos[0]), kw.get("y", pos[1])
        if isinstance(x, (tuple, list)) and len(x) == 2:  # click((x, y))
            x, y = x
        if name in _POINTER_CALLS:
            pen.point(_POINTER_CALLS[name], x, y)
        elif name in _DRAG_CALLS:
            pen.drag(x, y)
        elif name in _REL_CALLS:
            dx, dy = kw.get("xOffset", pos[0]), kw.get("yOffset", pos[1])
            if name == "dragRel":
                pen.drag(dx, dy, rel=True)
            elif _num(dx) and _num(dy) and pen.x is not None and pen.y is not None:
                pen.point("move", pen.x + dx, pen.y + dy)
        elif name in _TYPE_CALLS:
            text = kw.get("message", pos[0])
            if isinstance(text, str):
                pen.text("text", f"type “{text}”")
            elif isinstance(text, list):
                pen.text("keys", "keys " + " ".join(str(k) for k in text))
        elif name in _KEY_CALLS:
            keys = kw.get("keys", pos[0])
            if isinstance(keys, list):
                pen.text("keys", f"{name} " + "+".join(str(k) for k in keys))
            elif isinstance(keys, str):
                pen.text("keys", f"{name} {keys}")
        elif name == "hotkey":
            pen.text("keys", "keys " + "+".join(str(a) for a in args if a is not None))
        elif name in ("scroll", "vscroll", "hscroll"):
            pen.text("scroll", f"{name} {pos[0]}")
