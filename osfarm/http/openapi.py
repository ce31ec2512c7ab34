"""OpenAPI documents that say every status a server answers, for the farm, the guest and the
policy server alike.

FastAPI documents what a route declares; the answers that come from around the routes (a token
middleware's 401, a body limit's 413, malformed JSON's 400, the app's own error handlers) are not
in it. ``document_responses`` adds them once, by a rule per server, and ``allowed_methods`` gives
a 405 the whole ``Allow`` header (Starlette names only the first matching route's methods).
``tests/test_contract.py`` holds each server to its document with schemathesis (``--checks all``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
# (path, method, operation) -> {status: description} to add where the operation lacks them
Rule = Callable[[str, str, dict[str, Any]], dict[int, str]]


def document_responses(app: FastAPI, rule: Rule, error_schema: dict[str, Any],
                       extra: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Serve ``app``'s OpenAPI document with the statuses ``rule`` gives each operation (body:
    ``error_schema``, registered as the component ``ErrorBody`` unless the app has one);
    ``extra`` may edit the document further. Built once, on first use."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes, tags=app.openapi_tags, servers=app.servers)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.setdefault("ErrorBody", error_schema)
            ref = {"$ref": "#/components/schemas/ErrorBody"}
            for path, item in schema.get("paths", {}).items():
                for method, op in item.items():
                    if method not in METHODS or "default" in op.get("responses", {}):
                        continue  # a "default" answer already covers every status
                    responses = op.setdefault("responses", {})
                    for status, description in rule(path, method, op).items():
                        responses.setdefault(str(status), {"description": description,
                                                           "content": {"application/json": {"schema": ref}}})
            if extra is not None:
                extra(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _routes(routes: list[Any]) -> Iterator[Any]:
    """Every route, inside included routers too (FastAPI keeps them nested; ours have no prefix)."""
    for route in routes:
        nested = getattr(route, "original_router", None)
        if nested is not None:
            yield from _routes(nested.routes)
        else:
            yield route


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route of ``app`` serves on ``path``, for a 405's ``Allow`` header."""
    methods: set[str] = set()
    for route in _routes(app.router.routes):
        regex = getattr(route, "path_regex", None)
        route_methods = getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(path):
            methods.update(route_methods)
    return sorted(methods)
