"""Wire models of the guest's native ``/v1`` API (also reused by the farm API); the observation
and its options are :mod:`osfarm.schema.observation`.

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

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from osfarm.schema.actions import JsonInt, WireAction
from osfarm.schema.observation import Observation, ObserveRequest, ScreenSize

# How agent actions are paced (osfarm.desktop.box.coderunner): "osworld" = each pyautogui code action
# in a new interpreter with pyautogui's default 0.1 s pause after every call (OSWorld's
# `python -c` path), computer_13 actions followed by that pause; "settle" = OSWorld's semantics
# (nothing kept between code actions, pyautogui's defaults) from a pre-imported interpreter forked
# per action, each input event followed by a wait for the screen's answer capped at that pause
# (osfarm.desktop.x11.input_settle); "fast" = one kept interpreter, no pause (callers wait for the
# screen to settle instead).
ActionTiming = Literal["osworld", "settle", "fast"]
ACTION_TIMINGS: tuple[ActionTiming, ...] = get_args(ActionTiming)
# settle scored as osworld wherever both were measured (issue 26: the races, the offline suite's
# replays, OSWorld's real tasks); osworld stays for exact replication (the drop-in DesktopEnv keeps it)
DEFAULT_ACTION_TIMING: ActionTiming = "settle"
TIMING_FIELD_DESCRIPTION = ("how actions are paced: 'settle' (default: OSWorld's semantics, pyautogui's 0.1 s "
                            "pause after each call cut short once the screen answered the input), 'osworld' "
                            "(OSWorld's exactly: python -c per code action, the whole pause) or 'fast' (one kept "
                            "interpreter, no pause)")


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    display: str
    screen: ScreenSize
    uptime_s: float
    pid: int
    a11y_bus: bool = Field(description="whether the AT-SPI bus answers")


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
    timing: ActionTiming = Field(default=DEFAULT_ACTION_TIMING, description=TIMING_FIELD_DESCRIPTION)


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
    timing: ActionTiming = Field(default=DEFAULT_ACTION_TIMING, description=TIMING_FIELD_DESCRIPTION)


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
