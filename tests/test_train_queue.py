"""The trainer's side of queued rollouts (osfarm/trainer/queued_rollouts.py), without workers:
every job reported to the rollout controller exactly once, whatever the stream and the result
backend say, and how many times they say it. Real DataManager, real RolloutController, real
records (blobs in a tmp run dir); the Celery app is built but never connects (nothing is sent)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_data_manager import make_record

from osfarm.runner.executors.celery_exec import RemoteEpisodeError
from osfarm.runner.executors.rollout_control import RolloutAborted
from osfarm.trainer.config import TrainConfig
from osfarm.trainer.data_manager import ACCEPTED, DataConfig, DataManager
from osfarm.trainer.loop import Rollout, Trainer
from osfarm.trainer.queued_rollouts import JobLost, JobRevoked, Outstanding, QueuedRollouts, rollout_episode_id
from osfarm.trainer.rollout_controller import ControllerConfig, RolloutController

pytestmark = pytest.mark.unit

RUN_ID = "run-1"
NOWHERE = "redis://127.0.0.1:1/0"  # never dialled: these tests send nothing


class Reports:
    def __init__(self) -> None:
        self.got: list[tuple[Any, dict[str, Any] | None, Any]] = []

    def __call__(self, item: Any, rec: dict[str, Any] | None, outcome: Any, _sent: float, _done: float) -> None:
        self.got.append((item, rec, outcome))


def queue() -> QueuedRollouts[str]:
    return QueuedRollouts(NOWHERE, "osfarm:test", RUN_ID, time_limit_s=20, record_grace_s=5, lost_after_s=100)


def record(run: Path, seq: int, **kw: Any) -> dict[str, Any]:
    return make_record(run, "t1", episode_id=rollout_episode_id(RUN_ID, "t1", seq), group_id="t1#g1", **kw)


def test_a_record_delivered_twice_is_reported_and_trained_once(tmp_path: Path) -> None:
    q, seen = queue(), Reports()
    dm = DataManager(DataConfig(entropy_fraction=1.0), blob_root=tmp_path)
    q.track("rollout-1", "t1", 1)
    rec = record(tmp_path, 1, status="success")
    q.take(rec, dm.add(rec), seen)
    q.take(rec, dm.add(rec), seen)  # the stream's redelivery, or a republished spill
    assert [(i, o) for i, _r, o in seen.got] == [("rollout-1", ACCEPTED)]
    assert dm.counters["duplicate"] == 1 and q.outstanding() == 0
    assert q.counts.records == 1 and q.counts.foreign == 0
    assert q.counts.timed == 1 and q.counts.overhead_ms() == 0.0  # the record says 9 s of episode: no more here
    # a record of no job of this process (an earlier trainer's): the data manager judges it, nobody is told
    other = make_record(tmp_path, "t1", episode_id="someone-else")
    q.take(other, dm.add(other), seen)
    assert len(seen.got) == 1 and q.counts.foreign == 1


def test_backend_states_give_one_report_each(tmp_path: Path) -> None:
    q, seen = queue(), Reports()
    dm = DataManager(DataConfig(entropy_fraction=1.0), blob_root=tmp_path)
    jobs = [q.track(f"rollout-{i}", "t1", i) for i in range(1, 6)]
    sent = jobs[0].sent
    # a running job the trainer aborted, stopped by its worker at a step: aborted, not failed
    stopped = q.track("rollout-0", "t1", 0)
    assert q.judge([(stopped, ("FAILURE", RolloutAborted("episode e: aborted by the trainer at a step")))],
                   sent + 1, dm, tmp_path, seen) == []
    assert isinstance(seen.got.pop()[2], JobRevoked) and q.counts.stopped == 1 and q.counts.failed == 0
    done = {"record": record(tmp_path, 3, status="success"), "row": {}}
    polled: list[tuple[Outstanding[str], tuple[str, Any]]] = [
        (jobs[0], ("FAILURE", RuntimeError("boom"))), (jobs[1], ("REVOKED", None)), (jobs[2], ("SUCCESS", done)),
        (jobs[3], ("STARTED", None)), (jobs[4], ("PENDING", None))]
    assert q.judge(polled, sent + 1, dm, tmp_path, seen) == []
    assert [i for i, _r, _o in seen.got] == ["rollout-1", "rollout-2"]
    assert isinstance(seen.got[0][2], RemoteEpisodeError) and isinstance(seen.got[1][2], JobRevoked)
    # the finished job's record has not come on the stream yet: wait for it, within the grace
    assert q.judge(polled[2:], sent + 4, dm, tmp_path, seen) == [] and len(seen.got) == 2
    # past the grace (the stream was full, the record spilled): taken from the result, once
    assert q.judge(polled[2:], sent + 7, dm, tmp_path, seen) == []
    assert seen.got[2][0] == "rollout-3" and seen.got[2][2] == ACCEPTED and q.counts.from_backend == 1
    assert q.judge(polled[2:], sent + 8, dm, tmp_path, seen) == [] and len(seen.got) == 3
    # nothing heard for longer than any delivery could take: lost, reported, to be revoked
    assert q.judge(polled[3:], sent + 101, dm, tmp_path, seen) == [jobs[3].task_id, jobs[4].task_id]
    assert all(isinstance(o, JobLost) for _i, _r, o in seen.got[3:]) and q.outstanding() == 0
    assert (q.counts.failed, q.counts.revoked, q.counts.lost) == (1, 1, 2)
    # a report that comes after all (the stream's record of a lost job) is not a second outcome
    late = record(tmp_path, 4)
    q.take(late, dm.add(late), seen)
    assert len(seen.got) == 5


def test_the_controller_counts_queued_jobs_and_retries_a_failed_one(tmp_path: Path) -> None:
    """Through the trainer's own report mapping: capacity counts jobs queued and running alike,
    a failed job is retried in its group, a revoked one is an abort, a duplicate changes nothing,
    and the group closes once every job is accounted for."""
    trainer = Trainer(TrainConfig(run_dir=tmp_path / "run"))
    dm = DataManager(DataConfig(entropy_fraction=1.0, group_size=2), blob_root=tmp_path)
    q: QueuedRollouts[Rollout] = QueuedRollouts(NOWHERE, "osfarm:test", trainer.run_id, time_limit_s=20)
    seq = 0

    async def submit(task_id: str, n: int, version: int, group_id: str) -> None:
        nonlocal seq
        for _ in range(n):
            seq += 1
            q.track(Rollout(task_id, seq, version, group_id), task_id, seq)

    closed: list[str] = []
    ccfg = ControllerConfig(batch_size=2, eta=0, max_concurrent=8, allocator="fixed", group_size=2, shuffle=False)
    controller = RolloutController(["t1"], submit, ccfg, task_stats=dm.task_stats, on_plan=dm.expect_group,
                                   on_close=closed.append)
    trainer.controller = controller
    assert asyncio.run(controller.fill()) == 2  # η = 0: one batch, one group of 2
    assert controller.gate.state.running == q.outstanding() == 2 and controller.capacity() == 0
    j1, j2 = list(q.jobs.values())
    gid = j1.item.group_id
    rec = make_record(tmp_path, "t1", status="success", episode_id=j1.episode_id, group_id=gid)
    q.take(rec, dm.add(rec, tmp_path), trainer._report)
    q.take(rec, dm.add(rec, tmp_path), trainer._report)  # delivered twice
    assert controller.gate.state.accepted == 1 and controller.gate.state.running == 1
    q.judge([(j2, ("FAILURE", RuntimeError("worker died")))], j2.sent + 1, dm, tmp_path, trainer._report)
    assert controller.running_of(gid) == 0 and not closed  # retried: the group still needs one
    assert asyncio.run(controller.fill()) == 1 and q.outstanding() == 1
    (j3,) = q.jobs.values()
    q.judge([(j3, ("REVOKED", None))], j3.sent + 1, dm, tmp_path, trainer._report)
    assert trainer.totals["aborted"] == 1 and not closed
    assert asyncio.run(controller.fill()) == 1  # the group still needs one: retried again
    (j4,) = q.jobs.values()
    rec = make_record(tmp_path, "t1", status="failure", episode_id=j4.episode_id, group_id=gid)
    q.take(rec, dm.add(rec, tmp_path), trainer._report)
    assert closed == [gid] and q.outstanding() == 0 and controller.gate.state.running == 0
    assert controller.gate.state.accepted == 2
    assert trainer.totals["episodes"] == 4  # one report per job: accepted, failed, revoked, accepted


def test_a_job_keeps_its_adapter_version_until_it_is_reported(tmp_path: Path) -> None:
    """The versions weight sync must not unload (issue 29, item 3): a non-interruptible job's,
    queued or running, until its one report; an interruptible job moves on and keeps none."""
    q, seen = queue(), Reports()
    dm = DataManager(DataConfig(entropy_fraction=1.0), blob_root=tmp_path)
    q.track("on-v1", "t1", 1, version=1, pinned=True)
    q.track("also-v1", "t1", 2, version=1, pinned=True)
    q.track("moves", "t1", 3, version=0, pinned=False)
    j4 = q.track("on-v2", "t1", 4, version=2, pinned=True)
    assert q.pinned_versions() == {1, 2}
    rec = record(tmp_path, 1, status="success")
    q.take(rec, dm.add(rec), seen)
    assert q.pinned_versions() == {1, 2}  # another job still keeps version 1
    q.judge([(j4, ("FAILURE", RuntimeError("boom")))], j4.sent + 1, dm, tmp_path, seen)
    assert q.pinned_versions() == {1}
    rec = record(tmp_path, 2, status="failure")
    q.take(rec, dm.add(rec), seen)
    assert q.pinned_versions() == set() and q.outstanding() == 1
