"""The ``osfarm.episode/1`` trajectory record: its pydantic model and the validator readers use
(the stream's sinks write it, the runner, the trainer and the dashboard read it).

One JSON object per finished episode (../DESIGN.md). Writers may add fields (a reader keeps
them); a change that breaks readers bumps the major version, and a reader refuses a major
version it does not know with a message that says which one it knows.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from osfarm.errors import OsfarmError
from osfarm.schema.guest import ActionTiming

SCHEMA = "osfarm.episode/1"
SCHEMA_MAJOR = 1
STATUSES = ("success", "failure", "infra_error", "timeout")
_SCHEMA_RE = re.compile(r"^osfarm\.episode/(\d+)(?:\.(\d+))?$")


class SchemaError(OsfarmError, ValueError):
    """A record that is not a valid ``osfarm.episode/1`` object; the message names the field."""


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # newer minor versions add fields; keep them


class BlobRef(_Open):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    path: str
    media_type: str
    size: int = Field(ge=0)


class ObservationBlobs(_Open):
    """A step's observation as the record keeps it: its images and a11y tree as blobs."""

    screenshot: BlobRef | None = None
    a11y: BlobRef | None = None


class ModelCall(_Open):
    """The model call behind a step: what an agent reports (``Agent.last_model_call``, the request
    as chat messages) and what the record keeps of it (the request as a blob, the fields down to
    ``policy_version``)."""

    request: BlobRef | dict[str, Any] | list[Any] | None = None
    response_text: str | None = None
    response_token_ids: list[int] | None = None
    response_logprobs: list[Any] | None = None  # per token: a float, or {token, logprob, top_logprobs}
    policy_version: int | None = None
    # the agent's report only (a record leaves them out): the model's name, the call's wall time,
    # why it failed, why its reply gave no action, why generation stopped, the server's token usage
    model: str | None = None
    t_ms: float | None = None
    error: str | None = None
    parse_error: str | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


class Step(_Open):
    index: int = Field(ge=1)
    observation: ObservationBlobs
    model: ModelCall | None
    actions: list[Any]
    action_error: str | None
    t_model_ms: float
    t_env_ms: float


class Policy(_Open):
    name: str | None = None
    version_start: int | None = None
    version_end: int | None = None


class Desktop(_Open):
    provider: str | None = None
    image: str | None = None
    session: str | None = None  # gnome or light (osfarm.desktop.session.gnome); absent in older records


class EpisodeRecord(_Open):
    schema_: str = Field(alias="schema")
    episode_id: str
    run_id: str
    task_id: str
    domain: str
    group_id: str
    attempt: int = Field(ge=1)
    agent: str
    policy: Policy
    desktop: Desktop
    status: Literal["success", "failure", "infra_error", "timeout"]
    score: float
    error: str | None
    started_at: str
    finished_at: str
    steps: list[Step]
    # how the agent's actions were paced: "osworld" (OSWorld's python -c per action, pyautogui's
    # 0.1 s pause), "settle" or "fast" (schema.guest.ActionTiming); absent in records written before it existed
    action_timing: ActionTiming | None = None
    repeat: int | None = Field(default=None, ge=1)  # which of `osfarm eval --repeats K` (1..K); absent without repeats


def schema_major(schema: Any) -> int:
    """The major version of a ``schema`` field; SchemaError when it is not an osfarm episode schema."""
    m = _SCHEMA_RE.match(schema) if isinstance(schema, str) else None
    if m is None:
        raise SchemaError(f"not an osfarm episode record: field 'schema' is {schema!r}, expected {SCHEMA!r}")
    return int(m.group(1))


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(x) for x in loc) or "(record)"


def read_record(rec: Any) -> EpisodeRecord:
    """Validate an episode record and return it as the model, for code that reads its fields
    (fields a newer minor version adds are kept as extras); raises SchemaError naming the field."""
    if not isinstance(rec, dict):
        raise SchemaError(f"an episode record must be a JSON object, got {type(rec).__name__}")
    major = schema_major(rec.get("schema"))
    if major != SCHEMA_MAJOR:
        raise SchemaError(f"unsupported episode schema {rec.get('schema')!r} (major version {major}); "
                          f"this reader knows {SCHEMA} — upgrade osfarm to read it")
    try:
        return EpisodeRecord.model_validate(rec)
    except ValidationError as e:
        missing = [_where(x["loc"]) for x in e.errors() if x["type"] == "missing"]
        if missing:
            raise SchemaError(f"episode {rec.get('episode_id')!r}: missing fields {missing}") from None
        first = e.errors()[0]
        loc = _where(first["loc"])
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise SchemaError(f"episode {rec.get('episode_id')!r}: field {loc}: {first['msg']}{more}") from None


def check_record(rec: Any) -> dict[str, Any]:
    """Validate an episode record and return it unchanged (the dict), for code that passes it on as
    JSON (sinks, streams, files), which must write what it was given; raises SchemaError naming the field."""
    read_record(rec)
    return rec


def parse_record(line: str | bytes) -> dict[str, Any]:
    """One JSON text (a JSONL line or a stream entry) to a validated record."""
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise SchemaError(f"not JSON: {e}") from None
    return check_record(rec)
