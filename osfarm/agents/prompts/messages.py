"""Chat messages of one model call: the history window, and images in and out of records.

The request of a step is ``head`` (system prompt, task) + the last ``history_turns`` finished
turns (user observation, assistant reply) + the current observation. Screenshots are sent only
for the last ``history_images`` observations (the current one included); older turns keep their
text (and the assistant's reply), as DART and UI-TARS do to bound the prompt.

Records store a request with each image data URL replaced by a content-addressed blob ref
(``{"type": "image_url", "image_url": {"blob": ref}}``); :func:`restore_images` turns it back.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DATA_URL_PREFIX = "data:"
OMITTED = "(screenshot omitted: an earlier step)"


@dataclass
class Turn:
    screenshot: bytes | None  # PNG the model sees (None for a11y-only observations)
    text: str  # the user turn's text
    response: str | None = None  # the assistant's reply, once the step is done


def image_part(png: bytes, media_type: str = "image/png") -> dict[str, Any]:
    url = f"data:{media_type};base64,{base64.b64encode(png).decode('ascii')}"
    return {"type": "image_url", "image_url": {"url": url}}


def _user(turn: Turn, with_image: bool) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    text = turn.text
    if turn.screenshot is not None and not with_image and not text:
        text = OMITTED
    if text:
        parts.append({"type": "text", "text": text})
    if turn.screenshot is not None and with_image:
        parts.append(image_part(turn.screenshot))
    return {"role": "user", "content": parts}


def build_messages(head: list[dict[str, Any]], past: list[Turn], current: Turn, history_turns: int,
                   history_images: int) -> list[dict[str, Any]]:
    """``head`` + the last ``history_turns`` of ``past`` + ``current``; images on the last
    ``history_images`` user turns only."""
    kept = past[-history_turns:] if history_turns > 0 else []
    turns = [*kept, current]
    first_image = len(turns) - history_images
    msgs = list(head)
    for i, t in enumerate(turns):
        msgs.append(_user(t, with_image=i >= first_image))
        if t is not current:
            msgs.append({"role": "assistant", "content": t.response or ""})
    return msgs


def _decode_data_url(url: str) -> tuple[bytes, str]:
    head, _, b64 = url.partition(",")
    media_type = head[len(DATA_URL_PREFIX):].split(";")[0] or "application/octet-stream"
    return base64.b64decode(b64), media_type


Put = Callable[[bytes, str, str], dict[str, Any]]  # (data, ext, media_type) -> blob ref


def strip_images(messages: list[dict[str, Any]], put: Put) -> list[dict[str, Any]]:
    """A copy of ``messages`` with every image data URL stored through ``put`` and replaced by
    its ref (the screenshot blob of the observation is the same content, so it is stored once)."""
    out = copy.deepcopy(messages)
    for m in out:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            iu = part.get("image_url") if isinstance(part, dict) else None
            url = iu.get("url") if isinstance(iu, dict) else None
            if isinstance(url, str) and url.startswith(DATA_URL_PREFIX):
                data, media_type = _decode_data_url(url)
                ext = media_type.split("/")[-1] or "bin"
                part["image_url"] = {"blob": put(data, ext, media_type)}
    return out


def restore_images(messages: list[dict[str, Any]], read: Callable[[dict[str, Any]], bytes]) -> list[dict[str, Any]]:
    """The inverse of :func:`strip_images`: blob refs back to data URLs (``read(ref) -> bytes``)."""
    out = copy.deepcopy(messages)
    for m in out:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            iu = part.get("image_url") if isinstance(part, dict) else None
            if isinstance(iu, dict) and isinstance(iu.get("blob"), dict):
                ref = iu["blob"]
                part["image_url"] = image_part(read(ref), ref.get("media_type", "image/png"))["image_url"]
    return out
