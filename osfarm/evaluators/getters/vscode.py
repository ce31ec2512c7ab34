"""VS Code getters (OSWorld ``getters/vscode.py``): OSWorld's probe that makes VS Code write its
own state to a file."""

from __future__ import annotations

import logging
from typing import Any

from osfarm.evaluators.getters.env import EvalEnv
from osfarm.evaluators.getters.files import vm_file

log = logging.getLogger(__name__)

_VSCODE_KEYS_SCRIPT = r'''
import sys, time
import pyautogui
for kind, arg in [("hotkey", "ctrl+shift+p"), ("write", "Extensions: Enable All Extensions"), ("press", "enter"),
                  ("press", "enter"), ("hotkey", "ctrl+shift+p"), ("write", sys.argv[1]), ("press", "enter")]:
    if kind == "hotkey":
        pyautogui.hotkey(*arg.split("+"))
    elif kind == "write":
        pyautogui.write(arg)
    else:
        pyautogui.press(arg)
    time.sleep(0.5)  # the command palette opens and filters asynchronously
'''


def get_vscode_config(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """OSWorld's VS Code probe: in the focused VS Code window, enable all extensions, then run
    the command ``vscode_extension_command`` from the command palette (OSWorld's evaluation
    extension writes its answer to ``path``); ``path`` is saved as ``dest``. None when the
    file does not appear."""
    try:
        r = env.controller.execute(["python3", "-c", _VSCODE_KEYS_SCRIPT, config["vscode_extension_command"]],
                                   timeout=60)
        if r.get("returncode") != 0:
            log.info("vscode_config: the keys were not sent: %s", r.get("error"))
        env.controller.wait_for_file(config["path"], timeout=5)
    except Exception as e:  # noqa: BLE001 - the keys could not be sent: the file decides
        log.info("vscode_config: %r", e)
    return vm_file(env, config["path"], config["dest"])
