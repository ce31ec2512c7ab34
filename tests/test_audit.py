"""`osfarm tasks audit`: every category on a small suite, real desktops of the shared farm."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from osfarm.farm.server import FarmServer
from osfarm.runner.audit import NO_VSCODE, needs_vscode, static_verdict
from osfarm.runner.audit_cli import audit_command
from osfarm.tasks.filecache import FileCache
from osfarm.tasks.model import parse_task

tasks_app = typer.Typer()
tasks_app.command("audit")(audit_command)
tasks_app.command("unused")(lambda: None)  # two commands: typer keeps "audit" as a sub-command name


def _task(tid: str, evaluator: dict, config: list | None = None) -> dict:
    return {"id": tid, "snapshot": "os", "instruction": f"task {tid}", "source": "", "config": config or [],
            "evaluator": evaluator}


ECHO = {"type": "vm_command_line", "command": "echo yes", "shell": True}
RULE = {"type": "rule", "rules": {"expected": "yes\n"}}
TASKS = {
    # the desktop already is as the task wants: noop scores 1
    "free": _task("free", {"func": "exact_match", "result": ECHO, "expected": RULE}),
    # noop 0, fail 0
    "fine": _task("fine", {"func": "exact_match", "result": ECHO,
                           "expected": {"type": "rule", "rules": {"expected": "no"}}}),
    "infeasible": _task("infeasible", {"func": "infeasible"}),
    # a setup step that fails on a fresh desktop
    "badsetup": _task("badsetup", {"func": "exact_match", "result": ECHO, "expected": RULE},
                      [{"type": "open", "parameters": {"path": "/home/user/missing.docx"}}]),
    # an evaluator that crashes: its rule lacks the key the metric reads
    "badeval": _task("badeval", {"func": "exact_match", "result": ECHO, "expected": {"type": "rule", "rules": {}}}),
    "app": _task("app", {"func": "exact_match", "result": ECHO, "expected": RULE},
                 [{"type": "launch", "parameters": {"command": ["no-such-editor-xyz", "--new-window"]}}]),
    "drive": _task("drive", {"func": "exact_match", "result": ECHO, "expected": RULE},
                   [{"type": "googledrive",
                     "parameters": {"settings_file": "x", "operation": ["delete"], "args": [{}]}}]),
    "nometric": _task("nometric", {"func": "no_such_metric", "result": ECHO}),
    "download": _task("download", {"func": "exact_match", "result": ECHO, "expected": RULE},
                      [{"type": "download", "parameters": {"files": [
                          {"url": "https://hf-mirror.com/datasets/x/resolve/main/a.xlsx",
                           "path": "/home/user/a.xlsx"}]}}]),
    "web": _task("web", {"func": "exact_match", "result": ECHO, "expected": RULE},
                 [{"type": "chrome_open_tabs", "parameters": {"urls_to_open": ["https://www.example.org/x"]}}]),
    # a package the desktop lacks: its setup says so on the desktop (one it has would just run)
    "apt": _task("apt", {"func": "exact_match", "result": ECHO, "expected": RULE},
                 [{"type": "execute",
                   "parameters": {"command": "echo {CLIENT_PASSWORD} | sudo -S apt-get install -y sysstat",
                                  "shell": True}}]),
    # a download no package stands in for: decided from the file
    "wget": _task("wget", {"func": "exact_match", "result": ECHO, "expected": RULE},
                  [{"type": "execute", "parameters": {"command": ["wget", "-q", "https://www.example.org/a.sh"]}}]),
}


def test_audit_classifies_every_task_and_writes_reports(farm: FarmServer, tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    (suite / "os").mkdir(parents=True)
    for tid, data in TASKS.items():
        if tid != "wget":
            (suite / "os" / f"{tid}.json").write_text(json.dumps(data))
    (suite / "os" / "garbled.json").write_text('{"id": "garbled", "instruction": 3}')
    out = tmp_path / "audit"
    r = CliRunner().invoke(tasks_app, ["audit", str(suite), "--out", str(out), "--envs", "2", "--no-progress",
                                       "--url", farm.url, "--token", farm.token, "--time-limit", "120"])
    assert r.exit_code == 1, r.output  # free points and broken tasks were found
    assert "12 tasks; 7 can run on a desktop here" in r.output
    data = json.loads((out / "audit.json").read_text())
    got = {t["task_id"]: (t["category"], t["reason"]) for t in data["tasks"]}
    assert {k: v[0] for k, v in got.items()} == {
        "free": "free-points", "fine": "ok", "infeasible": "ok", "badsetup": "broken", "badeval": "broken",
        "app": "unsupported", "drive": "unsupported", "nometric": "unsupported", "download": "needs-network",
        "web": "needs-network", "apt": "needs-network", "garbled": "broken"}
    assert got["free"][1] == "noop (DONE at once) scores 1 on a feasible task"
    assert "noop: setup:" in got["badsetup"][1] and "missing.docx" in got["badsetup"][1]
    assert "noop: evaluate:" in got["badeval"][1] and "exact_match" in got["badeval"][1]
    assert got["app"][1].startswith("the desktop has no 'no-such-editor-xyz'")
    assert got["drive"][1].startswith("setup googledrive: unsupported, because it needs a Google account")
    assert got["nometric"][1] == "metric no_such_metric: not implemented in osfarm"
    assert "1 file(s) not in the cache: https://hf-mirror.com/datasets/x/resolve/main/a.xlsx at " \
           "$.config[0].parameters.files[0].url" in got["download"][1]
    assert got["web"][1] == "opens the live web page https://www.example.org/x"
    assert got["apt"][1].startswith("noop: setup step 0 (execute) failed: ") and got["apt"][1].endswith(
        "$.config[0]: needs the network: apt package 'sysstat' is not installed and this farm is offline "
        "(`sudo -S apt-get install -y sysstat`)")
    assert "$.instruction" in got["garbled"][1]
    infeasible = next(t for t in data["tasks"] if t["task_id"] == "infeasible")
    assert infeasible["runs"]["fail"]["score"] == 1.0 and infeasible["runs"]["noop"]["score"] == 0.0
    assert data["counts"] == {"free-points": 1, "broken": 3, "unsupported": 3, "needs-network": 3, "ok": 2}
    html = (out / "audit.html").read_text()
    assert "free-points" in html and "badsetup" in html and "<script" not in html
    assert "free-points: os/free: noop" in r.output  # the console lists what needs a look


def test_audit_without_runnable_tasks_needs_no_desktop(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    (suite / "os").mkdir(parents=True)
    for tid in ("download", "web", "drive", "wget"):
        (suite / "os" / f"{tid}.json").write_text(json.dumps(TASKS[tid]))
    out = tmp_path / "audit"
    # a farm URL that nothing listens on: it must not be needed
    r = CliRunner().invoke(tasks_app, ["audit", str(suite), "--out", str(out), "--no-progress",
                                       "--url", "http://127.0.0.1:9", "--token", "x"])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "audit.json").read_text())
    assert data["counts"]["needs-network"] == 3 and data["counts"]["unsupported"] == 1
    got = {t["task_id"]: t["reason"] for t in data["tasks"]}
    assert got["wget"] == ("its setup runs `wget -q https://www.example.org/a.sh`, which fetches "
                           "https://www.example.org/a.sh (wget) from the internet")


def test_vscode_tasks_without_code_server_or_with_the_marketplace(tmp_path: Path, monkeypatch) -> None:
    """A task that starts `code` (or asks it in a getter) is unsupported where code-server is not
    installed, before its downloads are looked at; where it is, a task that needs an extension from
    the marketplace needs the network (a task that ships its .vsix runs)."""
    import osfarm.runner.audit as audit

    launch = _task("vs1", {"func": "exact_match", "result": ECHO, "expected": RULE},
                   [{"type": "download", "parameters": {"files": [
                       {"url": "https://hf-mirror.com/datasets/x/resolve/main/a.py", "path": "/home/user/a.py"}]}},
                    {"type": "launch", "parameters": {"command": ["code", "/home/user/a.py"]}}])
    getter = _task("vs2", {"func": "check_include_exclude", "result": {
        "type": "vm_command_line", "command": ["code", "--list-extensions", "|", "grep", "x.y"]},
        "expected": {"type": "rule", "rules": {"include": ["x.y"]}}})
    setup = _task("vs3", {"func": "exact_match", "result": ECHO, "expected": RULE},
                  [{"type": "command", "parameters": {"command": ["code", "--install-extension", "ms-python.python"]}}])
    vsix = {**getter, "id": "vs4", "config": [{"type": "execute", "parameters": {
        "command": ["code", "--install-extension", "/home/user/test.vsix"]}}]}
    plain = parse_task(TASKS["fine"])
    assert needs_vscode(parse_task(launch)) and needs_vscode(parse_task(getter)) and not needs_vscode(plain)
    cache = FileCache(tmp_path / "cache")
    monkeypatch.setattr(audit, "CODE_SERVER", tmp_path / "absent")
    assert static_verdict(parse_task(launch), cache) == ("unsupported", NO_VSCODE)
    assert static_verdict(parse_task(getter), cache) == ("unsupported", NO_VSCODE)
    assert "code-server" in NO_VSCODE and "setup-vscode.sh" in NO_VSCODE
    (tmp_path / "cs").mkdir()
    (tmp_path / "cs" / ".installed").write_text("x")
    monkeypatch.setattr(audit, "CODE_SERVER", tmp_path / "cs")
    assert static_verdict(parse_task(launch), cache)[0] == "needs-network"  # its download, not VS Code
    # the marketplace is the network (Open VSX for code-server): a farm with it runs these
    assert static_verdict(parse_task(getter), cache) == ("needs-network", audit.NO_MARKETPLACE)
    assert static_verdict(parse_task(setup), cache) == (
        "needs-network", "its setup runs `code --install-extension ms-python.python`, which fetches the VS Code "
        "extension ms-python.python (marketplace) from the internet")
    assert static_verdict(parse_task(vsix), cache) is None
