"""Reading the loosely typed bodies of the guest's OSWorld routes (JSON objects and forms).

OSWorld's clients send hand-built JSON and forms, so these routes read fields one by one
instead of through pydantic models; every bad field answers 400 (or the given status) with
``{"detail": "<field>: <message>"}``.
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from fastapi import HTTPException, Request
from starlette.datastructures import FormData, UploadFile

from osfarm.desktop.box.commands import Command


def bad(field: str, message: str, status: int = 400) -> HTTPException:
    return HTTPException(status_code=status, detail=f"{field}: {message}")


async def json_object(request: Request) -> dict[str, Any]:
    body = await request.body()
    if not body.strip():
        raise bad("body", "expected a JSON object")
    try:
        data = json.loads(body)
    except ValueError as e:
        raise bad("body", f"invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad("body", f"expected a JSON object, got {type(data).__name__}")
    return data


def require_str(data: dict[str, Any], name: str) -> str:
    """A required, non-empty string field."""
    v = optional_str(data, name)
    if v is None:
        raise bad(name, "required")
    if not v:
        raise bad(name, "must not be empty")
    return v


def optional_str(data: dict[str, Any], name: str) -> str | None:
    """A string field that may be missing or null (None then)."""
    v = data.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad(name, f"expected a string, got {type(v).__name__}")
    return no_nul(name, v)


def no_nul(name: str, v: str) -> str:
    """Paths, commands and names never hold a NUL (the OS refuses them: a 500 otherwise)."""
    if "\x00" in v:
        raise bad(name, "must not contain a NUL character")
    return v


def get_bool(data: dict[str, Any], name: str, default: bool) -> bool:
    v = data.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"expected true or false, got {type(v).__name__}")
    return v


def get_num(data: dict[str, Any], name: str, default: float, lo: float = 0.0, hi: float = 3600.0) -> float:
    v = data.get(name, default)
    if v is None:
        return default
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise bad(name, f"expected a number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"expected a number, got {type(v).__name__}")
    if not lo < v <= hi:
        raise bad(name, f"must be in ({lo:g}, {hi:g}], got {v:g}")
    return float(v)


def form_str(form: FormData, name: str) -> str:
    """A required, non-empty text field of a form."""
    v = form.get(name)
    if not isinstance(v, str) or not v:
        raise bad(name, "required (form field)")
    return no_nul(name, v)


def form_file(form: FormData, name: str) -> UploadFile:
    """A required file part of a multipart form."""
    v = form.get(name)
    if v is None:
        raise bad(name, "required (multipart file part)")
    if not isinstance(v, UploadFile):
        raise bad(name, "expected a file part, got a plain form field")
    return v


def expand(path: str) -> str:
    """``~`` and ``$VARS`` expanded, as OSWorld's server does for every path it is given."""
    return os.path.expandvars(os.path.expanduser(path))



def get_command(data: dict[str, Any]) -> tuple[Command, bool]:
    """OSWorld's {command, shell}: a str is shlex-split unless shell; "~/" args are expanded."""
    shell = get_bool(data, "shell", False)
    if "command" not in data or data["command"] is None:
        raise bad("command", "required (a string or a list of strings)")
    command = data["command"]
    if isinstance(command, str):
        if not command.strip():
            raise bad("command", "must not be empty")
        no_nul("command", command)
        if not shell:
            try:
                command = shlex.split(command)
            except ValueError as e:
                raise bad("command", f"cannot split into arguments: {e}") from None
    elif isinstance(command, list):
        if not command:
            raise bad("command", "must not be empty")
        for i, arg in enumerate(command):
            if not isinstance(arg, str):
                raise bad(f"command.{i}", f"expected a string, got {type(arg).__name__}")
            no_nul(f"command.{i}", arg)
    else:
        raise bad("command", f"expected a string or a list of strings, got {type(command).__name__}")
    if isinstance(command, list):
        command = [os.path.expanduser(a) if a.startswith("~/") else a for a in command]
    return command, shell


def describe_command(command: Command) -> str:
    return command if isinstance(command, str) else " ".join(command)
