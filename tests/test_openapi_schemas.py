"""The request schemas the farm and the guest document are the models their routes check with, and
each pattern in them says what its Python rule says (tested with jsonschema_rs, the validator
schemathesis judges requests with: ECMA 262 regexes). No farm or desktop is started;
tests/test_contract.py fuzzes the running farm with the same schemas."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from osfarm.evaluators.getters import GETTERS
from osfarm.evaluators.metrics import METRICS
from osfarm.farm.errors import ApiError
from osfarm.farm.task_routes import EvaluateRequest, ResetRequest, validate_task
from osfarm.farm.task_schema import FarmTask, RelativePath, TaskId
from osfarm.schema.actions import KEY_NAMES, CodeText, KeyName, MoveTo, parse_action, parse_actions
from osfarm.schema.guest import StepRequest
from osfarm.tasks.setup import SETUP_TYPES
from osfarm.tasks.task_paths import plain_name_problem, relative_problem

jsonschema_rs = pytest.importorskip("jsonschema_rs")


def schema_of(annotated: Any) -> dict[str, Any]:
    return annotated.__metadata__[0].json_schema


def valid(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema_rs.validator_for(schema).is_valid(value)


def resolve(defs: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    return defs[node["$ref"].rsplit("/", 1)[1]] if "$ref" in node else node


def test_a_step_documents_its_actions() -> None:
    schema = StepRequest.model_json_schema()
    item = schema["properties"]["actions"]["items"]
    kinds = item["anyOf"]
    assert kinds[0]["type"] == "string" and "pattern" in kinds[0]
    assert resolve(schema["$defs"], kinds[1])["required"] == ["code"]
    mapping = kinds[2]["discriminator"]["mapping"]
    assert len(set(mapping.values())) == len(mapping) == 16  # one schema per action_type
    click = resolve(schema["$defs"], resolve(schema["$defs"], {"$ref": mapping["CLICK"]})["properties"]["parameters"])
    assert click["additionalProperties"] is False and click["properties"]["x"]["minimum"] == 0


@pytest.mark.parametrize("model", [ResetRequest, EvaluateRequest])
def test_a_task_request_documents_the_task_this_farm_runs(model: type[Any]) -> None:
    schema = model.model_json_schema()
    defs = schema["$defs"]
    task = resolve(defs, schema["properties"]["task"])
    assert task["required"] == ["id", "instruction", "evaluator"]
    assert resolve(defs, task["properties"]["config"]["items"])["properties"]["type"]["enum"] == sorted(SETUP_TYPES)
    shapes = [resolve(defs, s) for s in task["properties"]["evaluator"]["anyOf"]]
    assert [s["required"] for s in shapes] == [["func"], ["func", "result"], ["func", "result"]]
    assert shapes[1]["properties"]["func"]["enum"] == sorted(METRICS)
    kinds = [resolve(defs, s)["properties"]["type"] for s in shapes[1]["properties"]["result"]["anyOf"]]
    getters = {g for kind in kinds for g in kind.get("enum", [kind.get("const")])}
    assert getters == set(GETTERS)
    assert schema["properties"]["cache_dir"]["not"] == {} and schema["required"] == ["task"]


def test_key_names_any_ascii_case() -> None:
    schema = schema_of(KeyName)
    samples = [*KEY_NAMES, *(k.upper() for k in KEY_NAMES), *(k.title() for k in KEY_NAMES),
               "", "hyperdrive", "enter\n", "a\n", "ctrl ", " ctrl", "\u212a", "\u212aey", "f25", "é", "\x7f", "\x1f"]
    for key in samples:
        try:
            parse_action({"action_type": "PRESS", "parameters": {"key": key}}, strict=True)
            ok = True
        except ValueError:
            ok = False
        assert valid(schema, key) is ok, repr(key)


def test_a_code_string_is_not_only_whitespace() -> None:
    assert not any(chr(c).isspace() for c in range(0x3001, sys.maxunicode + 1))  # what CodeText's pattern lists
    schema = schema_of(CodeText)
    for c in [*map(chr, range(0x3100)), "\ufeff", "\U0001f600"]:
        for text in (c, f" {c} "):
            assert valid(schema, text) is bool(text.strip()), repr(text)


def test_a_task_id_is_a_plain_name() -> None:
    schema = schema_of(TaskId)
    for name in ["a", "task-1", ".", "..", "...", ".a", "a/b", "a\\b", "a\0", "", "é" * 20, "\n", "..\n", "x" * 255]:
        assert valid(schema, name) is (plain_name_problem(name) is None), repr(name)


def test_a_file_of_the_episode_is_a_relative_path() -> None:
    schema = schema_of(RelativePath)
    for path in ["a", "a/b", "a/b/", "./a", "a/.", "...", "x..y", "..a", "a..", "", ".", "./", ".//.", "/a", "~a",
                 "..", "a/..", "../a", "a/../b", "a\n/..", "a\0", "\n", "a/\n/..\n"]:
        assert valid(schema, path) is (relative_problem(path) is None), repr(path)


def test_a_request_takes_values_as_the_schema_types_them() -> None:
    for x in (3, 3.0):
        parse_actions([{"action_type": "CLICK", "parameters": {"x": x, "y": 1}}], 10, 10, strict=True)
    for x in ("3", True, 3.5, None):
        with pytest.raises(ValueError, match="parameters.x"):
            parse_actions([{"action_type": "MOVE_TO", "parameters": {"x": x, "y": 1}}], 10, 10, strict=True)
    lax = parse_action({"action_type": "MOVE_TO", "parameters": {"x": "3", "y": 1}})  # as agents' replies are read
    assert isinstance(lax, MoveTo) and lax.parameters.x == 3
    with pytest.raises(ValueError, match="observe.quality"):
        StepRequest.model_validate({"actions": ["WAIT"], "observe": {"quality": "80"}})
    assert StepRequest.model_validate({"actions": ["WAIT"], "observe": {"quality": 80.0}}).observe.quality == 80


def task(**evaluator: Any) -> dict[str, Any]:
    return {"id": "t", "instruction": "", "evaluator": evaluator}


@pytest.mark.parametrize("data, needle", [
    (task(func="no_such_metric", result={"type": "vm_file"}), "$.evaluator.func: unknown metric 'no_such_metric'"),
    (task(func=["exact_match", "infeasible"], result=[{"type": "vm_file"}] * 2), "$.evaluator.func[1]: unknown metric"),
    (task(func="exact_match", result={"type": "warp"}), "$.evaluator.result.type: unknown getter 'warp'"),
    (task(func=["exact_match"], result=[{"type": "vm_file"}], expected=[{"type": "nope"}]),
     "$.evaluator.expected[0].type: unknown getter 'nope'"),
    ({**task(func="infeasible"), "config": [{"type": "warp", "parameters": {}}]},
     "$.config[0].type: unknown setup type"),
])
def test_a_task_naming_what_the_farm_does_not_run_is_422(data: dict[str, Any], needle: str) -> None:
    assert not valid(FarmTask.model_json_schema(), data)  # the schema refuses it too
    with pytest.raises(ApiError) as e:
        validate_task(data)
    assert e.value.status == 422 and needle in e.value.message, e.value.message
