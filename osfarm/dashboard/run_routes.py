"""``/ui`` pages of the runs root: leaderboard, run, episode, compare, training, and the run files
those pages show (screenshots, a11y trees, recordings).

Handlers are plain ``def``: they read files, so FastAPI runs them in its thread pool, off the
event loop. Every run-dir path goes through :class:`~osfarm.dashboard.confined.ConfinedDir`; a
file is served only with a media type from :data:`~osfarm.dashboard.links.MEDIA_TYPES` (images,
video, text), never as HTML or SVG, and under a sandboxing CSP. A run the runs root refuses is a
404 page (:class:`~osfarm.dashboard.responses.PageRoute`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from posixpath import splitext
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import RedirectResponse, StreamingResponse

from osfarm.dashboard import pages
from osfarm.dashboard.confined import Refused
from osfarm.dashboard.links import MEDIA_TYPES
from osfarm.dashboard.responses import PageRoute, page
from osfarm.dashboard.runs import RunsRoot
from osfarm.dashboard.state import DashboardOf, PageFrame, Runs

FILE_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; media-src 'self'; img-src 'self'; sandbox",
    "Cache-Control": "private, max-age=60",
    "Accept-Ranges": "bytes",
}
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
CHUNK = 256 << 10

Key = Annotated[str, Query(alias="r", max_length=1024, description="run, relative to the runs root")]


router = APIRouter(tags=["dashboard"], include_in_schema=False, route_class=PageRoute)


@router.get("/ui/")
def home(dash: DashboardOf, frame: PageFrame) -> Response:
    if dash.runs is not None and not dash.farm:
        return RedirectResponse("/ui/runs", status_code=303)
    return page(pages.render("home.html", frame))


@router.get("/ui")
def home_slash() -> Response:
    return RedirectResponse("/ui/", status_code=308)


@router.get("/ui/runs")
def leaderboard(root: Runs, frame: PageFrame) -> Response:
    return page(pages.leaderboard(root, frame))


@router.get("/ui/run")
def run(root: Runs, frame: PageFrame, key: Key) -> Response:
    return page(pages.run_page(root, frame, key))


@router.get("/ui/episode")
def episode(root: Runs, frame: PageFrame, key: Key, e: Annotated[str, Query(max_length=512)]) -> Response:
    return page(pages.episode_page(root, frame, key, e))


@router.get("/ui/compare")
def compare(root: Runs, frame: PageFrame, a: Annotated[str, Query(max_length=1024)],
            b: Annotated[str, Query(max_length=1024)]) -> Response:
    return page(pages.compare_page(root, frame, a, b))


@router.get("/ui/training")
def training(root: Runs, frame: PageFrame, key: Key) -> Response:
    return page(pages.training_page(root, frame, key))


@router.get("/ui/file")
def run_file(request: Request, root: Runs, key: Key, p: Annotated[str, Query(max_length=2048)]) -> Response:
    try:
        rel = root.run_file(key, p)
    except Refused as err:  # a file, not a page: its refusal is plain text too
        return Response(str(err), status_code=404, media_type="text/plain", headers=FILE_HEADERS)
    return serve_file(root, rel, request.headers.get("range"))


def serve_file(root: RunsRoot, rel: str, range_header: str | None) -> Response:
    """A run file, confined and typed by its extension; one byte range when asked (video seeking)."""
    media = MEDIA_TYPES.get(splitext(rel)[1].lower())
    if media is None:
        return Response("the dashboard serves images, videos and text from run dirs only", status_code=403,
                        media_type="text/plain", headers=FILE_HEADERS)
    st = root.dir.stat(rel)
    if st is None:
        return Response(f"{rel}: not found, or not a regular file inside the runs root", status_code=404,
                        media_type="text/plain", headers=FILE_HEADERS)
    size = st.st_size
    start, end, status = 0, size - 1, 200
    m = _RANGE.match(range_header.strip()) if range_header else None
    if m and (m.group(1) or m.group(2)):
        if m.group(1):
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
        else:  # the last N bytes
            start = max(0, size - int(m.group(2)))
        if start > end or start >= size:
            return Response(status_code=416, headers={**FILE_HEADERS, "Content-Range": f"bytes */{size}"})
        status = 206
    length = max(0, end - start + 1)

    def body() -> Iterator[bytes]:
        with root.dir.open(rel) as (fd, _st):
            pos, left = start, length
            while left > 0:
                chunk = os.pread(fd, min(left, CHUNK), pos)
                if not chunk:
                    return
                yield chunk
                pos += len(chunk)
                left -= len(chunk)

    headers = {**FILE_HEADERS, "Content-Length": str(length)}
    if status == 206:
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    return StreamingResponse(body(), status_code=status, media_type=media, headers=headers)
