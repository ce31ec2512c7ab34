"""Task model, suites, coverage and the `osfarm tasks` sub-app, on real OSWorld task files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from osfarm.tasks import Evaluator, Task, TaskError, load_suite, load_task, parse_task
from osfarm.tasks.cli import tasks_app
from osfarm.tasks.coverage import UNSUPPORTED, coverage, coverage_of_suite, implemented

# shared/ lies beside the checkout (as in CI): ../shared/osworld
OSWORLD = Path(__file__).resolve().parents[2] / "shared" / "osworld"
TASK_FILES = sorted((OSWORLD / "tasks").glob("*/*.json"))
TSV = OSWORLD / "test_all_index.tsv"



def _sample(name: str = "libreoffice_calc") -> Path:
    return next(p for p in TASK_FILES if p.parent.name == name)


def _write(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def _suite_dir(tmp_path: Path, names: list[str]) -> Path:
    """Copy some real tasks into tmp_path/<domain>/<id>.json."""
    root = tmp_path / "suite"
    for n in names:
        src = _sample(n)
        (root / n).mkdir(parents=True, exist_ok=True)
        shutil.copy(src, root / n / src.name)
    return root


# ---- model --------------------------------------------------------------------------------------


def test_osworld_fixtures_are_present() -> None:
    # Without them the parametrized tests below would collect nothing and pass vacuously.
    assert len(TASK_FILES) >= 8, f"OSWorld task fixtures missing under {OSWORLD}"
    assert TSV.exists()


@pytest.mark.parametrize("path", TASK_FILES, ids=lambda p: p.parent.name)
def test_every_real_task_loads_validates_and_round_trips(path: Path) -> None:
    task = load_task(path)
    raw = json.loads(path.read_text())
    assert task.domain == path.parent.name
    assert task.id == path.stem == raw["id"]
    # same keys, same values, same order
    assert json.dumps(task.to_json()) == json.dumps(raw)
    assert task.dumps() == path.read_text().rstrip("\n")
    assert isinstance(task.evaluator, Evaluator)
    assert [c.type for c in task.config] == [c["type"] for c in raw.get("config", [])]


def test_typed_views_of_a_list_evaluator() -> None:
    task = load_task(_sample("libreoffice_writer"))
    ev = task.evaluator
    assert ev.funcs == ["compare_docx_files", "compare_subscript_contains"]
    assert isinstance(ev.result, list) and len(ev.result) == 2
    assert {g.type for g in ev.getters()} == {"vm_file", "cloud_file"}
    assert ev.result[0].path == "/home/user/Desktop/H2O_Factsheet_WA.docx"  # extra keys kept


def test_unknown_keys_are_kept_and_dumped(tmp_path: Path) -> None:
    raw = json.loads(_sample().read_text())
    raw["my_extension"] = {"a": [1, 2]}
    raw["evaluator"]["result"]["mystery"] = True
    raw["config"][0]["note"] = "x"
    task = parse_task(raw)
    assert task.to_json() == raw
    assert task.my_extension == {"a": [1, 2]}


def test_infeasible_task_needs_no_result() -> None:
    task = load_task(_sample("os"))
    assert task.evaluator.is_infeasible and task.evaluator.result is None


def _errors(raw: dict, file: str = "tasks/calc/abc.json") -> list[str]:
    with pytest.raises(TaskError) as e:
        parse_task(raw, file)
    return [str(i) for i in e.value.issues]


def test_malformed_task_names_file_and_json_path(tmp_path: Path) -> None:
    raw = json.loads(_sample("libreoffice_writer").read_text())
    raw["evaluator"]["result"][1] = {"path": "/x"}  # no "type"
    path = _write(tmp_path / "libreoffice_writer" / f"{raw['id']}.json", raw)
    with pytest.raises(TaskError) as e:
        load_task(path)
    assert [str(i) for i in e.value.issues] == [f"{path}: $.evaluator.result[1].type: Field required"]


def test_wrong_types_are_not_coerced() -> None:
    raw = json.loads(_sample().read_text())
    raw["config"][1]["type"] = 3
    raw["instruction"] = ["not", "a", "string"]
    errs = _errors(raw)
    assert any(e.startswith("tasks/calc/abc.json: $.config[1].type: ") for e in errs)
    assert any(e.startswith("tasks/calc/abc.json: $.instruction: ") for e in errs)


def test_keys_osworld_never_reads_take_any_value_and_proxy_warns() -> None:
    # OSWorld's runner reads id, instruction, config, evaluator and proxy (by truthiness) only.
    raw = json.loads(_sample().read_text())
    raw.update(source=["https://a.example/q", "https://b.example"], snapshot=None, trajectory=7,
               related_apps="chrome", fixed_ip="no", possibility_of_env_change=None, proxy="false")
    del raw["snapshot"]
    task = parse_task(raw, "tasks/calc/abc.json")
    assert task.to_json() == raw and task.source == raw["source"]
    assert task.apps == ["chrome"] and task.uses_proxy is True  # "false" is truthy, as in OSWorld
    (w,) = [str(x) for x in task.warnings]
    assert w.startswith("tasks/calc/abc.json: $.proxy: proxy should be true or false, got str")


def test_func_list_shorter_than_result_runs_as_osworld_indexes_it() -> None:
    raw = json.loads(_sample("libreoffice_writer").read_text())
    ev = raw["evaluator"]
    ev["result"].append({"type": "vm_file", "path": "/x", "dest": "x"})
    ev["expected"].append({"type": "rule", "rules": {}})
    ev["options"] = [{}, {}, {"ignore_case": True}]
    task = parse_task(raw, "f.json")
    assert task.to_json() == raw  # kept as read
    assert [str(w).split(": has")[0] for w in task.warnings] == [
        "f.json: $.evaluator.result[2]", "f.json: $.evaluator.expected[2]", "f.json: $.evaluator.options[2]"]
    assert "never evaluated" in str(task.warnings[0]) and "asserts equal lengths" in str(task.warnings[0])
    assert task.evaluator.aligned("result") == task.evaluator.result[:2]
    assert task.evaluator.aligned("options") == [{}, {}]
    assert len(task.evaluator.getters()) == 4  # the third result/expected is never fetched


def test_every_osworld_example_loads() -> None:
    # The 369 task files of OSWorld's current index, as OSWorld publishes them.
    suite = load_suite(OSWORLD / "examples", strict=False)
    assert len(suite) == 369 and suite.refused == []
    assert len(load_suite(OSWORLD / "examples")) == 369  # strict too
    warned = {w.file.rsplit("/", 1)[-1] for w in suite.warnings}
    assert warned == {"b070486d-e161-459b-aa2b-ef442d973b92.json"}
    vs = suite["ea98c5d7-3cf9-4f9b-8ad3-366b58e0fcae"]
    assert isinstance(vs.source, list) and vs.to_json() == json.loads(vs.path.read_text())


def test_missing_required_key() -> None:
    raw = json.loads(_sample().read_text())
    del raw["instruction"]
    assert _errors(raw) == ["tasks/calc/abc.json: $.instruction: Field required"]


@pytest.mark.parametrize(
    ("change", "path", "words"),
    [
        ({"result": [{"type": "vm_file"}]}, "$.evaluator.result", "has 1 entries but func has 2"),
        ({"options": {}}, "$.evaluator.options", "must be a list of 2"),
        ({"expected": [None]}, "$.evaluator.expected", "has 1 entries"),
    ],
)
def test_index_aligned_list_rule(change: dict, path: str, words: str) -> None:
    raw = json.loads(_sample("libreoffice_writer").read_text())
    raw["evaluator"].update(change)
    errs = _errors(raw)
    assert len(errs) == 1 and errs[0].startswith(f"tasks/calc/abc.json: {path}: ") and words in errs[0]


def test_list_rule_allows_null_expected_and_options() -> None:
    raw = json.loads(_sample("libreoffice_writer").read_text())
    raw["evaluator"]["expected"][1] = None
    raw["evaluator"]["options"] = [{}, None]
    task = parse_task(raw)
    assert task.evaluator.expected[1] is None and task.to_json() == raw


def test_single_func_with_list_result_is_an_error() -> None:
    raw = json.loads(_sample().read_text())
    raw["evaluator"]["result"] = [raw["evaluator"]["result"]]
    assert _errors(raw) == ["tasks/calc/abc.json: $.evaluator.result: is a list but func is a single name"]


def test_bad_json_names_file_line_and_column(tmp_path: Path) -> None:
    p = tmp_path / "chrome" / "x.json"
    p.parent.mkdir()
    p.write_text('{\n  "id": "x",\n  "snapshot": oops\n}\n')
    with pytest.raises(TaskError) as e:
        load_task(p)
    assert str(e.value).startswith(f"{p}:3:15: invalid JSON: ")


def test_id_must_match_file_name(tmp_path: Path) -> None:
    raw = json.loads(_sample().read_text())
    p = _write(tmp_path / "libreoffice_calc" / "other.json", raw)
    with pytest.raises(TaskError, match=r"\$\.id: id .* does not match the file name 'other.json'"):
        load_task(p)


# ---- suite --------------------------------------------------------------------------------------


def test_suite_without_index_loads_all_files_sorted() -> None:
    suite = load_suite(OSWORLD / "tasks")
    assert len(suite) == len(TASK_FILES)
    assert [t.domain for t in suite] == [p.parent.name for p in TASK_FILES]
    assert all(isinstance(t, Task) for t in suite)


def test_suite_follows_index_order_and_ignores_unlisted(tmp_path: Path) -> None:
    root = _suite_dir(tmp_path, ["vlc", "chrome", "gimp"])
    vlc, chrome = _sample("vlc").stem, _sample("chrome").stem
    index = _write(tmp_path / "idx.json", {"vlc": [vlc], "chrome": [chrome]})
    suite = load_suite(root, index)
    assert [t.id for t in suite] == [vlc, chrome]
    assert suite.domains() == ["vlc", "chrome"]
    assert suite.index() == {"vlc": [vlc], "chrome": [chrome]}
    assert suite[vlc].domain == "vlc"


def test_index_entry_without_file_names_index_and_id(tmp_path: Path) -> None:
    root = _suite_dir(tmp_path, ["vlc"])
    index = _write(tmp_path / "idx.json", {"vlc": [_sample("vlc").stem, "no-such-task"]})
    with pytest.raises(TaskError) as e:
        load_suite(root, index)
    (issue,) = e.value.issues
    assert str(issue).startswith(f"{index}: $.vlc[1]: task no-such-task has no file")


def test_suite_reports_every_bad_file(tmp_path: Path) -> None:
    root = _suite_dir(tmp_path, ["vlc", "chrome"])
    (root / "chrome" / "broken.json").write_text("{")
    raw = json.loads(_sample("vlc").read_text())
    raw["evaluator"]["func"] = 7
    _write(root / "vlc" / _sample("vlc").name, raw)
    with pytest.raises(TaskError) as e:
        load_suite(root)
    text = str(e.value)
    assert f"{root / 'chrome' / 'broken.json'}:1:2: invalid JSON" in text
    assert "$.evaluator.func: Input should be a valid string" in text


def test_lenient_suite_lists_refused_tasks_and_loads_the_rest(tmp_path: Path) -> None:
    root = _suite_dir(tmp_path, ["vlc", "chrome", "gimp"])
    (root / "chrome" / "broken.json").write_text("{")
    raw = json.loads(_sample("vlc").read_text())
    raw["evaluator"]["func"] = 7
    _write(root / "vlc" / _sample("vlc").name, raw)
    index = _write(tmp_path / "idx.json", {"vlc": [_sample("vlc").stem], "chrome": [_sample("chrome").stem, "broken"],
                                           "gimp": [_sample("gimp").stem, "ghost"]})
    suite = load_suite(root, index, strict=False)
    assert [t.id for t in suite] == [_sample("chrome").stem, _sample("gimp").stem]
    refused = {r.task_id: r for r in suite.refused}
    assert set(refused) == {_sample("vlc").stem, "broken", "ghost"}
    assert refused["broken"].domain == "chrome" and refused["broken"].file == root / "chrome" / "broken.json"
    assert f"{root / 'chrome' / 'broken.json'}:1:2: invalid JSON" in refused["broken"].error
    assert "$.evaluator.func: Input should be a valid string" in refused[_sample("vlc").stem].error
    assert f"{index}: $.gimp[1]: task ghost has no file" in refused["ghost"].error
    with pytest.raises(TaskError) as e:  # strict: the same issues, raised together
        load_suite(root, index)
    assert len(e.value.issues) == 3


def test_osworld_layout_examples_plus_test_all(tmp_path: Path) -> None:
    ee = tmp_path / "evaluation_examples"
    ee.mkdir()
    _suite_dir(tmp_path, ["gimp", "os"]).rename(ee / "examples")
    _write(ee / "test_all.json", {"os": [_sample("os").stem], "gimp": [_sample("gimp").stem]})
    suite = load_suite(ee)
    assert [t.domain for t in suite] == ["os", "gimp"]
    assert suite.index_file == ee / "test_all.json"


# ---- coverage -----------------------------------------------------------------------------------


def test_coverage_of_the_osworld_tsv_index() -> None:
    cov = coverage(TSV)
    assert cov.n_tasks == 369
    table = cov.get("metric", "compare_table")
    assert table is not None and table.uses == 62
    assert len(cov.of("metric")) == 111
    assert cov.get("setup", "download").uses == 278
    assert cov.get("setup", "execute").uses == 154
    assert cov.get("getter", "vm_command_line").uses >= 27
    gd = cov.get("setup", "googledrive")
    assert gd.uses == 8 and gd.status == "unsupported" and gd.reason == UNSUPPORTED["googledrive"]
    # status follows the live registry, whatever has been built so far
    expected = "implemented" if "compare_table" in implemented("metric") else "missing"
    assert table.status == expected
    assert cov.live_web_tasks > 0
    # Every getter and metric of OSWorld's test_all is implemented or explicitly unsupported.
    assert [(n.kind, n.name) for n in cov.needs if n.status == "missing"] == []
    ocr = cov.get("metric", "compare_image_text")
    assert ocr.status == "implemented"  # with the ocr extra (tests/test_ocr.py: without it)
    assert cov.summary("getter") == {"implemented": 41, "unsupported": 1, "missing": 0}
    assert cov.summary("metric") == {"implemented": 111, "unsupported": 0, "missing": 0}


def test_coverage_of_a_suite_counts_postconfig_and_expected(tmp_path: Path) -> None:
    root = _suite_dir(tmp_path, ["libreoffice_writer"])
    raw = json.loads(_sample("libreoffice_writer").read_text())
    raw["evaluator"]["func"] = ["compare_docx_files", "no_such_metric_xyz"]
    _write(root / "libreoffice_writer" / _sample("libreoffice_writer").name, raw)
    cov = coverage_of_suite(load_suite(root))
    assert cov.n_tasks == 1
    assert cov.get("getter", "vm_file").uses == 2 and cov.get("getter", "cloud_file").uses == 2
    assert cov.get("metric", "no_such_metric_xyz").status == "missing"
    post = [c["type"] for c in raw["evaluator"]["postconfig"]] + [c["type"] for c in raw["config"]]
    assert sum(n.uses for n in cov.of("setup")) == len(post)


# ---- CLI ----------------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_validate_ok_and_errors(tmp_path: Path) -> None:
    ok = runner.invoke(tasks_app, ["validate", str(OSWORLD / "tasks")])
    assert ok.exit_code == 0 and f"ok: {len(TASK_FILES)} tasks" in ok.output
    root = _suite_dir(tmp_path, ["vlc", "gimp"])
    raw = json.loads(_sample("gimp").read_text())
    del raw["evaluator"]["result"]["type"]
    bad = _write(root / "gimp" / _sample("gimp").name, raw)
    index = _write(tmp_path / "idx.json", {"vlc": [_sample("vlc").stem, "ghost"], "gimp": [_sample("gimp").stem]})
    res = runner.invoke(tasks_app, ["validate", str(root), "--index", str(index)])
    assert res.exit_code == 1
    assert f"{index}: $.vlc[1]: task ghost has no file" in res.output
    assert f"{bad}: $.evaluator.result.type: Field required" in res.output


def test_cli_validate_and_coverage_of_the_osworld_examples() -> None:
    res = runner.invoke(tasks_app, ["validate", str(OSWORLD / "examples")])
    assert res.exit_code == 0, res.output
    assert "ok: 369 tasks in 10 domains, 2 warning(s)" in res.output
    assert "warning: " in res.output
    assert "b070486d-e161-459b-aa2b-ef442d973b92.json: $.evaluator.result[2]" in res.output
    res = runner.invoke(tasks_app, ["coverage", str(OSWORLD / "examples"), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["n_tasks"] == 369 and data["refused"] == []
    assert all(s["missing"] == 0 for s in data["summary"].values()), data["summary"]


def test_cli_ls(tmp_path: Path) -> None:
    res = runner.invoke(tasks_app, ["ls", str(OSWORLD / "tasks"), "--domain", "libreoffice_writer"])
    assert res.exit_code == 0
    assert _sample("libreoffice_writer").stem in res.output
    assert "compare_docx_files+compare_subscript_contains" in res.output
    assert _sample("vlc").stem not in res.output


def test_cli_coverage_tables_and_json() -> None:
    res = runner.invoke(tasks_app, ["coverage", str(TSV)])
    assert res.exit_code == 0
    assert "369 tasks" in res.output and "compare_table" in res.output and "unsupported, because" in res.output
    res = runner.invoke(tasks_app, ["coverage", str(TSV), "--json"])
    data = json.loads(res.output)
    assert data["n_tasks"] == 369
    (row,) = [m for m in data["needs"]["metric"] if m["name"] == "compare_table"]
    assert row["uses"] == 62


def test_cli_coverage_of_bad_suite_exits_1(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.json").write_text("[1,")
    res = runner.invoke(tasks_app, ["coverage", str(tmp_path)])
    assert res.exit_code == 1 and ":1:4: invalid JSON" in res.output


@pytest.mark.parametrize("cmd", [[], ["validate"], ["ls"], ["coverage"]])
def test_cli_help(cmd: list[str]) -> None:
    res = runner.invoke(tasks_app, [*cmd, "--help"])
    assert res.exit_code == 0 and "Usage" in res.output
