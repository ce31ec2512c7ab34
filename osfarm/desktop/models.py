"""Wire models of the guest's native ``/v1`` API (also reused by the farm API).

Routes (all need ``Authorization: Bearer <token>``):

* ``GET  /v1/health``                  -> Health
* ``POST /v1/step``        StepRequest -> StepResult
* ``GET  /v1/observation`` (query: ObserveOptions fields) -> Observation
* ``GET  /v1/screenshot``  (query: format, scale, quality) -> raw image bytes
* ``POST /v1/pyautogui``   CodeRequest -> CodeResult
* ``POST /v1/wait_for_window`` WaitForWindow -> WaitResult
* ``POST /v1/wait_for_file``   WaitForFile   -> WaitResult
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from osfarm.desktop.actions import JsonInt, WireAction

ImageFormat = Literal["png", "jpeg", "webp"]
# How agent actions are paced (osfarm.desktop.coderunner): "osworld" = each pyautogui code action
# in a new interpreter with pyautogui's default 0.1 s pause after every call (OSWorld's
# `python -c` path), computer_13 actions followed by that pause; "fast" = one kept interpreter,
# no pause (callers wait for the screen to settle instead).
ActionTiming = Literal["osworld", "fast"]
TIMING_FIELD_DESCRIPTION = ("how actions are paced: 'osworld' (default: OSWorld's python -c per code action, "
                            "pyautogui's 0.1 s pause after each call) or 'fast' (one kept interpreter, no pause)")


class ScreenSize(BaseModel):
    width: int
    height: int


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    display: str
    screen: ScreenSize
    uptime_s: float
    pid: int
    a11y_bus: bool = Field(description="whether the AT-SPI bus answers")


class ObserveOptions(BaseModel):
    screenshot: bool = True
    format: ImageFormat = "png"
    scale: float = Field(default=1.0, gt=0.0, le=1.0, description="resize factor for the screenshot")
    quality: JsonInt = Field(default=80, ge=1, le=100, description="JPEG/WebP quality")
    a11y: bool = False
    windows: bool = True
    cursor: bool = True
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


class StepRequest(BaseModel):
    # JSON bodies are taken as the schema types them ("5" is not an int): what OpenAPI says is what passes
    model_config = ConfigDict(strict=True)

    actions: list[WireAction] = Field(
        min_length=1,
        description="computer_13 objects ({action_type, parameters}), pyautogui code strings, "
        "or {code}; run in order, stopping at the first error",
    )
    observe: ObserveRequest | None = Field(default=None, description="observation to return after the actions")
    code_timeout: float = Field(default=30.0, gt=0, le=600)
    timing: ActionTiming = Field(default="osworld", description=TIMING_FIELD_DESCRIPTION)


class ActionResult(BaseModel):
    index: int
    ok: bool
    error: str | None = None
    output: str | None = None


class StepResult(BaseModel):
    results: list[ActionResult]
    done: Literal["DONE", "FAIL"] | None = None
    observation: Observation | None = None
    t_env_ms: float


class CodeRequest(BaseModel):
    # JSON bodies are taken as the schema types them ("5" is not an int): what OpenAPI says is what passes
    model_config = ConfigDict(strict=True)

    code: str = Field(min_length=1)
    timeout: float = Field(default=30.0, gt=0, le=600)
    timing: ActionTiming = Field(default="osworld", description=TIMING_FIELD_DESCRIPTION)


class CodeResult(BaseModel):
    ok: bool
    output: str = ""
    error: str | None = None
    t_ms: float = 0.0


class WaitForWindow(BaseModel):
    # JSON bodies are taken as the schema types them ("5" is not an int): what OpenAPI says is what passes
    model_config = ConfigDict(strict=True)

    title: str | None = Field(default=None, description="substring of the window title")
    wm_class: str | None = Field(default=None, description="substring of WM_CLASS (instance or class)")
    timeout: float = Field(default=30.0, gt=0, le=600)


class WaitForFile(BaseModel):
    # JSON bodies are taken as the schema types them ("5" is not an int): what OpenAPI says is what passes
    model_config = ConfigDict(strict=True)

    path: str
    min_size: JsonInt = Field(default=0, ge=0)
    timeout: float = Field(default=30.0, gt=0, le=600)


class WaitResult(BaseModel):
    ok: bool
    waited_s: float
    detail: str | None = None
