"""Downloading what task files name (hostile input): the downloader, `osfarm tasks fetch` and
`osfarm eval --online`, against a real loopback HTTP server that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from osfarm.farm.server import FarmServer
from osfarm.http.download import DownloadError, DownloadPolicy, DownloadRefused, download
from osfarm.runner.cli import eval_command
from osfarm.tasks.cli import tasks_app
from osfarm.tasks.fetch import suite_assets, task_assets
from osfarm.tasks.filecache import AssetMissing, FileCache
from osfarm.tasks.manifest import Manifest
from osfarm.tasks.model import parse_task
from osfarm.tasks.suite import load_suite
from osfarm.testing.asset_server import HF, AssetServer, asset_server

LOOPBACK = DownloadPolicy(allowed_hosts=("127.0.0.1",), attempts=3, timeout_s=60)
BIG = bytes(range(256)) * 4096  # 1 MiB, not compressible by accident
FILES = {
    f"{HF}/a.txt": b"alpha\n",
    f"{HF}/libreoffice_calc/t1/sheet.xlsx": b"PK-fake-xlsx" * 1000,
    f"{HF}/libreoffice_calc/t1/gold.xlsx": b"PK-gold" * 1000,
    f"{HF}/vlc/t2/big.mp4": BIG,
}


@pytest.fixture
def srv() -> Iterator[AssetServer]:
    with asset_server(FILES) as s:
        yield s


def get(url: str, dest: Path, policy: DownloadPolicy = LOOPBACK):
    return asyncio.run(download(url, dest, policy))


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


# ------------------------------------------------------------------------------ the downloader


def test_download_follows_redirects_and_records_the_checksum(srv: AssetServer, tmp_path: Path) -> None:
    got = get(srv.url(f"/redirect/3{HF}/a.txt"), tmp_path / "a.txt")
    assert (tmp_path / "a.txt").read_bytes() == b"alpha\n"
    assert got.sha256 == sha(b"alpha\n") and got.size == 6 and got.final_url == srv.url(f"{HF}/a.txt")
    assert len(got.redirects) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "a.txt.lock"]  # no .part left


@pytest.mark.parametrize(("path", "words"), [
    ("/to-file", "only http and https URLs are downloaded, not 'file'"),
    ("/to-ftp", "only http and https URLs are downloaded, not 'ftp'"),
    ("/loop", "more than 5 redirects"),
    ("/to-private", "host localhost is not on the allow-list"),
    ("/huge-announced", "over the"),
])
def test_hostile_answers_are_refused(srv: AssetServer, tmp_path: Path, path: str, words: str) -> None:
    with pytest.raises(DownloadRefused, match=words):
        get(srv.url(path), tmp_path / "x")
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.part").exists()
    assert srv.hits[path] <= 6  # refusals are never retried


def test_a_body_over_the_cap_is_cut_and_dropped(srv: AssetServer, tmp_path: Path) -> None:
    # no Content-Length: the cap must stop the stream itself, and keep nothing
    with pytest.raises(DownloadRefused, match="over the 1048576-byte limit"):
        get(srv.url("/huge-unannounced"), tmp_path / "h",
            DownloadPolicy(allowed_hosts=("127.0.0.1",), max_bytes=1 << 20))
    assert not (tmp_path / "h").exists() and not (tmp_path / "h.part").exists()


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/x", "/etc/passwd", "http:///nohost",
                                 "http://user:pw@127.0.0.1/a", "gopher://x"])
def test_urls_other_than_http_are_refused_before_any_request(tmp_path: Path, url: str) -> None:
    with pytest.raises(DownloadRefused):
        get(url, tmp_path / "x")


def test_private_addresses_need_the_allow_list(srv: AssetServer, tmp_path: Path) -> None:
    url = srv.url(f"{HF}/a.txt")
    with pytest.raises(DownloadRefused, match="non-public address 127.0.0.1"):
        get(url, tmp_path / "x", DownloadPolicy())
    with pytest.raises(DownloadRefused, match="not on the allow-list"):
        get(url, tmp_path / "x", DownloadPolicy(allowed_hosts=("hf-mirror.com", ".huggingface.co")))
    assert srv.hits[f"{HF}/a.txt"] == 0
    assert get(url, tmp_path / "ok", DownloadPolicy(allow_private=True)).size == 6


def test_404_fails_at_once_and_500_is_retried(srv: AssetServer, tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="HTTP 404") as e:
        get(srv.url(f"{HF}/nope.txt"), tmp_path / "n")
    assert not e.value.retryable and srv.hits[f"{HF}/nope.txt"] == 1
    with pytest.raises(DownloadError, match="HTTP 500"):
        get(srv.url("/error"), tmp_path / "e", DownloadPolicy(allowed_hosts=("127.0.0.1",), attempts=2))
    assert srv.hits["/error"] == 2


def test_a_truncated_body_is_detected_and_resumed(srv: AssetServer, tmp_path: Path) -> None:
    path = f"{HF}/vlc/t2/big.mp4"
    srv.cut_once.add(path)
    one_try = DownloadPolicy(allowed_hosts=("127.0.0.1",), attempts=1)
    with pytest.raises(DownloadError, match=r"(truncated: got 524288 of 1048576|connection lost after 524288)"):
        get(srv.url(path), tmp_path / "big.mp4", one_try)
    assert (tmp_path / "big.mp4.part").stat().st_size == len(BIG) // 2 and not (tmp_path / "big.mp4").exists()
    got = get(srv.url(path), tmp_path / "big.mp4", one_try)  # the next try continues the part
    assert srv.ranges == [f"bytes={len(BIG) // 2}-"] and got.resumed_from == len(BIG) // 2
    assert (tmp_path / "big.mp4").read_bytes() == BIG and got.sha256 == sha(BIG)
    srv.cut_once.add(path)  # within one call, the retry resumes too
    got = get(srv.url(path), tmp_path / "again.mp4")
    assert got.resumed_from == len(BIG) // 2 and (tmp_path / "again.mp4").read_bytes() == BIG


def test_a_slow_server_hits_the_time_limit(srv: AssetServer, tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="did not finish within 2 s"):
        get(srv.url("/slow/x"), tmp_path / "s", DownloadPolicy(allowed_hosts=("127.0.0.1",), timeout_s=2))
    assert not (tmp_path / "s").exists()


def test_gzip_is_stored_decoded(srv: AssetServer, tmp_path: Path) -> None:
    assert gzip.decompress(gzip.compress(b"plain text " * 100)) == b"plain text " * 100
    get(srv.url("/gzip"), tmp_path / "g.txt")
    assert (tmp_path / "g.txt").read_bytes() == b"plain text " * 100


# ------------------------------------------------------------------------------ assets of tasks


def _task(tid: str, config: list, evaluator: dict) -> dict:
    return {"id": tid, "snapshot": "x", "instruction": "i", "source": "", "config": config, "evaluator": evaluator}


def _write_suite(root: Path, srv: AssetServer) -> tuple[str, str, str]:
    t1, t2, t3 = "t1", "t2", "t3"
    u = srv.url
    tasks = {
        ("libreoffice_calc", t1): _task(t1, [
            {"type": "download", "parameters": {"files": [
                {"url": u(f"/redirect/2{HF}/libreoffice_calc/t1/sheet.xlsx"), "path": "/home/user/Desktop/Sheet.xlsx"},
                {"url": "assets/local.txt", "path": "/home/user/local.txt"}]}},
            {"type": "open", "parameters": {"path": "/home/user/Desktop/Sheet.xlsx"}}],
            {"func": "compare_table",
             "result": {"type": "vm_file", "path": "/home/user/Desktop/Sheet.xlsx", "dest": "s.xlsx"},
             "expected": {"type": "cloud_file", "path": u(f"{HF}/libreoffice_calc/t1/gold.xlsx"),
                          "dest": "gold_renamed.xlsx"}}),
        ("vlc", t2): _task(t2, [
            {"type": "download", "parameters": {"files": [
                {"url": u(f"{HF}/vlc/t2/big.mp4"), "path": "/home/user/big.mp4"},
                {"url": u(f"{HF}/a.txt"), "path": "/home/user/a.txt"}]}}],
            {"func": ["exact_match", "exact_match"],
             "result": [{"type": "cloud_file", "path": [u(f"{HF}/a.txt"), u(f"{HF}/missing.txt")],
                         "dest": ["a1.txt", "m.txt"], "multi": True}, {"type": "vm_command_line", "command": "x"},
                        {"type": "cloud_file", "path": u(f"{HF}/never-evaluated.txt"), "dest": "n.txt"}],
             "expected": [{"type": "rule", "rules": {}}, {"type": "rule", "rules": {}}]}),
        ("os", t3): _task(t3, [{"type": "download", "parameters": {"files": [
            {"url": u("/to-file"), "path": "/home/user/p"}]}}],
            {"func": "infeasible"}),
    }
    for (dom, tid), data in tasks.items():
        (root / dom).mkdir(parents=True, exist_ok=True)
        (root / dom / f"{tid}.json").write_text(json.dumps(data))
    return t1, t2, t3


def test_task_assets_name_every_file_with_its_json_path(srv: AssetServer, tmp_path: Path) -> None:
    _write_suite(tmp_path / "suite", srv)
    suite = load_suite(tmp_path / "suite")
    found = {(a.task_id, a.kind, a.name, a.where) for a in suite_assets(suite)}
    assert found == {
        ("t1", "download", "Sheet.xlsx", "$.config[0].parameters.files[0].url"),
        ("t1", "cloud_file", "gold_renamed.xlsx", "$.evaluator.expected.path"),
        ("t2", "download", "big.mp4", "$.config[0].parameters.files[0].url"),
        ("t2", "download", "a.txt", "$.config[0].parameters.files[1].url"),
        ("t2", "cloud_file", "a1.txt", "$.evaluator.result[0].path[0]"),
        ("t2", "cloud_file", "m.txt", "$.evaluator.result[0].path[1]"),
        ("t3", "download", "p", "$.config[0].parameters.files[0].url"),
    }  # local paths are the suite's own files; entries past the func list are never fetched
    assert task_assets(parse_task(_task("x", [], {"func": "infeasible"}))) == []


def test_fetch_fills_the_osworld_layout_resumably_with_a_manifest(srv: AssetServer, tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    t1, t2, t3 = _write_suite(suite, srv)
    cache = tmp_path / "cache"
    runner = CliRunner()
    srv.cut_once.add(f"{HF}/vlc/t2/big.mp4")  # one broken connection on the way: resumed
    res = runner.invoke(tasks_app, ["fetch", str(suite), "--cache", str(cache), "--allow-host", "127.0.0.1", "-j", "3"])
    assert res.exit_code == 1, res.output  # a 404 and a file:// redirect
    out = res.output
    assert f"failed: t2: $.evaluator.result[0].path[1]: {srv.url(HF + '/missing.txt')}: HTTP 404" in out
    assert "refused: t3: $.config[0].parameters.files[0].url" in out and "not 'file'" in out
    assert "7 files for 3 tasks: 4 fetched" in out and "1 linked, 1 failed, 1 refused" in out

    def at(tid: str, url: str, name: str) -> Path:  # OSWorld's download layout
        return cache / tid / f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{name}"

    sheet = at(t1, srv.url(f"/redirect/2{HF}/libreoffice_calc/t1/sheet.xlsx"), "Sheet.xlsx")
    assert sheet.read_bytes() == FILES[f"{HF}/libreoffice_calc/t1/sheet.xlsx"]
    assert (cache / t1 / "gold_renamed.xlsx").read_bytes() == FILES[f"{HF}/libreoffice_calc/t1/gold.xlsx"]
    assert at(t2, srv.url(f"{HF}/vlc/t2/big.mp4"), "big.mp4").read_bytes() == BIG
    assert srv.ranges == [f"bytes={len(BIG) // 2}-"]
    a_dl, a_cloud = at(t2, srv.url(f"{HF}/a.txt"), "a.txt"), cache / t2 / "a1.txt"
    assert a_dl.read_bytes() == a_cloud.read_bytes() == b"alpha\n"
    assert srv.hits[f"{HF}/a.txt"] == 1 and a_dl.stat().st_ino == a_cloud.stat().st_ino  # fetched once
    manifest = Manifest(cache).read()
    assert manifest[f"{t2}/a1.txt"]["sha256"] == sha(b"alpha\n") and len(manifest) == 5
    assert all(e["sha256"] == sha(Path(cache / k).read_bytes()) for k, e in manifest.items())
    assert not list(cache.rglob("*.part"))

    # a second run fetches nothing again; --verify re-hashes and replaces a corrupted file
    hits = sum(srv.hits.values())
    res = runner.invoke(tasks_app, ["fetch", str(suite), "--cache", str(cache), "--allow-host", "127.0.0.1",
                                    "--no-progress", "--domain", "vlc"])
    assert "4 files for 1 tasks: 0 fetched" in res.output and "3 already cached" in res.output
    assert sum(srv.hits.values()) - hits == 1  # only the 404 is asked again
    big = at(t2, srv.url(f"{HF}/vlc/t2/big.mp4"), "big.mp4")
    big.write_bytes(b"corrupt")
    res = runner.invoke(tasks_app, ["fetch", str(suite), "--cache", str(cache), "--allow-host", "127.0.0.1",
                                    "--verify", "--domain", "vlc"])
    assert "1 fetched" in res.output and big.read_bytes() == BIG


def test_fetch_without_an_allow_list_refuses_loopback(srv: AssetServer, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OSFARM_DOWNLOAD_ALLOW_HOSTS", raising=False)
    _write_suite(tmp_path / "suite", srv)
    res = CliRunner().invoke(tasks_app, ["fetch", str(tmp_path / "suite"), "--cache", str(tmp_path / "c"),
                                         "--no-progress"])
    assert res.exit_code == 1 and "0 fetched" in res.output and "non-public address 127.0.0.1" in res.output
    assert sum(srv.hits.values()) == 0
    monkeypatch.setenv("OSFARM_DOWNLOAD_ALLOW_HOSTS", "127.0.0.1")  # the default allow-list
    res = CliRunner().invoke(tasks_app, ["fetch", str(tmp_path / "suite"), "--cache", str(tmp_path / "c"),
                                         "--no-progress", "--domain", "libreoffice_calc"])
    assert res.exit_code == 0 and "2 fetched" in res.output, res.output


def test_online_file_cache_downloads_lazily_and_records(srv: AssetServer, tmp_path: Path) -> None:
    fc = FileCache(tmp_path / "cache", policy=LOOPBACK)
    url = srv.url(f"/redirect/1{HF}/a.txt")
    p = fc.fetch(url, "t9", name="renamed.txt")
    assert p.read_bytes() == b"alpha\n" and Manifest(tmp_path / "cache").entry(p)["sha256"] == sha(b"alpha\n")
    with pytest.raises(AssetMissing, match="only http and https"):
        fc.fetch(srv.url("/to-file"), "t9")


# ------------------------------------------------------------------------------ eval --online

app = typer.Typer()
app.command()(eval_command)
app.command("unused")(lambda: None)


def test_eval_online_fetches_what_a_task_downloads(srv: AssetServer, farm: FarmServer, tmp_path: Path) -> None:
    tid = "0f5d2a10-1111-4000-8000-00000000f001"
    url = srv.url(f"/redirect/1{HF}/os/{tid}/a.txt")
    srv.files[f"{HF}/os/{tid}/a.txt"] = b"from the web\n"
    suite = tmp_path / "suite"
    (suite / "os").mkdir(parents=True)
    (suite / "os" / f"{tid}.json").write_text(json.dumps(_task(tid, [
        {"type": "download", "parameters": {"files": [{"url": url, "path": "/home/user/got.txt"}]}}],
        {"func": "exact_match", "result": {"type": "vm_command_line", "command": "cat /home/user/got.txt"},
         "expected": {"type": "rule", "rules": {"expected": "from the web\n"}}})))
    base = ["eval-command", "--suite", str(suite), "--agent", "noop", "--no-progress", "--retries", "0",
            "--url", farm.url, "--token", farm.token, "--cache", str(tmp_path / "cache")]
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "off")], catch_exceptions=False)
    row = json.loads((tmp_path / "off" / "results.json").read_text())["tasks"][0]
    assert r.exit_code == 0 and row["status"] == "infra_error" and "not available offline" in row["error"]
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "on"), "--online", "--allow-host", "127.0.0.1"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    row = json.loads((tmp_path / "on" / "results.json").read_text())["tasks"][0]
    assert row["status"] == "success", row  # noop's DONE: the check reads the downloaded file
    cached = tmp_path / "cache" / tid / f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_got.txt"
    assert cached.read_bytes() == b"from the web\n" and Manifest(tmp_path / "cache").entry(cached) is not None
