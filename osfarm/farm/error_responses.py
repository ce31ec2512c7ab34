"""The error answers every desktop route documents in the OpenAPI (FastAPI's ``responses=``)."""

from __future__ import annotations

from typing import Any

from osfarm.schema.service import ErrorBody

# Responses every desktop route can give; listed once so the OpenAPI page documents them.
DESKTOP_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or wrong token"},
    403: {"model": ErrorBody, "description": "the lease belongs to another owner (X-Osfarm-Owner), or the "
          "token is read-only (viewer)"},
    404: {"model": ErrorBody, "description": "no such lease (another client's lease answers the same)"},
    410: {"model": ErrorBody, "description": "the lease expired or was released, or its desktop crashed"},
    422: {"model": ErrorBody, "description": "invalid input; the detail names the field"},
}
