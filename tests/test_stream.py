"""Trajectory records, blobs, run-dir JSONL and Redis Streams (a real redis-server)."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from osfarm.cli import app
from osfarm.schema.episode import SCHEMA, SchemaError, check_record, read_record
from osfarm.stream.blobs import BlobMissing, LocalBlobStore
from osfarm.stream.jsonl import JsonlSink, read_jsonl
from osfarm.stream.redis_stream import (
    RedisStreamSink,
    RedisStreamSource,
    backlog,
    connect,
    republish_spill,
    stream_stats,
    trim_consumed,
)
from osfarm.testing.redis_server import RedisServer

PNG = b"\x89PNG\r\n\x1a\n" + b"pixels"


def record(n: int = 1, blobs: LocalBlobStore | None = None, status: str = "success") -> dict:
    shot = ((blobs or LocalBlobStore(Path("/nonexistent"))).put(PNG + bytes([n % 256]), "png", "image/png")
            if blobs else {"sha256": "a" * 64, "path": f"blobs/aa/{'a' * 64}.png", "media_type": "image/png",
                           "size": 10})
    return {
        "schema": SCHEMA, "episode_id": f"ep-{n}", "run_id": "run-1", "task_id": f"task-{n}", "domain": "os",
        "group_id": f"task-{n}", "attempt": 1, "agent": "replay",
        "policy": {"name": "replay", "version_start": None, "version_end": None},
        "desktop": {"provider": "sandbox", "image": None}, "status": status, "score": 1.0, "error": None,
        "started_at": "2026-01-01T00:00:00.000+00:00", "finished_at": "2026-01-01T00:00:05.000+00:00",
        "steps": [{"index": 1, "observation": {"screenshot": shot, "a11y": None},
                   "model": {"request": None, "response_text": "x", "response_token_ids": [1, 2],
                             "response_logprobs": [-0.1, -0.2], "policy_version": 3},
                   "actions": ["pyautogui.click(1, 2)"], "action_error": None, "t_model_ms": 1.0, "t_env_ms": 2.0}],
        "timings": {"lease": 0.1},  # an extra field: kept
    }


# ---- record -----------------------------------------------------------------------------------


def test_a_valid_record_passes_unchanged_with_its_extra_fields() -> None:
    rec = record()
    assert check_record(rec) is rec and rec["timings"] == {"lease": 0.1}
    assert check_record({**record(), "schema": "osfarm.episode/1.3"})  # a newer minor version is readable


def test_a_record_read_as_the_model_keeps_its_fields_and_extras() -> None:
    r = read_record(record())
    assert r.schema_ == SCHEMA and r.status == "success" and r.steps[0].model is not None
    assert r.steps[0].observation.screenshot is not None and r.steps[0].model.policy_version == 3
    assert r.model_extra == {"timings": {"lease": 0.1}}  # a newer writer's field, kept
    with pytest.raises(SchemaError, match="field score"):
        read_record({**record(), "score": "high"})


@pytest.mark.parametrize(("change", "message"), [
    ({"schema": "osfarm.episode/2"}, "unsupported episode schema 'osfarm.episode/2'.*knows osfarm.episode/1"),
    ({"schema": "something/1"}, "not an osfarm episode record"),
    ({"status": "great"}, "field status"),
    ({"attempt": 0}, "field attempt"),
])
def test_bad_records_are_refused_naming_the_field(change: dict, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        check_record({**record(), **change})


def test_bad_step_fields_are_named_by_path() -> None:
    rec = record()
    rec["steps"][0]["observation"]["screenshot"]["sha256"] = "nope"
    with pytest.raises(SchemaError, match=r"steps\.0\.observation\.screenshot\.sha256"):
        check_record(rec)
    rec = record()
    del rec["steps"][0]["t_env_ms"]
    with pytest.raises(SchemaError, match=r"missing fields \['steps.0.t_env_ms'\]"):
        check_record(rec)
    with pytest.raises(SchemaError, match="must be a JSON object"):
        check_record([1])


# ---- blobs ------------------------------------------------------------------------------------


def test_blobs_are_content_addressed_and_verified(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    a = store.put(PNG, "png", "image/png")
    b = store.put(PNG, "png", "image/png")
    assert a == b and a["size"] == len(PNG) and a["path"] == f"blobs/{a['sha256'][:2]}/{a['sha256']}.png"
    assert store.get(a) == PNG and store.has(a)
    assert len(list((tmp_path / "blobs").rglob("*"))) == 2  # one folder, one file: no temp files left
    (tmp_path / a["path"]).write_bytes(b"tampered")
    with pytest.raises(BlobMissing, match="does not match its sha256"):
        store.get(a)
    with pytest.raises(BlobMissing, match="not found"):
        store.get({**a, "path": "blobs/00/none.png"})
    with pytest.raises(ValueError, match="without '..'"):
        store.get({**a, "path": "../etc/passwd"})


# ---- JSONL ------------------------------------------------------------------------------------


def _append_many(path: str, start: int, n: int) -> None:
    sink = JsonlSink(Path(path))
    for i in range(start, start + n):
        sink.publish(record(i))


def test_jsonl_appends_from_several_processes_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "episodes.jsonl"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(path), k * 1000, 150)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    recs = list(read_jsonl(path))
    assert len(recs) == 450 and len({r["episode_id"] for r in recs}) == 450


def test_jsonl_reader_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "episodes.jsonl"
    JsonlSink(path).publish(record(1))
    with path.open("a") as f:
        f.write(json.dumps({**record(2), "schema": "osfarm.episode/9"}) + "\n")
    with pytest.raises(SchemaError, match=r"episodes.jsonl:2: unsupported episode schema"):
        list(read_jsonl(path))


# ---- Redis Streams ------------------------------------------------------------------------------


@pytest.fixture
def stream(redis_session: RedisServer, request: pytest.FixtureRequest) -> str:
    name = f"test:{request.node.name}"
    r = connect(redis_session.url)
    r.delete(name)
    for k in r.scan_iter(f"{name}:published:*"):
        r.delete(k)
    return name


def test_an_episode_is_published_once_and_consumed_with_ack(redis_session: RedisServer, stream: str) -> None:
    sink = RedisStreamSink(redis_session.url, stream)
    src = RedisStreamSource(redis_session.url, stream, group="trainer", consumer="c1")
    first = sink.publish(record(1))
    again = sink.publish(record(1))  # a redelivered episode
    assert first.status == "published" and again.status == "duplicate" and again.entry_id == first.entry_id
    sink.publish(record(2))
    got = src.read(count=10, block_ms=100)
    assert [e.record["episode_id"] for e in got] == ["ep-1", "ep-2"]
    assert backlog(src.r, stream) == 2  # read but not acknowledged still counts
    assert src.ack(got[0].id) == 1
    assert backlog(src.r, stream) == 1
    assert trim_consumed(src.r, stream) == 1  # only the acknowledged entry goes
    assert src.r.xlen(stream) == 1 and src.pending_mine()[0].record["episode_id"] == "ep-2"


def test_entries_of_a_dead_consumer_are_claimed(redis_session: RedisServer, stream: str) -> None:
    sink = RedisStreamSink(redis_session.url, stream)
    for i in range(3):
        sink.publish(record(i))
    dead = RedisStreamSource(redis_session.url, stream, group="g", consumer="dead")
    assert len(dead.read(count=2, block_ms=100)) == 2  # then it "dies" without acking
    alive = RedisStreamSource(redis_session.url, stream, group="g", consumer="alive")
    assert alive.claim_stale(min_idle_ms=60_000) == []  # not idle long enough yet
    time.sleep(0.3)
    assert [e.record["episode_id"] for e in alive.read(count=10, block_ms=100)] == ["ep-2"]
    claimed = alive.claim_stale(min_idle_ms=200)
    assert sorted(e.record["episode_id"] for e in claimed) == ["ep-0", "ep-1"]
    alive.ack(*(e.id for e in claimed))
    assert alive.forget_idle_consumers(min_idle_ms=0) == ["dead"]
    st = stream_stats(alive.r, stream)
    g = st["groups"][0]
    assert st["length"] == 3 and g["pending"] == 1 and g["lag"] == 0
    assert [c["name"] for c in g["consumers"]] == ["alive"]


def test_a_full_stream_makes_the_producer_wait_then_spill_never_drop(
    redis_session: RedisServer, stream: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spill = tmp_path / "spill.jsonl"
    sink = RedisStreamSink(redis_session.url, stream, max_backlog=2, wait_s=0.5, poll_s=0.05, spill=spill)
    src = RedisStreamSource(redis_session.url, stream, group="slow", consumer="c")
    assert [sink.publish(record(i)).status for i in range(2)] == ["published", "published"]
    with caplog.at_level("WARNING", logger="osfarm.stream"):
        res = sink.publish(record(2))
    assert res.status == "spilled" and res.spill_path == spill
    assert "spilled to" in caplog.text and "osfarm stream republish" in caplog.text
    assert [r["episode_id"] for r in read_jsonl(spill)] == ["ep-2"]
    assert sink.publish(record(3)).status == "spilled"
    # republish: nothing fits yet, so both stay
    assert republish_spill(sink, spill) == {"published": 0, "duplicate": 0, "kept": 2}
    src.ack(*(e.id for e in src.read(count=10, block_ms=100)))  # the consumer catches up
    assert republish_spill(sink, spill) == {"published": 2, "duplicate": 0, "kept": 0}
    assert spill.read_text() == ""
    assert [e.record["episode_id"] for e in src.read(count=10, block_ms=100)] == ["ep-2", "ep-3"]


def test_a_waiting_producer_publishes_once_the_consumer_acks(
    redis_session: RedisServer, stream: str, tmp_path: Path
) -> None:
    import threading

    sink = RedisStreamSink(redis_session.url, stream, max_backlog=1, wait_s=30, poll_s=0.05, spill=tmp_path / "s.jsonl")
    src = RedisStreamSource(redis_session.url, stream, group="g", consumer="c")
    sink.publish(record(1))
    got = src.read(count=1, block_ms=100)

    def ack_later() -> None:
        time.sleep(0.5)
        src.ack(got[0].id)

    t = threading.Thread(target=ack_later)
    t.start()
    assert sink.publish(record(2)).status == "published"  # waited for room, did not spill
    t.join()
    assert not (tmp_path / "s.jsonl").exists()


def test_stream_cli_stats_tail_and_errors(redis_session: RedisServer, stream: str, tmp_path: Path) -> None:
    sink = RedisStreamSink(redis_session.url, stream)
    for i in range(3):
        sink.publish(record(i, status="failure" if i == 1 else "success"))
    RedisStreamSource(redis_session.url, stream, group="trainer", consumer="c").read(count=1, block_ms=100)
    runner = CliRunner()
    r = runner.invoke(app, ["stream", "stats", "--redis", redis_session.url, "--stream", stream, "--json"])
    assert r.exit_code == 0, r.output
    st = json.loads(r.output)
    assert st["length"] == 3 and st["backlog"] == 3
    assert st["groups"][0]["pending"] == 1 and st["groups"][0]["lag"] == 2
    r = runner.invoke(app, ["stream", "stats", "--redis", redis_session.url, "--stream", stream])
    assert r.exit_code == 0 and "length 3" in r.output and "trainer" in r.output
    r = runner.invoke(app, ["stream", "tail", "--redis", redis_session.url, "--stream", stream, "-n", "2"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 2 and "failure" in lines[0] and "task-1" in lines[0] and "task-2" in lines[1]
    path = tmp_path / "episodes.jsonl"
    JsonlSink(path).publish(record(7))
    r = runner.invoke(app, ["stream", "tail", "--file", str(path), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["episode_id"] == "ep-7"
    r = runner.invoke(app, ["stream", "stats", "--redis", "redis://127.0.0.1:1/0"])
    assert r.exit_code == 1 and "cannot reach Redis" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["stream", "republish", str(tmp_path / "none.jsonl"), "--redis", redis_session.url])
    assert r.exit_code == 1 and "no such file" in " ".join(r.output.split())


# ---- whatever dies: dead letters, poison entries, trimming, atomic store, a consumer killed -------


def test_invalid_entries_are_dead_lettered_with_the_reason_and_the_consumer_moves_on(
        redis_session: RedisServer, stream: str) -> None:
    from osfarm.stream.redis_stream import dead_letters

    sink = RedisStreamSink(redis_session.url, stream)
    src = RedisStreamSource(redis_session.url, stream, group="g", consumer="c")
    sink.publish(record(1))
    src.r.xadd(stream, {"episode_id": "bad-json", "record": "{not json"})
    src.r.xadd(stream, {"episode_id": "no-record"})
    src.r.xadd(stream, {"episode_id": "bad-schema", "record": json.dumps({**record(5), "score": "high"})})
    sink.publish(record(2))
    got = src.read(count=10, block_ms=100)
    assert [e.record["episode_id"] for e in got] == ["ep-1", "ep-2"]  # no raise: the good ones come through
    dead = dead_letters(src.r, stream)
    assert [json.loads(d["fields"]).get("episode_id") for d in dead] == ["bad-json", "no-record", "bad-schema"]
    assert "invalid record: not JSON" in dead[0]["reason"] or "invalid record" in dead[0]["reason"]
    assert dead[1]["reason"] == "no 'record' field in the entry"
    assert "field score" in dead[2]["reason"] and dead[2]["group"] == "g" and dead[2]["consumer"] == "c"
    assert src.dead_lettered == 3
    # dead-lettered entries are acknowledged: only the two good ones are pending
    assert src.r.xpending(stream, "g")["pending"] == 2


def test_an_entry_every_consumer_dies_on_is_dead_lettered_after_max_deliveries(
        redis_session: RedisServer, stream: str) -> None:
    from osfarm.stream.redis_stream import dead_letters

    RedisStreamSink(redis_session.url, stream).publish(record(1))
    first = RedisStreamSource(redis_session.url, stream, group="g", consumer="c0", max_deliveries=3)
    assert len(first.read(count=1, block_ms=100)) == 1  # delivery 1, then it "dies"
    for i in range(1, 3):  # deliveries 2 and 3: each claimer dies too
        time.sleep(0.05)
        c = RedisStreamSource(redis_session.url, stream, group="g", consumer=f"c{i}", max_deliveries=3)
        assert [e.record["episode_id"] for e in c.claim_stale(min_idle_ms=20)] == ["ep-1"]
    time.sleep(0.05)
    last = RedisStreamSource(redis_session.url, stream, group="g", consumer="c9", max_deliveries=3)
    assert last.claim_stale(min_idle_ms=20) == []  # the 4th delivery is refused: dead-lettered
    dead = dead_letters(last.r, stream)
    assert len(dead) == 1 and "delivered 4 times without an acknowledgement" in dead[0]["reason"]
    assert last.r.xpending(stream, "g")["pending"] == 0


def test_trimming_keeps_every_entry_some_group_has_not_acknowledged(redis_session: RedisServer, stream: str) -> None:
    sink = RedisStreamSink(redis_session.url, stream)
    for i in range(6):
        sink.publish(record(i))
    fast = RedisStreamSource(redis_session.url, stream, group="fast", consumer="f")
    slow = RedisStreamSource(redis_session.url, stream, group="slow", consumer="s")
    fast.ack(*(e.id for e in fast.read(count=10, block_ms=100)))
    assert fast.trim() == 0  # "slow" has read nothing yet
    got = slow.read(count=3, block_ms=100)
    slow.ack(got[0].id, got[2].id)  # entry 1 stays pending
    assert slow.trim() == 1 and slow.r.xlen(stream) == 5
    slow.ack(got[1].id)
    assert slow.trim() == 2 and slow.r.xlen(stream) == 3  # the 3 "slow" has not read yet stay


def test_a_result_and_its_record_are_stored_together_and_once(redis_session: RedisServer, stream: str) -> None:
    from osfarm.stream.redis_stream import store_result

    r = connect(redis_session.url)
    key = f"{stream}:job:result"
    r.delete(key)
    first = store_result(r, key, '{"row": 1}', 60, stream=stream, record=record(1))
    assert first.status == "stored" and first.entry_id and r.get(key) == '{"row": 1}'
    again = store_result(r, key, '{"row": 2}', 60, stream=stream, record=record(1))  # a rerun after a crash
    assert again.status == "existing" and again.result == '{"row": 1}'
    assert r.xlen(stream) == 1
    # the record was published before (by a run whose result store was lost): no second entry
    r.delete(key)
    third = store_result(r, key, '{"row": 3}', 60, stream=stream, record=record(1))
    assert third.status == "stored" and third.entry_id == first.entry_id and r.xlen(stream) == 1
    assert RedisStreamSink(redis_session.url, stream).publish(record(1)).status == "duplicate"


_KILLED_CONSUMER = """
import sys, time
from pathlib import Path
from osfarm.stream.consumer import StreamConsumer
from osfarm.stream.redis_stream import RedisStreamSource
url, stream, journal = sys.argv[1:4]
src = RedisStreamSource(url, stream, group="trainer")  # a new name per process, as after a restart
c = StreamConsumer(src, Path(journal), claim_idle_ms=150, claim_every_s=0.05, trim_every=7)
print("up", flush=True)
while True:
    c.poll(count=3, block_ms=50)
"""


def test_a_consumer_killed_at_random_moments_loses_no_record_and_journals_none_twice(
        redis_session: RedisServer, stream: str, tmp_path: Path) -> None:
    import random
    import signal
    import subprocess
    import sys

    from osfarm.stream.consumer import StreamConsumer

    n = 1500
    sink = RedisStreamSink(redis_session.url, stream, trim_every=0)
    for i in range(n):
        sink.publish(record(i))
    journal = tmp_path / "journal.jsonl"
    rng = random.Random(17)
    kills = 0
    r = connect(redis_session.url)
    for _ in range(40):
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_CONSUMER, redis_session.url, stream, str(journal)],
                                stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        time.sleep(rng.uniform(0.0, 0.08))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        kills += 1
        g = [x for x in r.xinfo_groups(stream) if x["name"] == "trainer"][0]
        if int(g["pending"]) == 0 and int(g.get("lag") or 0) == 0:
            break
    # one last consumer that lives: it reclaims what the dead ones left and finishes
    last = StreamConsumer(RedisStreamSource(redis_session.url, stream, group="trainer", consumer="last"), journal,
                          claim_idle_ms=150, claim_every_s=0.05)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        last.poll(count=10, block_ms=50)
        g = [x for x in r.xinfo_groups(stream) if x["name"] == "trainer"][0]
        if int(g["pending"]) == 0 and int(g.get("lag") or 0) == 0:
            break
    ids = [rec["episode_id"] for rec in last.replay()]
    assert kills >= 3
    assert sorted(ids) == sorted(f"ep-{i}" for i in range(n))  # every record, each exactly once
    assert r.xpending(stream, "trainer")["pending"] == 0
    last.source.trim()
    assert r.xlen(stream) == 0  # all acknowledged by the only group: trimmed away


async def test_a_trainer_restarted_from_an_older_checkpoint_gets_its_acknowledged_records_from_the_journal(
        redis_session: RedisServer, stream: str, tmp_path: Path) -> None:
    """DataManager.consume_redis acknowledges only journaled records; a trainer killed before its
    next checkpoint finds them in the journal (Redis no longer has them pending) and adds each once."""
    from osfarm.trainer.data_manager import DataManager

    sink = RedisStreamSink(redis_session.url, stream)
    for i in range(6):
        sink.publish(record(i))
    journal = tmp_path / "journal.jsonl"
    first = DataManager(blob_root=tmp_path)
    got: list[str] = []
    await first.consume_redis(RedisStreamSource(redis_session.url, stream, group="trainer", consumer="a"), tmp_path,
                              journal=journal, stop=lambda: len(got) >= 6,
                              on_added=lambda r, _: got.append(r["episode_id"]), block_ms=100)
    assert sorted(got) == [f"ep-{i}" for i in range(6)]
    assert RedisStreamSource(redis_session.url, stream, group="trainer", consumer="x").r.xpending(stream, "trainer")[
        "pending"] == 0  # all acknowledged: Redis will not deliver them again
    # the trainer dies before its next checkpoint; the checkpoint it restarts from had seen ep-0..ep-3
    restarted = DataManager(blob_root=tmp_path)
    restarted.seen = {f"ep-{i}" for i in range(4)}
    again: list[str] = []
    sink.publish(record(6))
    await restarted.consume_redis(RedisStreamSource(redis_session.url, stream, group="trainer", consumer="b"), tmp_path,
                                  journal=journal, stop=lambda: len(again) >= 3,
                                  on_added=lambda r, _: again.append(r["episode_id"]), block_ms=100)
    assert again == ["ep-4", "ep-5", "ep-6"]  # the two it lost, from the journal, then the new one
    assert [r["episode_id"] for r in read_jsonl(journal)] == [f"ep-{i}" for i in range(7)]  # each journaled once
