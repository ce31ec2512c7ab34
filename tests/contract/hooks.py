"""schemathesis hooks for the farm's and the guest's contract runs (``hooks`` in their .toml).

A schema-valid body may still be refused with 422 for a rule JSON Schema cannot state: a point off
the lease's screen (the screen is the lease's, not the schema's), a ``result``/``expected``/
``options`` list shorter than the task's ``func`` list, a name over 255 bytes of UTF-8 (the schema
counts characters). The configs let the step and task routes answer 422 to valid data for that
reason only: this check fails every schema-valid request refused with 422 whose detail names
anything else, which is the schema and the server saying different things.
"""

from __future__ import annotations

import re
from typing import Any

import schemathesis

try:  # the coverage phase's request-shape probes, which schemathesis' own acceptance check skips
    from schemathesis.specs.openapi.checks import is_unexpected_http_status_case
except ImportError:  # pragma: no cover - a schemathesis that moved it

    def is_unexpected_http_status_case(case: Any) -> bool:
        return False


UNSTATABLE = re.compile(r"(is off screen \(screen is \d+x\d+\)|has \d+ entries but func has \d+"
                        r"|is longer than 255 bytes)$")
# A 422's detail lists its problems joined by "; ", each starting with the field it names.
PROBLEMS = re.compile(r"; (?=body\.|actions\.)")


@schemathesis.check
def valid_data_is_refused_only_for_what_json_schema_cannot_state(ctx: Any, response: Any, case: Any) -> bool | None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 422:
        return None
    if is_unexpected_http_status_case(case):
        return None
    try:
        detail = str(response.json().get("detail", ""))
    except (ValueError, AttributeError):
        detail = response.text
    stateable = [p for p in PROBLEMS.split(detail) if not UNSTATABLE.search(p)]
    if stateable:
        raise AssertionError("A schema-valid request was refused (422) for what its schema could say: "
                             + "; ".join(stateable))
    return None
