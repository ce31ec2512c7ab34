"""What every policy server route answers with besides its model: the policy version header and
the OpenAI-style error body (documented in the OpenAPI as ``ErrorBody``)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from osfarm.policy.schemas import error_body

VERSION_HEADER = "X-Policy-Version"

# What the routes answer besides their success, in the OpenAPI document (tests/test_contract.py
# holds the server to it): the OpenAI-style error body of error_response.
ERROR_DOC: dict[str, Any] = {"title": "ErrorBody", "type": "object", "required": ["error"], "properties": {
    "error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": "integer"}}},
    "detail": {"description": "pydantic's errors of an invalid request"}}}


def error_response(status: int, message: str, param: str | None, version: int | None = None,
                   detail: Any = None) -> JSONResponse:
    """The OpenAI error body (``error.param`` names the field), with the policy version if given."""
    headers = {VERSION_HEADER: str(version)} if version is not None else None
    return JSONResponse(error_body(message, param, status, detail), status_code=status, headers=headers)
