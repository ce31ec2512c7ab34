"""The guest's native ``/v1`` routes (documented in :mod:`osfarm.schema.guest`): actions
through XTest in this process, pyautogui code in a long-lived interpreter, one-call
observations, readiness waits."""

from __future__ import annotations

import base64
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from osfarm.desktop.guest.request_fields import expand
from osfarm.desktop.session.a11y import accessibility_tree
from osfarm.desktop.session.guest_state import Desktop, DesktopDep
from osfarm.desktop.warm import warm
from osfarm.desktop.warm.warm_reset_error import WarmResetError
from osfarm.desktop.x11.capture import encode_frame
from osfarm.desktop.x11.input_settle import focus_key
from osfarm.desktop.x11.windows import wait_for_window as find_window_within
from osfarm.http.principals import ADMIN_NAME, Principal
from osfarm.schema.actions import (
    Action,
    ActionError,
    Click,
    CodeAction,
    DoubleClick,
    DragTo,
    Hotkey,
    KeyDown,
    MouseDown,
    MouseUp,
    Press,
    RightClick,
    Typing,
    is_terminal,
    parse_actions,
)
from osfarm.schema.guest import (
    DEFAULT_ACTION_TIMING,
    ActionResult,
    ActionTiming,
    CodeRequest,
    CodeResult,
    Health,
    StepRequest,
    StepResult,
    WaitForFile,
    WaitForWindow,
    WaitResult,
)
from osfarm.schema.observation import ImageFormat, Observation, ObserveOptions, ScreenSize

OSWORLD_PAUSE_S = 0.1  # pyautogui.PAUSE's default: OSWorld's pause after each pyautogui call
# actions that press or release a mouse button: what moves the keyboard focus (input_settle)
BUTTON_ACTIONS = (Click, RightClick, DoubleClick, MouseDown, MouseUp, DragTo)


def focus_may_move(a: Action) -> bool:
    """Whether the settle wait after ``a`` gives the app the longer quiet (input_settle)."""
    if isinstance(a, BUTTON_ACTIONS + (Hotkey,)):
        return True
    if isinstance(a, (Press, KeyDown)):
        return focus_key(a.parameters.key)
    return isinstance(a, Typing) and any(c in a.parameters.text for c in "\n\r\t")
MEDIA_TYPES: dict[ImageFormat, str] = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}

router = APIRouter()
M = TypeVar("M", bound=BaseModel)


def _a11y_tree() -> str | None:
    try:
        return accessibility_tree()
    except Exception:
        return None


def observe(desk: Desktop, opts: ObserveOptions) -> Observation:
    """Everything an agent sees, gathered in parallel threads (the a11y tree is the slow part)."""
    t0 = time.perf_counter()
    if opts.settle_s > 0:
        desk.capture.wait_still(opts.settle_s, cpu=desk.apps_cpu_seconds)
    w, h = desk.screen_size()
    obs = Observation(screen=ScreenSize(width=w, height=h))
    with ThreadPoolExecutor(max_workers=3) as pool:
        fut_a11y = pool.submit(_a11y_tree) if opts.a11y else None
        fut_win = pool.submit(desk.windows) if opts.windows else None
        if opts.screenshot:
            frame = desk.capture.grab_frame(cursor=True)
            data = encode_frame(frame, opts.format, opts.scale, opts.quality)
            obs.screenshot = base64.b64encode(data).decode("ascii")
            obs.format = opts.format
            if opts.scale < 1:
                obs.width, obs.height = (max(1, round(frame.width * opts.scale)),
                                         max(1, round(frame.height * opts.scale)))
            else:
                obs.width, obs.height = frame.width, frame.height
        if opts.cursor:
            obs.cursor = desk.input.cursor_position()
        if fut_win is not None:
            obs.windows = fut_win.result()
        if fut_a11y is not None:
            obs.a11y = fut_a11y.result()
    obs.t_ms = round((time.perf_counter() - t0) * 1000, 2)
    return obs


def run_code(desk: Desktop, code: str, timeout: float, timing: ActionTiming) -> CodeResult:
    """Agent code: OSWorld's fresh interpreter per action, a child forked from a pre-imported one
    (``settle``), or the kept one (``fast``)."""
    if timing == "osworld":
        return desk.run_fresh(code, timeout)
    if timing == "settle":
        # the child's first event pays what the last event owes, and hands back what its last owes
        res, owed = desk.settle_runner.run_settled(code, timeout, desk.input_settle.give_owed())
        desk.input_settle.take_owed(owed)
        return res
    return desk.runner.run(code, timeout=timeout)


def run_actions(desk: Desktop, actions: list[Action], code_timeout: float,
                timing: ActionTiming = DEFAULT_ACTION_TIMING) -> tuple[list[ActionResult], str | None]:
    """Run validated actions in order until the first failure or DONE/FAIL (blocking). With
    ``osworld`` timing a computer_13 action is followed by pyautogui's pause, as OSWorld runs each
    one as a pyautogui call; with ``settle`` by a wait for the screen's answer, capped at that pause."""
    results: list[ActionResult] = []
    done: str | None = None
    with desk.step_lock:
        for i, a in enumerate(actions):
            term = is_terminal(a)
            if term is not None:
                results.append(ActionResult(index=i, ok=True, output=term))
                done = term
                break
            if isinstance(a, CodeAction):
                if a.special == "WAIT":
                    results.append(ActionResult(index=i, ok=True, output="WAIT"))
                    continue
                res = run_code(desk, a.code, code_timeout, timing)
                results.append(ActionResult(index=i, ok=res.ok, error=res.error, output=res.output or None))
            elif a.action_type == "WAIT":
                results.append(ActionResult(index=i, ok=True, output="WAIT"))
                continue
            else:
                try:
                    if timing == "settle":  # what the last event owes, then damage from here on is the answer
                        desk.input_settle.before_event()
                    desk.input.execute(a)
                    results.append(ActionResult(index=i, ok=True))
                    if timing == "osworld":
                        time.sleep(OSWORLD_PAUSE_S)
                    elif timing == "settle":
                        desk.input_settle.wait(OSWORLD_PAUSE_S, focus_may_move=focus_may_move(a),
                                              button=isinstance(a, BUTTON_ACTIONS))
                except ActionError as e:
                    results.append(ActionResult(index=i, ok=False, error=str(e)))
                except Exception as e:  # an X error must not lose the step's results
                    results.append(ActionResult(index=i, ok=False, error=f"{type(e).__name__}: {e}"))
            if not results[-1].ok:
                break
    return results, done


def query_model(model: type[M], request: Request) -> M:
    """Validate query parameters into a pydantic model; errors name the parameter (422)."""
    known = set(model.model_fields)
    params = {k: v for k, v in request.query_params.items() if k in known}
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        raise HTTPException(422, f"{unknown[0]}: unknown query parameter; expected one of {', '.join(sorted(known))}")
    try:
        return model.model_validate(params)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "query"
        raise HTTPException(422, f"{field}: {err['msg']}") from None


@router.get("/v1/health", response_model=Health)
async def health(desk: DesktopDep) -> Health | JSONResponse:
    if not await run_in_threadpool(desk.x_alive):
        return JSONResponse({"detail": f"display: X server {desk.display} is gone"}, 503)
    w, h = await run_in_threadpool(desk.screen_size)
    return Health(display=desk.display, screen=ScreenSize(width=w, height=h),
                  uptime_s=round(time.time() - desk.started, 3), pid=os.getpid(), a11y_bus=desk.a11y_ok())


@router.post("/v1/step", response_model=StepResult)
async def step(req: StepRequest, desk: DesktopDep) -> StepResult:
    t0 = time.perf_counter()
    w, h = await run_in_threadpool(desk.screen_size)
    try:
        actions = parse_actions(req.actions, w, h, strict=True)
    except ActionError as e:
        raise HTTPException(422, str(e)) from None
    results, done = await run_in_threadpool(run_actions, desk, actions, req.code_timeout, req.timing)
    obs = await run_in_threadpool(observe, desk, req.observe) if req.observe is not None else None
    return StepResult(results=results, done=done, observation=obs,
                      t_env_ms=round((time.perf_counter() - t0) * 1000, 2))


@router.get("/v1/observation", response_model=Observation)
async def observation(request: Request, desk: DesktopDep) -> Observation:
    opts = query_model(ObserveOptions, request)
    return await run_in_threadpool(observe, desk, opts)


@router.get("/v1/screenshot")
async def v1_screenshot(
    desk: DesktopDep,
    format: ImageFormat = "png",
    scale: float = Query(1.0, gt=0.0, le=1.0),
    quality: int = Query(80, ge=1, le=100),
    cursor: bool = True,
) -> Response:
    def work() -> tuple[bytes, int, int]:
        frame = desk.capture.grab_frame(cursor=cursor)
        data = encode_frame(frame, format, scale, quality)
        if scale < 1:
            return data, max(1, round(frame.width * scale)), max(1, round(frame.height * scale))
        return data, frame.width, frame.height

    data, w, h = await run_in_threadpool(work)
    return Response(data, media_type=MEDIA_TYPES[format],
                    headers={"X-Image-Width": str(w), "X-Image-Height": str(h)})


@router.post("/v1/pyautogui", response_model=CodeResult)
async def pyautogui_code(req: CodeRequest, desk: DesktopDep) -> CodeResult:
    def work() -> CodeResult:
        with desk.step_lock:
            return run_code(desk, req.code, req.timeout, req.timing)

    return await run_in_threadpool(work)


@router.post("/v1/wait_for_window", response_model=WaitResult)
async def wait_for_window(req: WaitForWindow, desk: DesktopDep) -> WaitResult:
    if not req.title and not req.wm_class:
        raise HTTPException(422, "title: give title and/or wm_class")
    t0 = time.monotonic()
    win = await run_in_threadpool(
        lambda: find_window_within(req.title, req.wm_class, req.timeout, display=desk.display))
    waited = round(time.monotonic() - t0, 3)
    if win is None:
        what = " and ".join(f"{k}~{v!r}" for k, v in (("title", req.title), ("wm_class", req.wm_class)) if v)
        return WaitResult(ok=False, waited_s=waited, detail=f"no window with {what} after {req.timeout:g} s")
    return WaitResult(ok=True, waited_s=waited, detail=f"{win.title} ({win.wm_class})")


@router.post("/v1/wait_for_file", response_model=WaitResult)
async def wait_for_file(req: WaitForFile) -> WaitResult:
    path = expand(req.path)

    def work() -> WaitResult:
        t0 = time.monotonic()
        while True:
            try:
                size = os.stat(path).st_size
                if size >= req.min_size:
                    return WaitResult(ok=True, waited_s=round(time.monotonic() - t0, 3), detail=f"{size} bytes")
            except OSError:
                pass
            waited = time.monotonic() - t0
            if waited >= req.timeout:
                return WaitResult(ok=False, waited_s=round(waited, 3),
                                  detail=f"{path} not present with >= {req.min_size} bytes after {req.timeout:g} s")
            time.sleep(min(0.05, req.timeout - waited))

    return await run_in_threadpool(work)


# ---- warm reset (osfarm.desktop.warm.warm) and fingerprint (osfarm.desktop.warm.fingerprint): the farm's, with the
# guest's token


class WarmResetRequest(BaseModel):
    token: str = Field(min_length=16, description="the guest's new bearer token: the old one stops working")


@router.get("/v1/session/fingerprint")
async def session_fingerprint(desk: DesktopDep) -> JSONResponse:
    """The desktop's state as a warm reset must leave it (processes, writable trees, X state)."""
    try:
        return JSONResponse(await run_in_threadpool(warm.current_fingerprint, desk))
    except WarmResetError as e:
        raise HTTPException(500, str(e)) from None


# baseline and warm_reset are the farm's (its passthrough refuses them to clients): not in the
# guest's public OpenAPI document, which clients see through that passthrough
@router.post("/v1/session/baseline", include_in_schema=False)
async def session_baseline(desk: DesktopDep) -> JSONResponse:
    """Record the state warm resets go back to (right after a cold start); its fingerprint."""
    try:
        return JSONResponse(await run_in_threadpool(warm.take_baseline, desk))
    except WarmResetError as e:
        raise HTTPException(500, str(e)) from None


@router.post("/v1/session/warm_reset", include_in_schema=False)
async def session_warm_reset(body: WarmResetRequest, request: Request, desk: DesktopDep) -> JSONResponse:
    """Back to the baseline without restarting the session, re-armed with ``token``; the new
    fingerprint's digest (the whole fingerprint where it differs from the baseline's) and the
    steps' timings. 409: this desktop cannot be put back warm (restart it cold)."""
    try:
        fp = await run_in_threadpool(warm.warm_reset, desk)
    except WarmResetError as e:
        raise HTTPException(409, str(e)) from None
    request.app.state.tokens.replace_token(body.token, Principal(ADMIN_NAME, "admin"))
    # the interpreter starts again once the answer is out (it is not needed before the next step)
    return JSONResponse(fp, background=BackgroundTask(desk.restart_runner))
