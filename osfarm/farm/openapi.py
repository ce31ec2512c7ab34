"""The farm's OpenAPI document says every status a route can answer.

Route modules declare what is theirs (a lease's 410, a lease request's 429); the answers that
come from the app around them are added here, in one place, to every operation they apply to
(:func:`osfarm.http.openapi.document_responses`):

* 401 (missing or wrong token) on every route but the public ones, 503 while the farm starts or
  stops (the pool is not there yet);
* 400 (malformed JSON), 413 (body over ``max_body_bytes``) and 422 on routes that take a body;
* 403/404/410/422 on routes of one lease (another owner, no such lease, the lease ended, a bad
  header), 502/504 on routes that call the lease's guest (its server failed or did not answer);
* links from a granted lease's ``id`` to every route of one lease.

``tests/test_contract.py`` checks the result with schemathesis (``--checks all``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from osfarm.http.openapi import document_responses

ERROR_SCHEMA = {"title": "ErrorBody", "type": "object", "required": ["detail"], "properties": {"detail": {
    "type": "string", "title": "Detail",
    "description": "what went wrong, naming the offending field where there is one"}}}

AUTH = {401: "missing or wrong token", 503: "the farm is starting or stopping; retry after Retry-After"}
BODY = {400: "the body is not JSON (malformed)", 413: "the body is over the farm's limit (max_body_bytes)",
        422: "invalid input; the detail names the field"}
LEASE = {403: "the lease belongs to another owner (X-Osfarm-Owner), or the token is read-only (viewer)",
         404: "no such lease (another client's lease answers the same)",
         410: "the lease expired or was released, or its desktop crashed or did not survive a farm restart",
         422: "invalid input; the detail names the field"}
GUEST = {502: "the desktop's guest server failed or the connection to it dropped (retry)",
         504: "the desktop's guest server did not answer in time"}
# The routes that talk to the lease's guest server (the passthrough documents any status).
GUEST_ROUTES = ("/step", "/observation", "/screenshot", "/reset", "/evaluate")


def _rule(public_paths: tuple[str, ...]) -> Any:
    def rule(path: str, method: str, op: dict[str, Any]) -> dict[int, str]:
        out: dict[int, str] = {}
        if path not in public_paths:
            out.update(AUTH)
        if "requestBody" in op:
            out.update(BODY)
        if "{lease_id}" in path:
            out.update(LEASE)
            if path.endswith(GUEST_ROUTES):
                out.update(GUEST)
        return out

    return rule


def link_leases(schema: dict[str, Any]) -> None:
    """OpenAPI links from a granted lease (``POST /v1/desktops`` 201, its ``id``) to every route
    of one lease: a client generator (and schemathesis' stateful phase) can follow them."""
    granted = schema.get("paths", {}).get("/v1/desktops", {}).get("post", {}).get("responses", {}).get("201")
    if granted is None:
        return
    links = granted.setdefault("links", {})
    for path, item in schema["paths"].items():
        if "{lease_id}" not in path:
            continue
        for op in item.values():
            if isinstance(op, dict) and op.get("operationId"):
                links[op["operationId"]] = {"operationId": op["operationId"],
                                            "parameters": {"lease_id": "$response.body#/id"}}


def install(app: FastAPI, public_paths: tuple[str, ...]) -> None:
    """Serve the documented schema as the app's ``/openapi.json``."""
    document_responses(app, _rule(public_paths), ERROR_SCHEMA, extra=link_leases)
