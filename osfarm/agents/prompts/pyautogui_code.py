"""OSWorld's code prompt: the model answers with ```python blocks of pyautogui code.

Conventions kept from OSWorld: code in fenced blocks, one step per reply, the special answers
``WAIT``, ``DONE`` and ``FAIL`` (alone, in a block of their own, or as the last line of a block),
observations as a screenshot, the linearised accessibility tree, or both.

Differences, on purpose: code is not split at ``;`` (OSWorld's splitting breaks string
literals), every block must compile (broken code is a parse error here instead of an exception in
the desktop), blocks tagged with another language (```bash, ```json) are skipped, a final fence
the model never closed is accepted when its code compiles, and a reply whose last line is just
``DONE``/``FAIL``/``WAIT`` counts as that answer.
"""

from __future__ import annotations

import re

from osfarm.agents.base import ActionSpace
from osfarm.agents.prompts.base import (
    SPECIAL_WORDS,
    ObservationKind,
    Parsed,
    ParseError,
    StepContext,
    bare_special,
)
from osfarm.schema.actions import AgentAction

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n?")
PYTHON_TAGS = ("", "python", "py", "python3", "pyautogui")

SEES = {
    "screenshot": "After each of your actions you receive a screenshot of the screen.",
    "a11y": "After each of your actions you receive the accessibility tree of the desktop as a table "
            "(tag, name, text, class, description, position of the top-left corner, size).",
    "screenshot_a11y": "After each of your actions you receive a screenshot of the screen and the accessibility "
                       "tree of the desktop as a table (tag, name, text, class, description, position of the "
                       "top-left corner, size).",
}

SYSTEM = """You are an agent that completes tasks on a Linux desktop (Debian, {width}x{height} screen) by \
controlling the mouse and keyboard with the Python library pyautogui. {sees}

Answer each step with Python code in a single ```python code block that performs the next action(s) \
with pyautogui, for example:
```python
pyautogui.click(512, 384)
pyautogui.write('hello')
```
Rules: use pixel coordinates of the screen that you have observed; never call \
pyautogui.locateCenterOnScreen or pyautogui.screenshot; each block must be complete on its own (import \
what it needs); you may add time.sleep() between actions that need it. Explain briefly before the block \
if you like.
Special answers, each in a code block of its own: ```WAIT``` when you need to wait, ```FAIL``` when the \
task cannot be done, ```DONE``` when the task is complete.
The password of the user is 'password' (sudo works with it).

You are asked to complete the following task: {instruction}"""

ASK = {
    "screenshot": "Given the screenshot below, what is the next step to complete the task?",
    "a11y": "Given the accessibility tree below, what is the next step to complete the task?\n{tree}",
    "screenshot_a11y": "Given the screenshot and the accessibility tree below, what is the next step to "
                       "complete the task?\n{tree}",
}


def fenced_blocks(reply: str) -> list[tuple[str, str, bool]]:
    """(language tag, body, closed) of each ``` block; the last one may run to the end unclosed."""
    blocks: list[tuple[str, str, bool]] = []
    pos = 0
    while True:
        m = _FENCE.search(reply, pos)
        if m is None:
            return blocks
        tag = m.group(1).lower()
        end = reply.find("```", m.end())
        if end < 0:
            blocks.append((tag, reply[m.end():], False))
            return blocks
        if "\n" not in m.group(0) and tag and "\n" not in reply[m.end():end] and tag.upper() in SPECIAL_WORDS:
            tag, body = "", m.group(1)  # ```DONE``` on one line: the word is the body, not a tag
            blocks.append((tag, body + reply[m.end():end], True))
        else:
            blocks.append((tag, reply[m.end():end], True))
        pos = end + 3


def _compile(code: str, where: str) -> None:
    try:
        compile(code, where, "exec")
    except SyntaxError as e:
        raise ParseError(f"{where}: line {e.lineno}: {e.msg}") from None
    except ValueError as e:  # e.g. a NUL byte in the source
        raise ParseError(f"{where}: {e}") from None


def parse_code_reply(reply: str) -> Parsed:
    """The actions of a reply in OSWorld's code convention (code strings and special words)."""
    text = (reply or "").strip()
    if not text:
        raise ParseError("empty reply")
    if word := bare_special(text):
        return Parsed([word])
    actions: list[AgentAction] = []
    notes: list[str] = []
    skipped: list[str] = []
    for n, (tag, body, closed) in enumerate(fenced_blocks(text), 1):
        if tag not in PYTHON_TAGS and not bare_special(body):
            skipped.append(tag)
            continue
        body = body.strip()
        if not body:
            continue
        where = f"code block {n}" + ("" if closed else " (unclosed ```)")
        word = bare_special(body)
        if word:
            actions.append(word)
            continue
        lines = body.splitlines()
        last = bare_special(lines[-1])
        code = "\n".join(lines[:-1]).strip() if last else body
        if code:
            _compile(code, where)
            actions.append(code)
        if last:
            actions.append(last)
        if not closed:
            notes.append("the last code block was not closed")
    if actions:
        return Parsed(actions, notes=notes)
    last_line = bare_special(text.splitlines()[-1])
    if last_line:
        return Parsed([last_line], notes=["special answer outside a code block"])
    if skipped:
        raise ParseError(f"no python code block (found ```{skipped[0]} instead) and no WAIT/DONE/FAIL")
    raise ParseError("no ```python code block and no WAIT/DONE/FAIL in the reply")


class PyAutoGUIFormat:
    name = "pyautogui"
    observations: tuple[ObservationKind, ...] = ("screenshot", "a11y", "screenshot_a11y")
    action_spaces: tuple[ActionSpace, ...] = ("pyautogui",)

    def head(self, instruction: str, observation: ObservationKind, ctx: StepContext) -> list[dict]:
        w, h = ctx.screen
        text = SYSTEM.format(width=w, height=h, sees=SEES[observation], instruction=instruction)
        return [{"role": "system", "content": text}]

    def turn_text(self, a11y_table: str | None, observation: ObservationKind) -> str:
        return ASK[observation].format(tree=a11y_table or "(no accessibility tree)")

    def parse(self, reply: str, ctx: StepContext) -> Parsed:
        return parse_code_reply(reply)
