"""The experience pool: a few past successes kept per task (DART).

A group of failures only has no signal; replaying a stored success of the same task into it
gives the policy something to move towards. The pool outlives the process (one JSON file per
task in ``pool_dir``, rewritten whole on each change) and can be seeded from an eval run's
successes before training starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from osfarm.stream.jsonl import read_jsonl
from osfarm.trainer.data_state import atomic_write
from osfarm.trainer.episodes import Episode, episode_version, steps_with_request

Pool = dict[str, list[Episode]]  # a task's stored successes, oldest first


def keep_success(pool: Pool, ep: Episode, per_task: int) -> list[Episode]:
    """Store a success of ``ep``'s task (a pool copy of it; an episode stored before is replaced),
    keeping the newest ``per_task``; returns the task's entries."""
    task = ep.record["task_id"]
    entries = [e for e in pool.get(task, []) if e.record["episode_id"] != ep.record["episode_id"]]
    entries.append(Episode(ep.record, ep.blob_root, ep.reward, True, ep.version, ep.seq, from_pool=True))
    del entries[:-per_task]
    pool[task] = entries
    return entries


def _safe_name(task_id: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in task_id)
    return keep or "_"


def write_task_file(pool_dir: Path, task: str, entries: list[Episode]) -> None:
    atomic_write(pool_dir / f"{_safe_name(task)}.json",
                 json.dumps({"task_id": task, "entries": [e.to_json() for e in entries]}))


def load_pool(pool_dir: Path) -> Pool:
    """The pool stored in ``pool_dir`` (empty when the dir does not exist yet)."""
    pool: Pool = {}
    if not pool_dir.is_dir():
        return pool
    for p in sorted(pool_dir.glob("*.json")):
        try:
            d = json.loads(p.read_text())
            pool[d["task_id"]] = [Episode.from_json(e, from_pool=True) for e in d["entries"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}: not an experience-pool file ({e}); delete or fix it") from None
    return pool


def eval_successes(run_dir: Path, next_seq: Callable[[], int]) -> Iterator[Episode]:
    """The successful episodes of an eval run dir (``episodes.jsonl``) as pool entries, in the
    order they were recorded; ``next_seq`` numbers them in the data manager's arrival order."""
    path = Path(run_dir) / "episodes.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass an `osfarm eval` run dir")
    root = str(Path(run_dir).resolve())
    for rec in read_jsonl(path):
        if rec["status"] == "success" and steps_with_request(rec):
            yield Episode(rec, root, float(rec["score"] or 1.0), True, episode_version(rec), next_seq(),
                          from_pool=True)
