"""``env.controller``: the methods of OSWorld's ``PythonController`` that run scripts and agents call,
over the leased desktop's guest (through the farm's passthrough, osfarm's
:class:`~osfarm.tasks.controller.GuestController`).

As OSWorld's controller does, a call that fails logs the error and returns None (``get_*``) or
nothing (recording) instead of raising, so a runner's loop goes on; ``end_recording`` writes the
mp4 where it is told. Before the env's first ``reset`` there is no desktop: calls raise
RuntimeError.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from osfarm.tasks.controller import GuestController, GuestError

log = logging.getLogger("osfarm.osworld")

# What OSWorld's controller prepends to a pyautogui code string it runs in a fresh interpreter.
_PYAUTOGUI_PRELUDE = "import pyautogui; import time; pyautogui.FAILSAFE = False; "


class OSWorldController:
    """One env's controller; :meth:`attach` points it at each new lease's guest."""

    def __init__(self) -> None:
        self._guest: GuestController | None = None

    def attach(self, guest: GuestController | None) -> None:
        if self._guest is not None:
            self._guest.close()
        self._guest = guest

    @property
    def guest(self) -> GuestController:
        if self._guest is None:
            raise RuntimeError("no desktop is leased: call env.reset() first")
        return self._guest

    def _quiet(self, what: str, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except GuestError as e:
            log.error("%s failed: %s", what, e)
            return None

    # -- observations ---------------------------------------------------------------------------

    def get_screenshot(self) -> bytes | None:
        """PNG bytes of the screen."""
        return self._quiet("get_screenshot", self.guest.screenshot)

    def get_accessibility_tree(self) -> str | None:
        """The AT-SPI tree as OSWorld's XML."""
        return self._quiet("get_accessibility_tree", self.guest.get_accessibility_tree)

    def get_terminal_output(self) -> str | None:
        """The focused terminal's text (None when there is none)."""
        return self._quiet("get_terminal_output", self.guest.get_terminal_output)

    def get_file(self, file_path: str) -> bytes | None:
        return self._quiet("get_file", self.guest.get_file, file_path)

    def get_vm_screen_size(self) -> dict[str, int] | None:
        size = self._quiet("get_vm_screen_size", self.guest.get_screen_size)
        return None if size is None else {"width": size[0], "height": size[1]}

    def get_vm_window_size(self, app_class_name: str) -> dict[str, Any] | None:
        return self._quiet("get_vm_window_size", self.guest.get_window_size, app_class_name)

    def get_vm_wallpaper(self) -> bytes | None:
        return self._quiet("get_vm_wallpaper", self.guest.get_wallpaper)

    def get_vm_directory_tree(self, path: str) -> dict[str, Any] | None:
        return self._quiet("get_vm_directory_tree", self.guest.get_directory_tree, path)

    def get_vm_platform(self) -> str:
        return "Linux"  # osfarm's desktops are Linux (the env refuses other os_type values)

    # -- commands -------------------------------------------------------------------------------

    def execute_python_command(self, command: str) -> dict[str, Any] | None:
        """Run pyautogui code in a fresh interpreter on the desktop, as OSWorld's controller does
        (outside the episode's step count: the env's ``step`` is what the score sees)."""
        return self._quiet("execute_python_command", self.guest.execute,
                           ["python3", "-c", _PYAUTOGUI_PRELUDE + command])

    # -- recording ------------------------------------------------------------------------------

    def start_recording(self) -> None:
        self._quiet("start_recording", self.guest.start_recording)

    def end_recording(self, dest: str | Path) -> None:
        """Stop the recording and write the mp4 to ``dest``."""
        data = self._quiet("end_recording", self.guest.end_recording)
        if data is not None:
            Path(dest).write_bytes(data)
