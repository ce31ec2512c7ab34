"""The observation: what a desktop shows, as the guest's and the farm's ``/observation`` and a
step's answer carry it (the screenshot as base64 text), and the options that ask for it.

:class:`AgentObservation` is what an agent is handed (``TaskEnv``'s observation): this one with
the image decoded to bytes and the task's instruction; its :meth:`~AgentObservation.as_dict` is
OSWorld's observation dict, the edge OSWorld's agents take.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from osfarm.schema.actions import JsonInt

ImageFormat = Literal["png", "jpeg", "webp"]


class ScreenSize(BaseModel):
    width: int
    height: int


class ObserveOptions(BaseModel):
    screenshot: bool = True
    format: ImageFormat = "png"
    scale: float = Field(default=1.0, gt=0.0, le=1.0, description="resize factor for the screenshot")
    quality: JsonInt = Field(default=80, ge=1, le=100, description="JPEG/WebP quality")
    a11y: bool = False
    windows: bool = True
    cursor: bool = Field(default=True, description="report the pointer's position (the screenshot shows the "
                         "pointer either way, as OSWorld's do)")
    settle_s: float = Field(
        default=0.0, ge=0.0, le=10.0,
        description="wait up to this long for the screen to stop changing and the desktop's apps "
        "to go idle before capturing (apps handle input and repaint after it arrives; a busy one "
        "can show a still but stale screen); 0 captures at once",
    )


class ObserveRequest(ObserveOptions):
    """ObserveOptions in a JSON body, whose values are taken as the schema types them (``"80"`` is
    no quality); in a query string they are text, read as ObserveOptions."""

    model_config = ConfigDict(strict=True)


class Window(BaseModel):
    id: int
    title: str
    wm_class: str
    x: int
    y: int
    width: int
    height: int
    focused: bool = False


class Observation(BaseModel):
    screenshot: str | None = Field(default=None, description="base64 image bytes")
    format: ImageFormat | None = None
    width: int | None = Field(default=None, description="width of the image as encoded (after scale)")
    height: int | None = None
    screen: ScreenSize
    cursor: tuple[int, int] | None = None
    windows: list[Window] | None = None
    a11y: str | None = Field(default=None, description="OSWorld-style accessibility tree XML")
    t_ms: float = 0.0


class AgentObservation(BaseModel):
    """What the agent sees: OSWorld's observation, typed.

    Built from the wire :class:`Observation` (whose screenshot is base64 text) with the image
    decoded to bytes. :meth:`as_dict` is the plain dict OSWorld agents take
    (``Agent.predict(instruction, obs)``).
    """

    model_config = ConfigDict(frozen=True, ser_json_bytes="base64")

    instruction: str
    screenshot: bytes = Field(default=b"", description="PNG bytes of the screen (b'' when not captured)")
    accessibility_tree: str | None = Field(default=None, description="OSWorld-style a11y tree XML, when asked for")
    terminal: str | None = None
    screen: ScreenSize

    @classmethod
    def from_wire(cls, obs: Observation, instruction: str) -> AgentObservation:
        png = base64.b64decode(obs.screenshot) if obs.screenshot else b""
        return cls(instruction=instruction, screenshot=png, accessibility_tree=obs.a11y, screen=obs.screen)

    def as_dict(self) -> dict[str, Any]:
        """``{"screenshot", "accessibility_tree", "terminal", "instruction"}``: OSWorld's obs dict."""
        return {"screenshot": self.screenshot, "accessibility_tree": self.accessibility_tree,
                "terminal": self.terminal, "instruction": self.instruction}
