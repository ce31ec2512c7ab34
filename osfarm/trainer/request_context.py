"""A step's request read back as the chat the learner trains on.

Records keep each request and screenshot as a content-addressed blob next to the run; the
learner needs plain chat messages whose images it can open, and may train on a shorter context
than the agent sent (``context_turns``/``context_images``) to bound a sample's length.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

from osfarm.schema.episode import SchemaError
from osfarm.stream.blobs import BlobMissing, LocalBlobStore

# the placeholder the agent itself puts where it leaves an old screenshot out
OMITTED = "(screenshot omitted: an earlier step)"


def _is_ref(x: Any) -> bool:
    return isinstance(x, dict) and isinstance(x.get("sha256"), str) and isinstance(x.get("path"), str)


def image_bytes(url: str) -> bytes:
    """The bytes of a sample's image part URL: a data URL or a file path."""
    if url.startswith("data:"):
        return base64.b64decode(url.partition(",")[2])
    path = url.removeprefix("file://")
    return Path(path).read_bytes()


class RequestResolver:
    """Reads a record's blobs (relative to ``root``) and rewrites image refs for the learner."""

    def __init__(self, root: str, image_mode: str):
        self.store = LocalBlobStore(Path(root))
        self.image_mode = image_mode

    def request(self, req: Any) -> list[dict[str, Any]] | None:
        if req is None:
            return None
        if _is_ref(req):
            req = json.loads(self.store.get(req))
        if isinstance(req, dict) and "messages" in req:
            req = req["messages"]
        if not isinstance(req, list):
            raise SchemaError(
                f"a step's model.request holds {type(req).__name__}, expected a list of chat messages")
        return self.images(req)

    def _url(self, ref: dict[str, Any]) -> str:
        if self.image_mode == "path":
            p = self.store._path(ref)
            if not p.is_file():
                raise BlobMissing(f"blob {ref.get('sha256')} not found at {p}")
            return str(p.resolve())
        data = self.store.get(ref)
        return f"data:{ref.get('media_type', 'image/png')};base64,{base64.b64encode(data).decode('ascii')}"

    def images(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = copy.deepcopy(messages)
        for m in out:
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, list):
                continue
            for part in content:
                iu = part.get("image_url") if isinstance(part, dict) else None
                if isinstance(iu, dict) and _is_ref(iu.get("blob")):
                    part["image_url"] = {"url": self._url(iu["blob"])}
                elif isinstance(iu, dict) and _is_ref(iu.get("url")):
                    part["image_url"] = {"url": self._url(iu["url"])}
        return out


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def trim_context(messages: list[dict[str, Any]], turns: int | None, images: int | None) -> list[dict[str, Any]]:
    """Cut a step's request to its last ``turns`` (user, assistant) turns and last ``images`` screenshots.

    The head (system prompt, task) is everything before the first turn's user message (the one
    just before the first assistant message); the final user message is the current observation.
    Dropped screenshots become the same placeholder text the agent uses.
    """
    msgs = copy.deepcopy(messages)
    if turns is not None:
        asst = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
        if len(asst) > turns:
            first_user = asst[0] - 1 if asst[0] > 0 and msgs[asst[0] - 1].get("role") == "user" else asst[0]
            keep_from = asst[len(asst) - turns] - 1 if turns > 0 else asst[-1] + 1
            msgs = msgs[:first_user] + msgs[keep_from:]
    if images is not None:
        seen = 0
        for m in reversed(msgs):
            content = m.get("content")
            if not isinstance(content, list):
                continue
            for j in range(len(content) - 1, -1, -1):
                if _is_image(content[j]):
                    seen += 1
                    if seen > images:
                        content.pop(j)
            if content and not any(_is_image(p) for p in content) and not any(
                    isinstance(p, dict) and p.get("type") == "text" and p.get("text") for p in content) or not content:
                content.append({"type": "text", "text": OMITTED})
    return msgs
