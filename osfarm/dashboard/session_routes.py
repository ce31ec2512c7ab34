"""The public part of ``/ui``: the login form, the logout form and the dashboard's own scripts and
stylesheet (served without a token: the login page needs its CSS, and they hold nothing secret)."""

from __future__ import annotations

import asyncio
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Form, Query, Request, Response
from fastapi.responses import RedirectResponse

from osfarm.dashboard import pages
from osfarm.dashboard.access import cookie_header, csrf_ok, safe_next, same_origin
from osfarm.dashboard.assets import ASSETS, media_type
from osfarm.dashboard.responses import PageRoute, error_page, page
from osfarm.dashboard.state import PageFrame, Tokens

LOGIN_FAILURE_DELAY_S = 0.5  # a wrong token costs the guesser a little time


router = APIRouter(tags=["dashboard"], include_in_schema=False, route_class=PageRoute)


@router.get("/ui/static/{name}")
async def static(name: str) -> Response:
    data = ASSETS.get(name)
    if data is None:
        return Response("not found", status_code=404, media_type="text/plain")
    return Response(data, media_type=media_type(name),
                    headers={"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"})


@router.get("/ui/login")
async def login_form(frame: PageFrame, next: Annotated[str | None, Query()] = None) -> Response:
    frame.principal = None  # the login page shows no session (it is public)
    return page(pages.render("login.html", frame, error=None, next=safe_next(next)))


@router.post("/ui/login")
async def login(request: Request, frame: PageFrame, tokens: Tokens, token: Annotated[str, Form(max_length=4096)] = "",
                next: Annotated[str | None, Form(max_length=2048)] = None) -> Response:
    frame.principal = None
    if not same_origin(request):
        return error_page(request, 403, "login refused: the form was posted from another site")
    who = tokens.resolve(token.strip()) if token.strip() else None
    if who is None:
        await asyncio.sleep(LOGIN_FAILURE_DELAY_S)
        html = pages.render("login.html", frame, error="unknown token", next=safe_next(next))
        return page(html, 401)
    resp = RedirectResponse(safe_next(next), status_code=303)
    secure = request.url.scheme == "https"
    resp.headers.append("set-cookie", cookie_header(quote(token.strip(), safe=""), secure=secure))
    resp.headers["Cache-Control"] = "no-store"
    return resp


@router.post("/ui/logout")
async def logout(request: Request, csrf: Annotated[str, Form(max_length=200)] = "") -> Response:
    if not same_origin(request) or not csrf_ok(request, csrf):
        return error_page(request, 403, "logout refused: stale or missing form token; reload the page")
    resp = RedirectResponse("/ui/login", status_code=303)
    resp.headers.append("set-cookie", cookie_header("", secure=request.url.scheme == "https", max_age=0))
    return resp
