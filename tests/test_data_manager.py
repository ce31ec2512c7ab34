"""DataManager on hand-built osfarm.episode/1 records (real blobs in a tmp run dir)."""

from __future__ import annotations

import asyncio
import io
import json
import math
import uuid
from pathlib import Path

import pytest
from PIL import Image

from osfarm.stream.blobs import LocalBlobStore
from osfarm.stream.jsonl import JsonlSink, read_jsonl
from osfarm.testing.redis_server import RedisServer
from osfarm.trainer.data_manager import ACCEPTED, DataConfig, DataManager
from osfarm.trainer.request_context import image_bytes, trim_context


def Cfg(**kw) -> DataConfig:  # noqa: N802 - reads like the class it builds
    """DataConfig for these tests: every step kept (DART's entropy selection, on by default, is
    tested on its own)."""
    return DataConfig(**{"entropy_fraction": 1.0, **kw})


def png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(buf, "PNG")
    return buf.getvalue()


SYSTEM = {"role": "system", "content": "You are a GUI agent."}
TASK = {"role": "user", "content": [{"type": "text", "text": "Instruction: open the file."}]}


def make_record(run: Path, task_id: str = "t1", *, status: str = "failure", score: float | None = None,
                steps: int = 2, version: int | None = 0, tokens: bool = True, model_error: str | None = None,
                logprob: float = -0.5, episode_id: str | None = None, group_id: str | None = None) -> dict:
    """A valid record whose steps carry the request the agent sent (images as blob refs, as
    osfarm/agents/prompts/messages.strip_images stores them) and the model's tokens."""
    blobs = LocalBlobStore(run)
    score = (1.0 if status == "success" else 0.0) if score is None else score
    out_steps = []
    history: list[dict] = []
    for i in range(1, steps + 1):
        shot = blobs.put(png((10 * i, 0, 0)), "png", "image/png")
        current = {"role": "user", "content": [{"type": "text", "text": f"step {i}"},
                                               {"type": "image_url", "image_url": {"blob": shot}}]}
        messages = [SYSTEM, TASK, *history, current]
        req = blobs.put(json.dumps(messages).encode(), "json", "application/json")
        text = f"Action: click {i}"
        out_steps.append({
            "index": i, "observation": {"screenshot": shot, "a11y": None},
            "model": {"request": req, "response_text": text,
                      "response_token_ids": [100 + i, 200 + i, 300 + i] if tokens else None,
                      "response_logprobs": ([logprob, {"token": "token_id:2", "logprob": logprob}, logprob]
                                            if tokens else None),
                      "policy_version": version, "error": model_error},
            "actions": ["pyautogui.click(1, 1)"], "action_error": None, "t_model_ms": 5.0, "t_env_ms": 7.0})
        history += [current, {"role": "assistant", "content": text}]
    return {"schema": "osfarm.episode/1", "episode_id": episode_id or uuid.uuid4().hex, "run_id": "r1",
            "task_id": task_id, "domain": "os", "group_id": group_id or task_id, "attempt": 1, "agent": "vlm",
            "policy": {"name": "tiny", "version_start": version, "version_end": version},
            "desktop": {"provider": "sandbox", "image": None}, "status": status, "score": score,
            "error": "lease failed" if status == "infra_error" else None,
            "started_at": "2026-01-01T00:00:00.000+00:00", "finished_at": "2026-01-01T00:00:09.000+00:00",
            "steps": out_steps}


def approx(x, abs=1e-5):
    return pytest.approx(x, abs=abs)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


def test_storage_rules_and_counters(run):
    dm = DataManager(Cfg(group_size=2), blob_root=run)
    good = make_record(run, status="failure", steps=2)
    assert dm.add(good) == ACCEPTED
    assert dm.add(good) == "duplicate"  # a redelivered stream entry counts once
    assert dm.add(make_record(run, status="infra_error", steps=0)) == "infra_error"
    assert dm.add(make_record(run, status="failure", steps=1)) == "short_failure"  # < 2 steps
    assert dm.add(make_record(run, status="success", steps=1)) == ACCEPTED  # successes may be short
    assert dm.add(make_record(run, model_error="policy unreachable")) == "model_error"
    assert dm.add(make_record(run, tokens=False)) == "no_model_data"
    assert dm.add(make_record(run, version=None)) == "no_version"
    bad = make_record(run)
    del bad["steps"][0]["t_env_ms"]
    assert dm.add(bad) == "invalid"  # a bad record is counted, never raised into the consumer loop
    assert dm.add(make_record(run, status="timeout", steps=3)) == ACCEPTED  # a timeout is a failure
    c = dm.counters
    assert (c["records"], c[ACCEPTED], c["duplicate"], c["infra_error"], c["short_failure"], c["model_error"],
            c["no_model_data"], c["no_version"], c["invalid"]) == (10, 3, 1, 1, 1, 1, 1, 1, 1)
    # infra errors and model errors say nothing about the task; everything else is an outcome:
    # good(0), short failure(0), success(1), no_model_data(0), no_version(0), timeout(0) → 1/6
    st = dm.task_stats["t1"]
    assert (st.episodes, st.successes) == (6, 1)
    assert st.success_rate == approx(1 / 6)
    # the successful episode went to the experience pool
    assert len(dm.pool["t1"]) == 1


def test_group_advantages_and_step_samples(run):
    dm = DataManager(Cfg(group_size=4), blob_root=run)
    for st in ("success", "failure", "failure", "success"):
        dm.add(make_record(run, status=st, steps=2, version=3))
    assert dm.ready_tasks() == ["t1"]
    batch = dm.take_batch()
    # rewards [1, 0, 0, 1]: mean 0.5, population std 0.5 → A = [1, -1, -1, 1]; 2 steps each → 8 samples
    assert len(batch.groups) == 1
    assert batch.groups[0].advantages == approx([1, -1, -1, 1])
    assert len(batch.samples) == 8
    assert [s.advantage for s in batch.samples] == approx([1, 1, -1, -1, -1, -1, 1, 1])
    s = batch.samples[1]  # episode 1, step 2
    assert (s.task_id, s.step_index, s.policy_version, s.reward) == ("t1", 2, 3, 1.0)
    assert s.response_token_ids == [102, 202, 302]
    assert s.behav_logprobs == [-0.5, -0.5, -0.5]
    assert s.response_text == "Action: click 2"
    # the context is the request the agent sent: system, task, turn 1 (user + assistant), current
    assert [m["role"] for m in s.messages] == ["system", "user", "user", "assistant", "user"]
    urls = [p["image_url"]["url"] for m in s.messages if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "image_url"]
    assert len(urls) == 2 and all(Path(u).is_absolute() and Path(u).is_file() for u in urls)
    assert Image.open(io.BytesIO(image_bytes(urls[-1]))).getpixel((0, 0)) == (20, 0, 0)  # step 2's screen
    # every episode is used once: nothing is pending any more
    assert dm.ready_tasks() == [] and dm.take_batch().samples == []
    assert dm.counters["groups"] == 1 and dm.counters["samples"] == 8


def test_data_urls_and_dr_grpo(run):
    dm = DataManager(Cfg(group_size=2, image_mode="data_url", std_normalize=False), blob_root=run)
    dm.add(make_record(run, status="success", score=1.0))
    dm.add(make_record(run, status="failure", score=0.25))
    batch = dm.take_batch()
    # Dr.GRPO: rewards [1, 0.25], mean 0.625 → A = [0.375, -0.375]
    assert batch.groups[0].advantages == approx([0.375, -0.375])
    part = batch.samples[0].messages[-1]["content"][1]
    assert part["image_url"]["url"].startswith("data:image/png;base64,")
    assert image_bytes(part["image_url"]["url"]) == png((10, 0, 0))


def test_trim_keeps_a_success_and_a_failure(run):
    dm = DataManager(Cfg(group_size=3), blob_root=run)
    ids = [make_record(run, status=s) for s in ("success", "failure", "failure", "failure", "failure")]
    for r in ids:
        dm.add(r)
    batch = dm.take_batch()
    g = batch.groups[0]
    # newest 3 are failures (#3, #4, #5); the oldest of them (#3) gives way to the success (#1):
    # rewards [1, 0, 0]: mean 1/3, population std √(2/9) = 0.471405 → A = [1.414214, -0.707107, -0.707107]
    assert [e.record["episode_id"] for e in g.episodes] == [ids[0]["episode_id"], ids[3]["episode_id"],
                                                            ids[4]["episode_id"]]
    assert g.advantages == approx([math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)])
    # #2 and #3 stay pending (not used yet)
    assert [e.record["episode_id"] for e in dm.pending["t1"]] == [ids[1]["episode_id"], ids[2]["episode_id"]]


def test_all_failure_group_takes_a_pool_success(run, tmp_path):
    # an eval run dir with one success of t1, recorded without token ids (e.g. a replay or an eval)
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    JsonlSink(eval_dir / "episodes.jsonl").publish(make_record(eval_dir, status="success", tokens=False,
                                                               version=None, episode_id="pooled"))
    JsonlSink(eval_dir / "episodes.jsonl").publish(make_record(eval_dir, status="failure"))
    pool_dir = tmp_path / "pool"
    dm = DataManager(Cfg(group_size=3), blob_root=run, pool_dir=pool_dir)
    assert dm.preload_pool(eval_dir) == 1
    fails = [make_record(run, status="failure", version=0) for _ in range(3)]
    for r in fails:
        dm.add(r)
    batch = dm.take_batch()
    g = batch.groups[0]
    # the oldest failure is swapped for the pool's success: rewards [0, 0, 1] →
    # A = [-0.707107, -0.707107, 1.414214]
    assert [e.record["episode_id"] for e in g.episodes] == [fails[1]["episode_id"], fails[2]["episode_id"], "pooled"]
    assert g.advantages == approx([-1 / math.sqrt(2), -1 / math.sqrt(2), math.sqrt(2)])
    pooled = [s for s in batch.samples if s.from_pool]
    assert len(pooled) == 2 and pooled[0].response_token_ids is None and pooled[0].behav_logprobs is None
    assert pooled[0].response_text == "Action: click 1"
    assert Path(pooled[0].messages[-1]["content"][1]["image_url"]["url"]).is_relative_to(eval_dir.resolve())
    assert dm.counters["pool_replacements"] == 1
    # the pool is on disk: a new data manager over the same pool dir has it
    assert [e.record["episode_id"] for e in DataManager(blob_root=run, pool_dir=pool_dir).pool["t1"]] == ["pooled"]
    # without a pool success, an all-failure group is dropped this round
    for r in [make_record(run, "t2", status="failure") for _ in range(3)]:
        dm.add(r)
    assert dm.take_batch().groups == [] and dm.counters["groups_all_fail_dropped"] == 1
    with pytest.raises(FileNotFoundError, match="episodes.jsonl"):
        dm.preload_pool(tmp_path / "nowhere")


def test_too_easy_and_zero_variance_groups(run):
    dm = DataManager(Cfg(group_size=2, use_pool=False), blob_root=run)
    for _ in range(2):
        dm.add(make_record(run, "easy", status="success"))
    for _ in range(2):
        dm.add(make_record(run, "same", status="failure", score=0.5))
    for sc in (0.5, 0.25):
        dm.add(make_record(run, "partial", status="failure", score=sc))
    batch = dm.take_batch()
    # easy: mean 1 ≥ acc_max 1 → too easy; same: all failures, equal → dropped (no pool);
    # partial: failures with scores [0.5, 0.25] carry a signal: A = [1, -1]
    assert [g.task_id for g in batch.groups] == ["partial"]
    assert batch.groups[0].advantages == approx([1, -1])
    assert dm.counters["groups_too_easy"] == 1 and dm.counters["groups_all_fail_dropped"] == 1
    # with acc_max above 1, equal successes are a zero-variance group
    dm = DataManager(Cfg(group_size=2, acc_max=1.5), blob_root=run)
    for _ in range(2):
        dm.add(make_record(run, "easy", status="success"))
    assert dm.take_batch().groups == [] and dm.counters["groups_zero_variance"] == 1
    # drop_no_signal=False keeps a solved task's group, with zero advantages (the version goes on)
    dm = DataManager(Cfg(group_size=2, drop_no_signal=False), blob_root=run)
    for _ in range(2):
        dm.add(make_record(run, "easy", status="success"))
    groups = dm.take_batch().groups
    assert [g.task_id for g in groups] == ["easy"] and groups[0].advantages == approx([0, 0])
    assert dm.counters["groups_too_easy"] == 1


def test_dynamic_group_size_follows_task_success(run):
    dm = DataManager(Cfg(), blob_root=run)  # group_size None: DART's n
    assert dm.group_size("new") == 8  # never seen: rollout_n
    for _ in range(3):
        dm.add(make_record(run, "hard", status="failure"))
    assert dm.group_size("hard") == 8 and dm.ready_tasks() == []
    # success rate 0.8 → int(9/0.8 − 7) = int(4.25) = 4
    for st in ("success", "success", "success", "success", "failure"):
        dm.add(make_record(run, "mostly", status=st))
    assert dm.task_stats["mostly"].success_rate == approx(0.8)
    assert dm.group_size("mostly") == 4 and dm.ready_tasks() == ["mostly"]


def test_discarded_episodes_are_reported(run):
    # the rollout controller gets its staleness capacity back for accepted episodes that never train
    gone = []
    dm = DataManager(Cfg(group_size=2, use_pool=False), blob_root=run,
                     on_discard=lambda task, n, why: gone.append((task, n, why)))
    for _ in range(2):
        dm.add(make_record(run, "easy", status="success"))
    for _ in range(2):
        dm.add(make_record(run, "hard", status="failure"))
    dm.add(make_record(run, "old", status="failure", version=0))
    dm.take_batch()
    dm.set_version(2)  # window 1: the pending version-0 episode of "old" goes stale
    assert gone == [("easy", 2, "too_easy"), ("hard", 2, "all_fail"), ("old", 1, "stale")]


def test_version_window(run):
    dm = DataManager(Cfg(group_size=2, version_window=1), blob_root=run, version=2)
    assert dm.add(make_record(run, version=0)) == "stale"  # 0 < 2 − 1
    assert dm.add(make_record(run, version=1)) == ACCEPTED
    assert dm.add(make_record(run, version=2, status="success")) == ACCEPTED
    assert dm.set_version(3) == 1  # the version-1 episode is now outside the window
    assert dm.counters["stale"] == 2 and dm.ready_tasks() == []
    with pytest.raises(ValueError, match="backwards"):
        dm.set_version(1)


def test_high_entropy_selection_over_a_batch(run):
    dm = DataManager(Cfg(group_size=2, entropy_fraction=0.5), blob_root=run)
    dm.add(make_record(run, status="success", logprob=-2.0))  # surprisal 2.0 per token: unsure
    dm.add(make_record(run, status="failure", logprob=-0.1))  # 0.1: sure
    batch = dm.take_batch()
    # 4 step samples, top half by mean surprisal → the success's 2 steps
    assert [round(s.entropy, 6) for s in batch.samples] == [2.0, 2.0]
    assert dm.counters["entropy_filtered"] == 2
    # a callback can supply the entropy instead (e.g. the learner's own forward pass)
    dm2 = DataManager(Cfg(group_size=2, entropy_fraction=0.5), blob_root=run,
                      entropy_fn=lambda s: float(s.step_index))
    dm2.add(make_record(run, status="success"))
    dm2.add(make_record(run, status="failure"))
    assert [s.step_index for s in dm2.take_batch().samples] == [2, 2]


def test_trim_context():
    def turn(i: int) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": f"s{i}"},
                                             {"type": "image_url", "image_url": {"url": f"/i{i}.png"}}]},
                {"role": "assistant", "content": f"a{i}"}]
    current = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/now.png"}}]}
    msgs = [SYSTEM, TASK, *turn(1), *turn(2), *turn(3), current]
    out = trim_context(msgs, turns=1, images=2)
    # head (system, task) + last turn (s3/a3) + current; images only on the last 2 user turns
    assert [m.get("content") if m["role"] == "assistant" else m["role"] for m in out] == \
        ["system", "user", "user", "a3", "user"]
    assert out[2]["content"][1]["image_url"]["url"] == "/i3.png"
    out = trim_context(msgs, turns=None, images=1)
    # all turns kept, only the current screenshot; an image-only turn that lost its image says so
    assert len(out) == len(msgs)
    assert [p["type"] for p in out[2]["content"]] == ["text"]
    assert out[-1]["content"][0]["image_url"]["url"] == "/now.png"
    assert trim_context(msgs, turns=0, images=None)[2:] == [current]
    assert msgs[2]["content"][1]["image_url"]["url"] == "/i1.png"  # the input is not modified


def test_trajectory_samples(run):
    dm = DataManager(Cfg(group_size=2, granularity="trajectory"), blob_root=run)
    dm.add(make_record(run, status="success", steps=3))
    dm.add(make_record(run, status="failure", steps=3))
    batch = dm.take_batch()
    assert len(batch.samples) == 2
    s = batch.samples[0]
    assert s.step_index == 0 and s.advantage == approx(1.0)
    # system, task, (user, assistant) × 3 with the last reply appended
    assert [m["role"] for m in s.messages] == ["system", "user", "user", "assistant", "user", "assistant",
                                               "user", "assistant"]
    assert [(t["message_index"], t["step_index"], t["token_ids"][0]) for t in s.turns] == \
        [(3, 1, 101), (5, 2, 102), (7, 3, 103)]
    assert s.messages[7]["content"] == "Action: click 3"


def test_checkpoint_and_restore(run, tmp_path):
    state = tmp_path / "state"
    dm = DataManager(Cfg(group_size=3), blob_root=run, pool_dir=state / "pool", version=1)
    a, b = make_record(run, status="success", version=1), make_record(run, status="failure", version=1)
    dm.add(a)
    dm.add(b)
    dm.save_state(state)
    dm2 = DataManager(Cfg(group_size=3), blob_root=run, pool_dir=state / "pool")
    assert dm2.load_state(state)
    assert dm2.version == 1 and dm2.counters == dm.counters
    assert dm2.task_stats["t1"] == dm.task_stats["t1"]
    assert dm2.add(a) == "duplicate"  # seen ids survive the restart
    assert len(dm2.pool["t1"]) == 1
    dm2.add(make_record(run, status="failure", version=1))
    batch = dm2.take_batch()  # the two restored pending episodes + the new one form a group
    assert len(batch.groups) == 1 and len(batch.samples) == 6
    assert not DataManager(blob_root=run).load_state(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "data_manager.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        DataManager(blob_root=run).load_state(tmp_path / "bad")


async def test_get_batch_waits_for_a_group(run):
    dm = DataManager(Cfg(group_size=2), blob_root=run)
    records = [make_record(run, status=s) for s in ("success", "failure")]

    async def produce():
        for r in records:
            await asyncio.sleep(0.05)
            dm.add(r)

    prod = asyncio.create_task(produce())
    batch = await dm.get_batch(1, timeout_s=30)
    await prod
    assert len(batch.groups) == 1 and len(batch.samples) == 4
    # nothing more arrives: the timeout gives an empty batch
    empty = await dm.get_batch(1, timeout_s=0.1)
    assert empty.groups == [] and empty.samples == []


async def test_consume_a_run_dir_jsonl(run):
    for st in ("success", "failure", "infra_error"):
        JsonlSink(run / "episodes.jsonl").publish(make_record(run, status=st, steps=2 if st != "infra_error" else 0))
    dm = DataManager(Cfg(group_size=2))
    seen = []
    n = await dm.consume(read_jsonl(run / "episodes.jsonl"), blob_root=run,
                         on_added=lambda rec, out: seen.append(out))
    assert n == 3 and seen == [ACCEPTED, ACCEPTED, "infra_error"]
    assert len(dm.take_batch().samples) == 4


def test_missing_blob_root_is_a_clear_error(run):
    with pytest.raises(ValueError, match="blob_root"):
        DataManager().add(make_record(run))
    with pytest.raises(ValueError, match="granularity"):
        Cfg(granularity="sequence")


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:  # a real redis-server on a free loopback port
        yield server.url


async def test_consume_a_redis_stream(run: Path, redis_url: str) -> None:
    from osfarm.stream.redis_stream import RedisStreamSink, RedisStreamSource

    stream = f"osfarm:test-dm:{uuid.uuid4().hex[:8]}"
    sink = RedisStreamSink(redis_url, stream)
    for st in ("success", "failure", "failure"):
        sink.publish(make_record(run, status=st))
    sink.publish(make_record(run, status="infra_error", steps=0))
    source = RedisStreamSource(redis_url, stream, group="trainer")
    dm = DataManager(Cfg(group_size=3))
    outcomes: list[str] = []
    n = await asyncio.wait_for(dm.consume_redis(source, blob_root=run, stop=lambda: len(outcomes) >= 4,
                                                on_added=lambda rec, out: outcomes.append(out), block_ms=200),
                               timeout=60)
    assert n == 4 and outcomes == [ACCEPTED, ACCEPTED, ACCEPTED, "infra_error"]
    # every entry was acknowledged once stored: nothing pending for the group
    assert source.r.xpending(stream, "trainer")["pending"] == 0
    assert len(dm.take_batch().samples) == 6


def test_entropy_selection_is_on_by_default():
    assert DataConfig().entropy_fraction == 0.8  # DART: the top 80% of a batch's steps by entropy


def test_planned_groups_are_exactly_what_was_allocated(run):
    """The controller's plan is the grouping: two groups of one task stay apart (per-task pooling
    would mix them), a group closes with what it has, a rollout arriving after its group closed is
    late, a group left with one episode is too small, and each drop gives its capacity back."""
    released: list[tuple[str, int, str]] = []
    dm = DataManager(Cfg(), blob_root=run, on_discard=lambda t, n, why: released.append((t, n, why)))
    dm.expect_group("t1#g1", "t1", 3)
    dm.expect_group("t1#g2", "t1", 2)
    dm.expect_group("t2#g3", "t2", 4)
    g1 = [make_record(run, status=s, group_id="t1#g1") for s in ("success", "failure", "failure")]
    g2 = [make_record(run, status=s, group_id="t1#g2") for s in ("failure", "success")]
    for r in (g1[0], g2[0], g1[1], g2[1], g1[2]):
        assert dm.add(r) == ACCEPTED
    assert dm.pending == {} and dm.pending_episodes() == 5
    assert dm.take_batch().groups == []  # nothing closed yet
    dm.close_group("t1#g2")
    dm.close_group("t1#g1")
    assert dm.add(make_record(run, status="success", group_id="t1#g1")) == "late"  # a redundant straggler
    dm.add(make_record(run, "t2", status="failure", group_id="t2#g3"))
    dm.close_group("t2#g3")  # lost its other rollouts: one episode is no group
    batch = dm.take_batch()
    # in the order they were planned (g2 closed first), each group's episodes by content (successes
    # first), not by arrival: the same episodes make the same batch
    assert [(g.group_id, [e.record["episode_id"] for e in g.episodes]) for g in batch.groups] == [
        ("t1#g1", [r["episode_id"] for r in g1]), ("t1#g2", [g2[1]["episode_id"], g2[0]["episode_id"]])]
    assert batch.episodes == 5 and dm.counters["groups_too_small"] == 1 and dm.counters["late"] == 1
    assert batch.groups[1].advantages == approx([1.0, -1.0])
    assert released == [("t2", 1, "too_small")] and dm.pending_episodes() == 0


async def test_get_batch_takes_whole_groups_and_flushes_when_told(run):
    dm = DataManager(Cfg(), blob_root=run)
    for gid, n in (("a#1", 3), ("a#2", 3)):
        dm.expect_group(gid, "t1", n)
        for s in ("success", "failure", "failure")[:n]:
            dm.add(make_record(run, status=s, group_id=gid))
        dm.close_group(gid)
    batch = await dm.get_batch(4, timeout_s=10)  # 3 < 4: the next whole group too
    assert batch.episodes == 6 and len(batch.groups) == 2
    dm.expect_group("a#3", "t1", 2)
    for s in ("success", "failure"):
        dm.add(make_record(run, status=s, group_id="a#3"))
    dm.close_group("a#3")
    # fewer than asked, but the controller says nothing more can come: train on what there is
    batch = await asyncio.wait_for(dm.get_batch(4, flush=lambda: True, poll_s=0.05), 10)
    assert batch.episodes == 2


def test_pool_success_reaches_the_samples_of_a_planned_group(run, tmp_path):
    """An all-failure group trains with the pool's success (its old version does not make it
    stale), and the group's advantages are those of the group the learner sees."""
    dm = DataManager(Cfg(version_window=1), blob_root=run, pool_dir=tmp_path / "pool", version=0)
    dm.expect_group("g1", "t1", 2)
    old = make_record(run, status="success", version=0, group_id="g1")
    dm.add(old)
    dm.add(make_record(run, status="failure", version=0, group_id="g1"))
    dm.close_group("g1")
    dm.take_batch()
    dm.set_version(5)  # the pooled success is now 5 versions old
    dm.expect_group("g2", "t1", 3)
    fails = [make_record(run, status="failure", version=5, group_id="g2") for _ in range(3)]
    for r in fails:
        dm.add(r)
    dm.close_group("g2")
    batch = dm.take_batch()
    [g] = batch.groups
    assert g.episodes[-1].record["episode_id"] == old["episode_id"] and g.episodes[-1].from_pool
    assert g.advantages == approx([-1 / math.sqrt(2), -1 / math.sqrt(2), math.sqrt(2)])
    pooled = [s for s in batch.samples if s.from_pool]
    assert len(pooled) == 2 and all(s.advantage > 0 and s.policy_version == 0 for s in pooled)
    assert batch.counts["pool_samples"] == 2 and batch.counts["stale_steps"] == 0
    assert batch.episodes == 2  # the replayed success is not a rollout: the oldest failure gave way


def test_xrpo_sharpening_amplifies_unlikely_successes(run):
    dm = DataManager(Cfg(novelty_lambda=1.0), blob_root=run)
    dm.expect_group("g", "t1", 4)
    likely = make_record(run, status="success", logprob=-0.1, group_id="g")
    unlikely = make_record(run, status="success", logprob=-3.0, group_id="g")
    for r in (likely, unlikely, make_record(run, logprob=-1.0, group_id="g"), make_record(run, logprob=-1.0,
                                                                                          group_id="g")):
        dm.add(r)
    dm.close_group("g")
    [g] = dm.take_batch().groups
    plain = DataManager(Cfg(), blob_root=run)
    base = 1.0  # rewards [1, 1, 0, 0]: GRPO gives ±1
    assert g.advantages[0] == approx(base)  # more likely than the group's mean: unchanged
    assert g.advantages[1] == approx(base * (1 + math.tanh(3.0 - 1.275)))  # ℓ̄ = (−0.1 − 3 − 1 − 1)/4
    assert g.advantages[2:] == approx([-1.0, -1.0])
    assert plain.config.novelty_lambda == 0.0


def test_planned_groups_survive_a_restart(run, tmp_path):
    dm = DataManager(Cfg(), blob_root=run, version=1)
    dm.expect_group("g1", "t1", 4)
    for s in ("success", "failure", "failure"):
        dm.add(make_record(run, status=s, version=1, group_id="g1"))
    dm.save_state(tmp_path)
    dm2 = DataManager(Cfg(), blob_root=run)
    assert dm2.load_state(tmp_path) and dm2.pending_episodes() == 3
    # its other rollouts died with the process: it trains with the three it has
    [g] = dm2.take_batch().groups
    assert g.group_id == "g1" and len(g.episodes) == 3


def test_a_state_snapshot_is_what_gets_written(run, tmp_path):
    """The trainer snapshots the state on the event loop that feeds the data manager and writes the
    text from the learner's thread: what lands on disk is the snapshot, whatever arrived since."""
    dm = DataManager(Cfg(group_size=2), blob_root=run)
    dm.add(make_record(run, status="success"))
    text = dm.state_json()
    dm.add(make_record(run, status="failure"))  # arrives while the checkpoint is being written
    dm.save_state(tmp_path, text)
    saved = json.loads((tmp_path / "data_manager.json").read_text())
    assert saved["counters"]["records"] == 1 and dm.counters["records"] == 2


def test_a_broad_planned_group(run):
    """BroRL: one planned group of 256 rollouts is one GRPO group of 256."""
    dm = DataManager(Cfg(min_failure_steps=1), blob_root=run)
    dm.expect_group("broad", "t1", 256)
    for i in range(256):
        dm.add(make_record(run, status="success" if i % 4 == 0 else "failure", steps=1, group_id="broad"))
    dm.close_group("broad")
    batch = dm.take_batch()
    [g] = batch.groups
    assert len(g.episodes) == 256 and len(batch.samples) == 256
    assert sum(g.advantages) == approx(0.0, abs=1e-6) and max(g.advantages) == approx(math.sqrt(3))
