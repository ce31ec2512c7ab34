"""Every host path a task file names, confined: task files are hostile input.

A task runs on the farm's host as much as in its desktop: its ``id`` names folders
(``cache/<id>/``, ``<out>/<domain>/<id>/``), ``execute`` steps save their output under the names
in ``stdout``/``stderr``, getters save fetched files under ``dest``, ``cache_file`` reads
``path``, ``upload_file`` reads ``local_path``, and ``download``/``cloud_file`` URLs may be
``file://`` or plain paths. Unchecked, ``"id": "../../etc"`` or ``"stdout": "/etc/cron.d/x"`` write
where the farm's user may write, and ``file:///etc/shadow`` uploads the host's secrets into the
desktop the agent controls. So:

* **statically**, when a task is parsed (:func:`task_path_problems`, called by
  :func:`osfarm.tasks.model.parse_task`): the id must be a plain name, and every name the task
  gives to a file on the host must be relative, without ``..``; an error names the task file and
  the JSON path (``calc/x.json: $.config[2].parameters.stdout: ...``), so a suite refuses the task
  (an ``infra_error`` episode) and the farm API answers 422;
* **at run time**, every path is opened through :func:`inside` (under a per-episode or cache
  folder; symlinks refused on the way) or :func:`readable_inside` (a file to read must resolve
  inside the configured roots: the suite and the file cache), raising :class:`TaskPathError`.
  These live in the layer-neutral :mod:`osfarm.host_paths` (the evaluators confine with them
  too) and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from osfarm.host_paths import (
    MAX_NAME,
    TaskPathError,
    inside,
    open_for_writing,
    readable_inside,
    relative_problem,
    write_inside,
)

# Step types whose parameters name host files, and which keys.
_OUTPUT_KEYS = ("stdout", "stderr")  # execute / command: saved in the episode's folder
_EXECUTE_TYPES = ("execute", "command")


# -- the rules --------------------------------------------------------------------------------------


def plain_name_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a task id (a folder name on the host), or None."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if value in (".", "..") or "/" in value or "\\" in value or "\0" in value:
        return (f"{value!r} must be a plain name (no slash, backslash or NUL; not '.' or '..'): "
                "it names folders on the host")
    if len(value.encode()) > MAX_NAME:
        return f"is longer than {MAX_NAME} bytes"
    return None


def _getters(evaluator: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for key in ("result", "expected"):
        spec = evaluator.get(key)
        if isinstance(spec, dict):
            yield f"$.evaluator.{key}", spec
        elif isinstance(spec, list):
            for i, g in enumerate(spec):
                if isinstance(g, dict):
                    yield f"$.evaluator.{key}[{i}]", g


def _steps(data: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    evaluator = data.get("evaluator")
    post = evaluator.get("postconfig") if isinstance(evaluator, dict) else None
    for where, steps in (("$.config", data.get("config")), ("$.evaluator.postconfig", post)):
        if isinstance(steps, list):
            for i, step in enumerate(steps):
                if isinstance(step, dict):
                    yield f"{where}[{i}]", step


def task_path_problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    """``(JSON path, problem)`` for every host path of a task JSON object that is not confined."""
    out: list[tuple[str, str]] = []
    if (why := plain_name_problem(data.get("id"))) is not None:
        out.append(("$.id", why))
    for where, step in _steps(data):
        params = step.get("parameters")
        if not isinstance(params, dict):
            continue
        if step.get("type") in _EXECUTE_TYPES:
            for key in _OUTPUT_KEYS:
                if params.get(key) and (why := relative_problem(params[key])) is not None:
                    out.append((f"{where}.parameters.{key}", why))
        if step.get("type") == "upload_file" and isinstance(params.get("files"), list):
            for j, f in enumerate(params["files"]):
                if isinstance(f, dict) and "local_path" in f and \
                        (why := relative_problem(f["local_path"], "the suite or the file cache")) is not None:
                    out.append((f"{where}.parameters.files[{j}].local_path", why))
    evaluator = data.get("evaluator")
    if isinstance(evaluator, dict):
        for where, getter in _getters(evaluator):
            dest = getter.get("dest")
            names = dest if isinstance(dest, list) else [dest] if dest is not None else []
            for k, name in enumerate(names):
                if (why := relative_problem(name)) is not None:
                    out.append((f"{where}.dest" + (f"[{k}]" if isinstance(dest, list) else ""), why))
            if getter.get("type") == "cache_file" and (why := relative_problem(getter.get("path"))) is not None:
                out.append((f"{where}.path", why))
    return out


__all__ = ["TaskPathError", "inside", "open_for_writing", "plain_name_problem", "readable_inside",
           "relative_problem", "task_path_problems", "write_inside"]
