"""The guest's OpenAPI document (``/v1/openapi.json``) says what every route takes and answers.

The OSWorld-compatible routes read OSWorld's loose bodies field by field (request_fields.py), so
FastAPI cannot see their payloads: this module declares them (JSON objects, forms, the upload's
multipart), the media type of each success (PNG, MP4, a file's bytes, plain text) and the error
answers each route gives, the way OSWorld's clients send and read them. The native ``/v1`` routes
have pydantic models; they get the error shape the guest really answers (``{"detail": str}``)
instead of FastAPI's list of validation errors. ``tests/test_contract.py`` holds the guest to it
with schemathesis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from osfarm.http.openapi import document_responses

JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data"
TEXT = "text/plain"

ERROR_SCHEMA = {"title": "ErrorBody", "type": "object", "required": ["detail"], "properties": {
    "detail": {"type": "string", "description": "what went wrong, naming the offending field"}}}
# OSWorld's own error replies differ per route ({"error", "detail"}, {"status", "message"}, text)
_ANY_OBJECT = {"type": "object"}
_TEXT = {"type": "string"}

_STR = {"type": ["string", "null"], "description": "null: as if absent"}
_NONEMPTY = {"type": "string", "minLength": 1}
_BOOL = {"type": ["boolean", "null"]}
_COMMAND = {"anyOf": [_NONEMPTY, {"type": "array", "items": {"type": "string"}, "minItems": 1}],
            "description": "a command line (split with shlex unless shell) or its argv"}


def _num(hi: float) -> dict[str, Any]:
    """A number in (0, hi]; OSWorld's clients also send numbers as strings, and null means the default."""
    return {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": hi},
                      {"type": "string", "pattern": r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$"}, {"type": "null"}]}


def _obj(props: dict[str, Any], required: tuple[str, ...] = (), nullable: bool = False) -> dict[str, Any]:
    return {"type": ["object", "null"] if nullable else "object", "properties": props, "required": list(required)}


@dataclass
class OsworldRoute:
    body: tuple[str, dict[str, Any]] | None = None  # (media type, schema)
    ok: str = JSON  # media type of the success
    errors: dict[int, str] = field(default_factory=dict)  # status -> media type of the error body


_BAD = {400: JSON}
_CMD_ERRORS = {400: JSON}
ROUTES: dict[tuple[str, str], OsworldRoute] = {
    ("post", "/execute"): OsworldRoute((JSON, _obj({"command": _COMMAND, "shell": _BOOL, "timeout": _num(3600)},
                                                   ("command",))), errors=_CMD_ERRORS),
    ("post", "/execute_with_verification"): OsworldRoute((JSON, _obj({
        "command": _COMMAND, "shell": _BOOL, "max_wait_time": _num(3600), "check_interval": _num(60),
        "verification": _obj({"window_exists": _STR, "command_success": _STR}, nullable=True)}, ("command",))),
        errors={400: JSON, 500: JSON}),  # 500: verification failed (OSWorld's answer)
    ("post", "/setup/launch"): OsworldRoute((JSON, _obj({"command": _COMMAND, "shell": _BOOL}, ("command",))),
                                            ok=TEXT, errors=_CMD_ERRORS),
    ("post", "/run_python"): OsworldRoute((JSON, _obj({"code": _NONEMPTY}, ("code",))), errors=_BAD),
    ("post", "/run_bash_script"): OsworldRoute((JSON, _obj({"script": _NONEMPTY, "timeout": _num(3600),
                                                             "working_dir": _STR}, ("script",))), errors=_BAD),
    ("get", "/screenshot"): OsworldRoute(ok="image/png"),
    ("get", "/accessibility"): OsworldRoute(),
    ("get", "/terminal"): OsworldRoute(),
    ("post", "/screen_size"): OsworldRoute(),
    ("post", "/window_size"): OsworldRoute((FORM, _obj({"app_class_name": _NONEMPTY}, ("app_class_name",))),
                                           errors={400: JSON, 404: JSON}),
    ("get", "/cursor_position"): OsworldRoute(),
    ("get", "/platform"): OsworldRoute(ok=TEXT),
    ("post", "/desktop_path"): OsworldRoute(errors={404: JSON}),
    ("post", "/wallpaper"): OsworldRoute(ok="image/png", errors={404: JSON}),
    ("post", "/setup/change_wallpaper"): OsworldRoute((JSON, _obj({"path": _NONEMPTY}, ("path",))), ok=TEXT,
                                                      errors={400: JSON, 404: JSON, 500: JSON}),
    ("post", "/list_directory"): OsworldRoute((JSON, _obj({"path": _NONEMPTY}, ("path",))),
                                              errors={400: JSON, 404: JSON}),
    ("post", "/file"): OsworldRoute((FORM, _obj({"file_path": _NONEMPTY}, ("file_path",))),
                                    ok="application/octet-stream", errors={400: JSON, 404: JSON, 413: JSON}),
    ("post", "/setup/upload"): OsworldRoute((MULTIPART, _obj({"file_path": _NONEMPTY, "file_data": {
        "type": "string", "format": "binary"}}, ("file_path", "file_data"))), ok=TEXT, errors={400: JSON}),
    ("post", "/setup/download_file"): OsworldRoute((JSON, _obj({"url": _NONEMPTY, "path": _NONEMPTY}, ("url", "path"))),
                                                   ok=TEXT, errors={400: JSON, 500: TEXT}),  # 500: OSWorld's
    ("post", "/setup/open_file"): OsworldRoute((JSON, _obj({"path": _NONEMPTY, "window_name": _STR,
                                                            "timeout_seconds": _num(1800)}, ("path",))), ok=TEXT,
                                               errors={400: JSON, 404: JSON, 500: JSON, 503: JSON, 504: JSON}),
    ("post", "/setup/activate_window"): OsworldRoute((JSON, _obj({"window_name": _NONEMPTY, "strict": _BOOL,
                                                                  "by_class": _BOOL}, ("window_name",))), ok=TEXT,
                                                     errors={400: JSON, 404: JSON}),
    ("post", "/start_recording"): OsworldRoute(errors={400: JSON, 409: JSON, 500: JSON, 503: JSON}),
    ("post", "/end_recording"): OsworldRoute(ok="video/mp4", errors={400: JSON, 404: JSON, 409: JSON, 500: JSON}),
}
ROUTES[("post", "/setup/execute")] = ROUTES[("post", "/execute")]
ROUTES[("post", "/setup/execute_with_verification")] = ROUTES[("post", "/execute_with_verification")]
ROUTES[("post", "/setup/close_window")] = ROUTES[("post", "/setup/activate_window")]


def _rule(path: str, method: str, op: dict[str, Any]) -> dict[int, str]:
    out = {401: "missing or wrong token", 413: "the body is over the guest's limit"}
    if "requestBody" in op or (method, path) in ROUTES and ROUTES[(method, path)].body:
        out[400] = "a bad field (the detail names it); malformed JSON"
    if path.startswith("/v1/"):
        out[422] = "invalid input; the detail names the field"
    return out


# native routes whose success is not JSON
IMAGES = {("get", "/v1/screenshot"): ("image/png", "image/jpeg", "image/webp")}


def _describe_osworld(schema: dict[str, Any]) -> None:
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            route = ROUTES.get((method, path))
            responses = op.setdefault("responses", {})
            # FastAPI documents its list of validation errors; the guest answers {"detail": str}
            for status, answer in responses.items():
                if status in ("400", "422"):
                    answer["content"] = {JSON: {"schema": error_ref}}
            if (method, path) in IMAGES:
                responses["200"]["content"] = {m: {"schema": {"type": "string", "format": "binary"}}
                                               for m in IMAGES[(method, path)]}
            if route is None:
                continue
            if route.body is not None:
                media, body = route.body
                op["requestBody"] = {"required": True, "content": {media: {"schema": body}}}
            ok = responses.setdefault("200", {"description": "OSWorld's answer"})
            binary = not route.ok.startswith(("application/json", "text/"))
            ok["content"] = {route.ok: {"schema": {"type": "string", "format": "binary"} if binary
                                        else (_TEXT if route.ok == TEXT else {})}}
            for status, media in route.errors.items():
                responses[str(status)] = {"description": "OSWorld's error answer",
                                          "content": {media: {"schema": _TEXT if media == TEXT else _ANY_OBJECT}}}


def install(app: FastAPI) -> None:
    """Serve the documented schema as the guest's ``/v1/openapi.json``."""
    document_responses(app, _rule, ERROR_SCHEMA, extra=_describe_osworld)
