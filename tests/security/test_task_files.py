"""Hostile task files (issue 13, red team): a task names host paths (its id, ``execute`` output,
getter ``dest``, ``cache_file``, ``upload_file`` sources, ``file://`` and plain-path URLs), ships a
suite cache with symlinks out of it, downloads through redirects to ``file://`` or from a server
that never finishes, and makes the agent's "result" a 100 GB sparse file or a zip bomb. Each must
be held: refused with an error naming the task file and JSON path (an ``infra_error`` episode), or
scored as the agent's failure, with nothing written or read outside the episode's folders and the
farm still serving."""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from osfarm.cli import app
from osfarm.farm.server import FarmServer
from osfarm.http.download import DownloadPolicy
from osfarm.tasks.controller import GuestController
from osfarm.tasks.filecache import AssetMissing, FileCache, cache_name
from osfarm.tasks.model import TaskError, load_task, parse_task
from osfarm.tasks.setup import SetupExecutor, SetupFailed
from osfarm.tasks.suite import load_suite
from osfarm.tasks.task_paths import TaskPathError
from osfarm.testing.asset_server import AssetServer, asset_server

MINI = Path(__file__).resolve().parents[2] / "suites" / "mini"
INFEASIBLE = "5f0e4b1c-8d3a-4c6e-9a21-3b7f1d2e0a03"
PWNED = Path("/tmp/osfarm-redteam-pwned")  # where a hostile id would have written


def task(tid: str = "t1", config: list[dict[str, Any]] | None = None, **evaluator: Any) -> dict[str, Any]:
    return {"id": tid, "instruction": "i", "config": config or [], "evaluator": evaluator or {"func": "infeasible"}}


def execute(**params: Any) -> dict[str, Any]:
    return {"type": "execute", "parameters": {"command": "id", **params}}


def vm_file(dest: Any, path: Any = "/home/user/r.xlsx") -> dict[str, Any]:
    return {"func": "compare_table", "result": {"type": "vm_file", "path": path, "dest": dest},
            "expected": {"type": "rule", "rules": {}}}


HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("id with ..", task("../../../tmp/osfarm-redteam-pwned"), "$.id"),
    ("id with /", task("cron.d/x"), "$.id"),
    ("id ..", task(".."), "$.id"),
    ("stdout absolute", task(config=[execute(stdout="/etc/cron.d/osfarm-x")]), "$.config[0].parameters.stdout"),
    ("stderr ..", task(config=[execute(stderr="../../.bashrc")]), "$.config[0].parameters.stderr"),
    ("postconfig stdout", task(func="infeasible", postconfig=[execute(stdout="/root/x")]),
     "$.evaluator.postconfig[0].parameters.stdout"),
    ("upload absolute", task(config=[{"type": "upload_file", "parameters": {"files": [
        {"local_path": "/etc/shadow", "path": "/home/user/s"}]}}]), "$.config[0].parameters.files[0].local_path"),
    ("upload ..", task(config=[{"type": "upload_file", "parameters": {"files": [
        {"local_path": "../../../etc/shadow", "path": "/home/user/s"}]}}]),
     "$.config[0].parameters.files[0].local_path"),
    ("dest absolute", task(**vm_file("/etc/cron.d/osfarm-x")), "$.evaluator.result.dest"),
    ("dest ..", task(**vm_file("../../escaped")), "$.evaluator.result.dest"),
    ("multi dest", task(func="compare_table", result={"type": "vm_file", "multi": True, "path": ["/a", "/b"],
                                                       "dest": ["ok.xlsx", "/tmp/escaped"]},
                        expected={"type": "rule", "rules": {}}), "$.evaluator.result.dest[1]"),
    ("cache_file ..", task(func="exact_match", result={"type": "cache_file", "path": "../../../etc/passwd"},
                           expected={"type": "rule", "rules": {"expected": "x"}}), "$.evaluator.result.path"),
]


@pytest.mark.parametrize(("name", "data", "where"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_paths_are_refused_naming_file_and_json_path(name: str, data: dict[str, Any], where: str) -> None:
    with pytest.raises(TaskError) as e:
        parse_task(data, file="suite/os/evil.json")
    assert f"suite/os/evil.json: {where}: " in str(e.value), str(e.value)


def test_plain_names_and_subfolders_still_load() -> None:
    ok = task("0f5d2a10-0000-4000-8000-000000000001", config=[execute(stdout="out/cmd.txt", stderr="err.txt")],
              **vm_file("sub/result.xlsx"))
    assert parse_task(ok).id == ok["id"]


def test_a_suite_refuses_hostile_files_and_indexes(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    (suite / "os").mkdir(parents=True)
    good = json.loads((MINI / "os" / f"{INFEASIBLE}.json").read_text())
    (suite / "os" / f"{INFEASIBLE}.json").write_text(json.dumps(good))
    (suite / "os" / "evil.json").write_text(json.dumps(task("../evil", config=[execute(stdout="/etc/cron.d/x")])))
    s = load_suite(suite, strict=False)
    assert [t.id for t in s.tasks] == [INFEASIBLE]
    (refused,) = s.refused
    assert f"{suite / 'os' / 'evil.json'}: $.id: " in refused.error
    assert f"{suite / 'os' / 'evil.json'}: $.config[0].parameters.stdout: " in refused.error
    with pytest.raises(TaskError, match=r"evil\.json: \$\.id"):
        load_task(suite / "os" / "evil.json")
    # an index may not reach out of the suite through its domains or ids
    (tmp_path / "secret.json").write_text(json.dumps(task("secret")))
    for index in ({"os": ["../../secret"]}, {"../..": ["secret"]}):
        (suite / "test_all.json").write_text(json.dumps(index))
        with pytest.raises(TaskError, match="plain name"):
            load_suite(suite, suite / "test_all.json", strict=False)


# ---------------------------------------------------------------- the file cache (host files)


def test_file_urls_and_local_paths_only_from_the_cache_and_suite(tmp_path: Path) -> None:
    suite, root, outside = tmp_path / "suite", tmp_path / "cache", tmp_path / "secret"
    (suite / "assets").mkdir(parents=True)
    (suite / "assets" / "ok.txt").write_text("suite file")
    outside.mkdir()
    (outside / "key").write_text("host secret")
    fc = FileCache(root, suite_dir=suite, offline=True)
    assert fc.fetch("assets/ok.txt", "t").read_text() == "suite file"
    assert fc.fetch((suite / "assets" / "ok.txt").as_uri(), "t").read_text() == "suite file"
    for url in ("file:///etc/passwd", (outside / "key").as_uri(), "/etc/passwd", str(outside / "key"),
                "assets/../../secret/key"):
        with pytest.raises(TaskPathError, match="outside the folders task files may be read from"):
            fc.fetch(url, "t")
    with pytest.raises(TaskPathError, match="plain name"):
        fc.fetch("https://example.invalid/a.txt", "../../secret")


def test_a_suite_cache_cannot_link_out_of_itself(tmp_path: Path) -> None:
    """A third-party suite ships its cache: symlinks in it must not read or write host files."""
    root, victim = tmp_path / "cache", tmp_path / "victim.txt"
    victim.write_text("do not touch")
    (root / "t").mkdir(parents=True)
    url = "https://example.invalid/data/a.xlsx"
    (root / "t" / cache_name(url, "a.xlsx")).symlink_to("/etc/passwd")
    (root / "url_map.json").write_text(json.dumps({"https://example.invalid/m": "/etc/passwd"}))
    fc = FileCache.with_map_file(root, root / "url_map.json", offline=True)
    with pytest.raises(TaskPathError, match="outside"):
        fc.fetch(url, "t", name="a.xlsx")
    with pytest.raises(TaskPathError, match="outside"):
        fc.fetch("https://example.invalid/m", "t")
    # a planted .part (the downloader resumes into it) or a task dir that is a symlink: refused
    online = FileCache(root, policy=DownloadPolicy(allowed_hosts=("127.0.0.1",)))
    target = "http://127.0.0.1:9/b.bin"
    (root / "t" / (cache_name(target, "b.bin") + ".part")).symlink_to(victim)
    with pytest.raises(TaskPathError, match="symlink"):
        online.fetch(target, "t")
    (root / "linked").symlink_to(tmp_path)
    with pytest.raises(TaskPathError, match="symlink"):
        online.fetch(target, "linked")
    assert victim.read_text() == "do not touch"


@pytest.fixture(scope="module")
def srv() -> Iterator[AssetServer]:
    with asset_server({"/ok.txt": b"fine"}) as s:
        yield s


def test_downloads_never_leave_http_and_never_run_forever(srv: AssetServer, tmp_path: Path) -> None:
    """The task's download goes through osfarm.http.download (H-G's policy), once, from the cache."""
    fc = FileCache(tmp_path / "cache", policy=DownloadPolicy(allowed_hosts=("127.0.0.1",), timeout_s=2))
    assert fc.fetch(srv.url("/ok.txt"), "t").read_bytes() == b"fine"
    with pytest.raises(AssetMissing, match="only http and https URLs are downloaded, not 'file'"):
        fc.fetch(srv.url("/to-file"), "t")  # a 302 to file:///etc/passwd
    t0 = time.monotonic()
    with pytest.raises(AssetMissing, match="did not finish within 2 s"):
        fc.fetch(srv.url("/slow/never"), "t")  # one byte a second, forever
    assert time.monotonic() - t0 < 30
    with pytest.raises(AssetMissing, match="non-public address"):  # the default policy: no loopback at all
        FileCache(tmp_path / "c2").fetch(srv.url("/ok.txt"), "t")
    left = list((tmp_path / "cache" / "t").iterdir())
    assert not [p for p in left if "passwd" in p.name]
    # what the endless one sent so far is kept as a bounded .part (resumed by the next try), nothing else
    assert all(p.stat().st_size < 100 for p in left if p.name.endswith(".part"))


# ---------------------------------------------------------------- on a real desktop


@pytest.fixture(scope="module")
def lease(farm: FarmServer, api: httpx.Client) -> Iterator[str]:
    r = api.post("/v1/desktops", json={"ttl_s": 600})
    assert r.status_code == 201, r.text
    yield r.json()["id"]
    api.delete(f"/v1/desktops/{r.json()['id']}")


def test_setup_outputs_stay_in_the_episode_dir(farm: FarmServer, lease: str, tmp_path: Path) -> None:
    episode, victim = tmp_path / "episode", tmp_path / "victim.txt"
    episode.mkdir()
    victim.write_text("do not touch")
    ctl = GuestController(base_url=f"{farm.url}/v1/desktops/{lease}/guest", token=farm.token)
    try:
        setup = SetupExecutor(ctl, FileCache(tmp_path / "cache", offline=True), "t", (1024, 768), output_dir=episode)
        # what a task file cannot say (parse_task refuses it) is refused again at run time
        for bad in ("/etc/cron.d/osfarm-x", "../victim.txt"):
            with pytest.raises(SetupFailed, match=r"task\.json: \$\.config\[0\]\.parameters") as e:
                setup.run([execute(stdout=bad)], where="task.json: $.config")
            assert isinstance(e.value.__cause__, TaskPathError)
        (episode / "out.txt").symlink_to(victim)  # a symlink on the way: never followed
        with pytest.raises(SetupFailed, match="symlink"):
            setup.run([execute(stdout="out.txt")])
        setup.run([execute(command="echo fine", shell=True, stdout="sub/ok.txt")])
        assert (episode / "sub" / "ok.txt").read_text() == "fine\n"
    finally:
        ctl.close()
    assert victim.read_text() == "do not touch" and not Path("/etc/cron.d/osfarm-x").exists()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize(("name", "make"), [
    ("100 GB sparse file", "truncate -s 100G /home/user/result.xlsx"),
    # a real zip bomb: 600 MB of zeros in a 0.6 MB .xlsx (the agent can write it with Python)
    ("zip bomb", ("python3 -c \"import zipfile\nwith zipfile.ZipFile('/home/user/result.xlsx', 'w', "
                  "zipfile.ZIP_DEFLATED) as z, z.open('xl/worksheets/sheet1.xml', 'w', force_zip64=True) as f:\n"
                  " [f.write(bytes(1 << 20)) for _ in range(600)]\"")),
])
def test_a_huge_result_scores_zero_and_the_farm_keeps_serving(api: httpx.Client, lease: str, name: str,
                                                               make: str) -> None:
    t = task("redteam-huge", config=[execute(command=make, shell=True)],
             func="compare_table", result={"type": "vm_file", "path": "/home/user/result.xlsx", "dest": "result.xlsx"},
             expected={"type": "vm_file", "path": "/home/user/result.xlsx", "dest": "expected.xlsx"})
    r = api.post(f"/v1/desktops/{lease}/reset", json={"task": t})
    assert r.status_code == 200, r.text
    probe = api.post(f"/v1/desktops/{lease}/guest/setup/execute",
                     json={"command": "stat -c %s /home/user/result.xlsx", "shell": True})
    assert int(probe.json()["output"]) >= (100 << 30 if "sparse" in name else 1 << 19), probe.text
    before = _peak_rss_mb()
    t0 = time.monotonic()
    r = api.post(f"/v1/desktops/{lease}/evaluate", json={"task": t})
    assert r.status_code == 200 and r.json()["score"] == 0.0, r.text  # the agent's failure, not a crash
    assert time.monotonic() - t0 < 120
    assert _peak_rss_mb() - before < 300, "the evaluation read the agent's file into memory"
    assert api.get("/healthz").json()["ready"] and api.get(f"/v1/desktops/{lease}").status_code == 200


def test_an_eval_run_records_hostile_tasks_as_infra_errors(farm: FarmServer, tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    (suite / "os").mkdir(parents=True)
    shutil.copy(MINI / "os" / f"{INFEASIBLE}.json", suite / "os")
    files = {
        "evil-id": task("../../../tmp/osfarm-redteam-pwned"),
        "evil-stdout": task("evil-stdout", config=[execute(stdout="/etc/cron.d/osfarm-x")]),
        "evil-dest": task("evil-dest", **vm_file("../../escaped.xlsx")),
        # passes the static check (a file:// URL is not a path), refused when the setup runs
        "evil-url": task("evil-url", config=[{"type": "download", "parameters": {"files": [
            {"url": "file:///etc/passwd", "path": "/home/user/passwd"}]}}]),
    }
    for stem, data in files.items():
        (suite / "os" / f"{stem}.json").write_text(json.dumps(data))
    (suite / "test_all.json").write_text(json.dumps({"os": [INFEASIBLE, *files]}))
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["eval", "--suite", str(suite), "--out", str(out), "--agent", "fail", "--envs", "1",
                                 "--no-progress", "--url", farm.url, "--token", farm.token], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = {t["task_id"]: t for t in json.loads((out / "results.json").read_text())["tasks"]}
    assert rows[INFEASIBLE]["status"] == "success"  # the good task ran
    wheres = {"evil-id": "$.id", "evil-stdout": "$.config[0].parameters.stdout",
              "evil-dest": "$.evaluator.result.dest", "evil-url": "$.config[0].parameters"}
    for stem, where in wheres.items():
        row = rows[stem]
        assert row["status"] == "infra_error" and row["score"] == 0.0, row
        assert f"{suite / 'os' / stem}.json: {where}" in row["error"], row["error"]
    assert "outside the folders task files may be read from" in rows["evil-url"]["error"]
    assert not PWNED.exists() and not Path("/etc/cron.d/osfarm-x").exists()
    assert not (tmp_path / "escaped.xlsx").exists() and not (out.parent / "escaped.xlsx").exists()
    # the desktop never got the host's file
    with httpx.Client(base_url=farm.url, headers={"Authorization": f"Bearer {farm.token}"}, timeout=60) as c:
        lid = c.post("/v1/desktops", json={"ttl_s": 60}).json()["id"]
        try:
            got = c.post(f"/v1/desktops/{lid}/guest/file", data={"file_path": "/home/user/passwd"})
            assert got.status_code == 404
        finally:
            c.delete(f"/v1/desktops/{lid}")
    assert os.path.commonpath([str(p) for p in out.rglob("*")] + [str(out)]) == str(out)
