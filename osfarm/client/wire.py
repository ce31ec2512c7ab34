"""What both farm clients share: the request bodies and timeouts, the retry rule (the package
doc), the guest passthrough's routes and decoding an observation's screenshot."""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

import httpx
from PIL import Image
from pydantic import BaseModel

from osfarm.http.retry import Deadline
from osfarm.schema.actions import AgentAction, action_json
from osfarm.schema.guest import DEFAULT_ACTION_TIMING, ActionTiming
from osfarm.schema.lease import LeaseInfo
from osfarm.schema.observation import Observation, ObserveOptions

DEFAULT_URL = "http://127.0.0.1:8765"
OWNER_HEADER = "X-Osfarm-Owner"
RETRY_S = 60.0  # how long a request is retried across a farm restart
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "PUT"})
# The request never left this machine: safe to send again whatever it does.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
# The answer was lost on the way back: safe to send again only when repeating changes nothing.
_LOST = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.PoolTimeout)
_RETRY_STATUSES = (502, 503)  # the farm restarting, or a dropped link to the guest: try again


def guest_route(path: str) -> str:
    """The lease-relative route of the guest's ``path``: ``/guest/<path>``.

    A ``.`` or ``..`` segment is refused (ValueError naming ``path``): httpx resolves dot segments
    before sending, so ``../../..`` would climb out of the lease's guest routes onto the farm's
    own API, with this client's token (the OSWorld drop-in forwards paths that agents choose).
    """
    route = path.split("?", 1)[0]
    if any(seg in (".", "..") for seg in unquote(route).split("/")):
        raise ValueError(f"path: {path!r} has a '.' or '..' segment; guest routes are plain paths")
    return "/guest/" + path.lstrip("/")


class Retries:
    """When a request to a farm may be sent again, and how long to wait first (the package doc)."""

    def __init__(self, retry_s: float, expect_up: bool = False):
        self.retry_s = retry_s
        # the farm answered once (or is known to exist): a connection error is a restart, not a typo
        self.reached = expect_up

    def start(self, method: str, idempotent: bool | None) -> tuple[bool, Deadline | None]:
        idem = method.upper() in IDEMPOTENT_METHODS if idempotent is None else idempotent
        return idem, (Deadline(self.retry_s, base_s=0.25, cap_s=5.0) if self.retry_s > 0 else None)

    def after_error(self, e: httpx.TransportError, idem: bool, deadline: Deadline | None) -> float | None:
        if deadline is None or not self.reached:
            return None
        if isinstance(e, _NOT_SENT) or (idem and isinstance(e, _LOST)):
            return deadline.next_delay()
        return None

    def after_answer(self, r: httpx.Response, idem: bool, deadline: Deadline | None) -> float | None:
        self.reached = True
        if deadline is None or not idem or r.status_code not in _RETRY_STATUSES:
            return None
        return deadline.next_delay()


def screenshot_bytes(obs: Observation) -> bytes:
    """The observation's screenshot as encoded image bytes (PNG/JPEG/WebP)."""
    if obs.screenshot is None:
        raise ValueError("this observation has no screenshot (observe with screenshot=True)")
    return base64.b64decode(obs.screenshot)


def screenshot_image(obs: Observation) -> Image.Image:
    """The observation's screenshot decoded as a PIL image."""
    img = Image.open(io.BytesIO(screenshot_bytes(obs)))
    img.load()
    return img


def step_body(actions: AgentAction | Sequence[AgentAction], observe: ObserveOptions | dict[str, Any] | bool | None,
               code_timeout: float, timing: ActionTiming = DEFAULT_ACTION_TIMING) -> dict[str, Any]:
    # One action (dict, model or code string) or a list of them.
    items = [actions] if isinstance(actions, (str, dict, BaseModel)) else actions
    body: dict[str, Any] = {"actions": [action_json(a) for a in items], "code_timeout": code_timeout,
                            "timing": timing}
    if observe is True:
        observe = ObserveOptions()
    if isinstance(observe, ObserveOptions):
        body["observe"] = observe.model_dump(mode="json")
    elif isinstance(observe, dict):
        body["observe"] = ObserveOptions(**observe).model_dump(mode="json")
    return body


def observe_params(opts: dict[str, Any]) -> dict[str, str]:
    o = ObserveOptions(**opts).model_dump()
    return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in o.items()}


def lease_body(owner: str | None, ttl_s: float | None, wait_s: float, task_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"wait_s": wait_s}
    if owner is not None:
        body["owner"] = owner
    if task_id is not None:
        body["task_id"] = task_id
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    return body


def resolve_farm(url: str | None, token: str | None) -> tuple[str, str]:
    url = (url or os.environ.get("OSFARM_URL") or DEFAULT_URL).rstrip("/")
    token = token if token is not None else os.environ.get("OSFARM_TOKEN", "")
    if not token:
        raise ValueError("no farm token: pass token= or set OSFARM_TOKEN (`osfarm serve` prints it)")
    return url, token


def step_timeout(body: dict[str, Any]) -> float:
    return float(body["code_timeout"]) * len(body["actions"]) + 90.0


def heartbeat_interval(info: LeaseInfo, interval: float | None) -> float:
    return interval if interval is not None else max(0.5, info.ttl_s / 3.0)
