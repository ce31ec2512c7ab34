"""The data manager: finished episodes in, GRPO-grouped training samples out (DART's curation).

Episodes (``osfarm.episode/1`` records, from a run dir's JSONL, a Redis Stream or plain dicts)
pass DART's storage rules, update their task's statistics and wait until their group can be
formed. **Planned groups** (the trainer's case): the rollout controller plans each group — a task
and its number of rollouts n, from DART's dynamic n, XRPO's allocation, a fixed n or a BroRL-broad
n — registers it here (:meth:`expect_group`), tags every rollout with the group's id (the record's
``group_id``) and closes the group once its rollouts are done (:meth:`close_group`): the group is
exactly the rollouts that were planned together, so allocation and grouping always agree.
Records of no planned group (a stream fed by independent workers) are grouped per task instead: a
group is ``n`` not-yet-used episodes of one task, n the task's dynamic rollout number (DART)
unless ``group_size`` fixes it. Either way only episodes inside the version window count
(policy_version ≥ current − window). The group is trimmed to the newest n keeping at least one
success and one failure when it has them; a group that is all failures swaps its oldest episode
for the newest stored success of that task from the experience pool (or is dropped this round
when there is none; failures with differing partial scores already carry a signal and train as
they are); a group whose mean reward reaches ``acc_max`` or whose rewards are all equal carries
no GRPO signal and is dropped (``drop_no_signal=False`` keeps it, with zero advantages). Every
episode is used at most once.

Each episode of a group gets its GRPO advantage (its reward vs the group's; population std, see
advantages.py; XRPO's novelty sharpening optionally amplifies the successes the policy found
least likely) and becomes samples: one per assistant turn (step-level GRPO: the context is the
request the agent actually sent at that step — system prompt, instruction, its last K turns with
the last M screenshots — optionally cut shorter with ``context_turns``/``context_images``), or
one per trajectory. High-entropy selection (DART, on by default: the top 80%) then keeps the top
fraction of a batch's samples. Experience-pool episodes train with the group (their old policy
version does not make them stale: they are replayed as successes, π_b taken as π_prox).

Storage rules (DART): infra errors and failed model calls are not training data; failures (and
timeouts) are kept only if they ran at least ``min_failure_steps`` steps; a record seen twice
(a redelivered stream entry) counts once. Everything skipped is counted in :attr:`counters`.

State (task statistics, pending episodes, seen ids, counters, version) is checkpointed with
:meth:`save_state` and restored with :meth:`load_state`; the experience pool lives as one JSON
file per task in ``pool_dir`` and can be pre-loaded from an eval run dir's ``episodes.jsonl``.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
import os
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from osfarm.stream.blobs import BlobMissing, LocalBlobStore
from osfarm.stream.consumer import CLAIM_IDLE_MS, GroupSource, StreamConsumer
from osfarm.stream.jsonl import read_jsonl
from osfarm.stream.record import SchemaError, check_record
from osfarm.trainer.advantages import grpo_advantages, sharpen_advantages
from osfarm.trainer.allocation import TaskStats, dart_rollout_n
from osfarm.trainer.selection import (
    logprobs_as_floats,
    select_high_entropy,
    surprisal_entropy,
    topk_entropy,
)
from osfarm.trainer.staleness import in_version_window

log = logging.getLogger("osfarm.trainer.data")

STATE_SCHEMA = "osfarm.data_manager/1"
OMITTED = "(screenshot omitted: an earlier step)"
# where consume_redis journals records before acknowledging them (in the blob root by default)
STREAM_JOURNAL = "stream-journal.jsonl"

# add() outcomes
ACCEPTED = "accepted"
SKIP_REASONS = ("invalid", "duplicate", "infra_error", "model_error", "short_failure", "timeout",
                "no_model_data", "no_version", "stale", "late")


@dataclass
class Sample:
    """One training example for the learner.

    ``messages``: the chat the policy was prompted with (OpenAI format; image parts are
    ``{"type": "image_url", "image_url": {"url": U}}`` with U an absolute file path or a data
    URL: :func:`image_bytes` reads either). The response is ``response_token_ids`` (None for an
    experience-pool episode recorded without ids: tokenise ``response_text``) with the behaviour
    log-probs ``behav_logprobs`` (None when not recorded: use π_prox as π_b, weight 1).
    Trajectory samples (``step_index`` 0) put every assistant turn in ``messages`` and list the
    trained ones in ``turns``: ``{"message_index", "step_index", "token_ids", "logprobs",
    "policy_version"}``; their ``response_*`` fields are those of the last turn.
    """

    messages: list[dict[str, Any]]
    response_token_ids: list[int] | None
    behav_logprobs: list[float] | None
    policy_version: int | None
    advantage: float
    reward: float
    task_id: str
    group_id: str
    episode_id: str
    step_index: int
    response_text: str = ""
    entropy: float | None = None
    from_pool: bool = False
    turns: list[dict[str, Any]] | None = None


@dataclass
class DataConfig:
    version_window: int | None = 1  # DART: the latest 2 checkpoints (current and current − 1); None: no limit
    group_size: int | None = None  # None: the task's dynamic rollout number (DART), at least min_group_size
    min_group_size: int = 2
    rollout_n: int = 8  # DART's n for tasks below the success threshold
    rollout_threshold: float = 0.6
    acc_max: float = 1.0  # a group whose mean reward is >= this is too easy (no signal)
    # False: groups without a GRPO signal (too easy, equal rewards) train too, with zero
    # advantages: the version still advances and the KL/entropy terms still act (a solved task
    # otherwise stops producing updates)
    drop_no_signal: bool = True
    std_normalize: bool = True  # False: Dr.GRPO
    unbiased_std: bool = False
    eps: float = 1e-6
    granularity: Literal["step", "trajectory"] = "step"
    context_turns: int | None = None  # cut each request to its last K turns (None: as the agent sent it)
    context_images: int | None = None  # keep only the last M screenshots (None: as sent)
    entropy_fraction: float = 0.8  # DART's high-entropy selection: keep this top fraction of a batch's samples
    novelty_lambda: float = 0.0  # XRPO's advantage sharpening of unlikely successes (0: off)
    # which step's policy version decides whether an episode is stale: the oldest ("start"), or the
    # newest ("end", for interruptible rollouts: older steps are then dropped one by one)
    episode_version: Literal["start", "end"] = "start"
    min_failure_steps: int = 2  # DART: keep a failure only if it ran at least this many steps
    timeout_as_failure: bool = True  # a timed-out episode is a failure (reward = its score)
    pool_per_task: int = 4  # successes kept per task in the experience pool
    use_pool: bool = True
    image_mode: Literal["path", "data_url"] = "path"
    stats_window: int = 32  # recent episodes behind a task's success rate

    def __post_init__(self) -> None:
        if self.granularity not in ("step", "trajectory"):
            raise ValueError(f"granularity must be 'step' or 'trajectory', got {self.granularity!r}")
        if self.image_mode not in ("path", "data_url"):
            raise ValueError(f"image_mode must be 'path' or 'data_url', got {self.image_mode!r}")
        if not 0.0 <= self.entropy_fraction <= 1.0:
            raise ValueError(f"entropy_fraction must be in [0, 1], got {self.entropy_fraction}")
        if self.novelty_lambda < 0:
            raise ValueError(f"novelty_lambda must be >= 0, got {self.novelty_lambda}")
        if self.episode_version not in ("start", "end"):
            raise ValueError(f"episode_version must be 'start' or 'end', got {self.episode_version!r}")
        if self.min_group_size < 2:
            raise ValueError(f"min_group_size must be >= 2 (a group of one has no advantage), "
                             f"got {self.min_group_size}")


@dataclass(eq=False)
class _Episode:
    record: dict[str, Any]
    blob_root: str  # the dir the record's blob refs are relative to
    reward: float
    success: bool
    version: int | None  # the oldest policy version that produced a step (version_start)
    seq: int  # arrival order
    from_pool: bool = False
    version_end: int | None = None  # the newest policy version that produced a step

    @property
    def steps(self) -> int:
        return len(self.record.get("steps", []))

    def likelihood(self) -> float | None:
        """Mean log-prob per response token over the episode's steps (XRPO's sequence likelihood)."""
        vals: list[float] = []
        for st in self.record.get("steps", []):
            raw = (st.get("model") or {}).get("response_logprobs")
            if raw:
                vals += logprobs_as_floats(raw)
        return sum(vals) / len(vals) if vals else None

    def to_json(self) -> dict[str, Any]:
        return {"record": self.record, "blob_root": self.blob_root, "reward": self.reward, "success": self.success,
                "version": self.version, "seq": self.seq}

    @classmethod
    def from_json(cls, d: dict[str, Any], from_pool: bool = False) -> _Episode:
        rec = d["record"]
        return cls(rec, d["blob_root"], float(d["reward"]), bool(d["success"]), d.get("version"),
                   int(d.get("seq", 0)), from_pool, episode_version_end(rec))


@dataclass(eq=False)
class _Planned:
    """A group the rollout controller planned: its task, its size n and the episodes so far."""

    task_id: str
    size: int
    episodes: list[_Episode] = field(default_factory=list)
    closed: bool = False
    order: int = 0  # planning order: a batch lists its groups in it, whichever closed first


@dataclass
class Group:
    task_id: str
    group_id: str
    episodes: list[_Episode]
    advantages: list[float]


@dataclass
class Batch:
    samples: list[Sample]
    groups: list[Group] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # what building this batch skipped

    @property
    def episodes(self) -> int:
        """Rollouts this batch consumed (experience-pool replays are not rollouts)."""
        return sum(1 for g in self.groups for e in g.episodes if not e.from_pool)

    @property
    def size(self) -> int:
        """Episodes in its groups (what ``batch_size`` counts), pool replays included."""
        return sum(len(g.episodes) for g in self.groups)


# --------------------------------------------------------------------------- record helpers


def episode_version(rec: dict[str, Any]) -> int | None:
    """The oldest policy version that produced the episode (policy.version_start, else its steps')."""
    v = (rec.get("policy") or {}).get("version_start")
    if v is not None:
        return int(v)
    vs = [s["model"]["policy_version"] for s in rec.get("steps", [])
          if s.get("model") and s["model"].get("policy_version") is not None]
    return min(vs) if vs else None


def episode_version_end(rec: dict[str, Any]) -> int | None:
    """The newest policy version that produced a step (policy.version_end, else its steps')."""
    v = (rec.get("policy") or {}).get("version_end")
    if v is not None:
        return int(v)
    vs = [s["model"]["policy_version"] for s in rec.get("steps", [])
          if s.get("model") and s["model"].get("policy_version") is not None]
    return max(vs) if vs else None


def _is_ref(x: Any) -> bool:
    return isinstance(x, dict) and isinstance(x.get("sha256"), str) and isinstance(x.get("path"), str)


def image_bytes(url: str) -> bytes:
    """The bytes of a sample's image part URL: a data URL or a file path."""
    if url.startswith("data:"):
        return base64.b64decode(url.partition(",")[2])
    path = url.removeprefix("file://")
    return Path(path).read_bytes()


class _Resolver:
    """Reads a record's blobs (relative to ``root``) and rewrites image refs for the learner."""

    def __init__(self, root: str, image_mode: str):
        self.store = LocalBlobStore(Path(root))
        self.image_mode = image_mode

    def request(self, req: Any) -> list[dict[str, Any]] | None:
        if req is None:
            return None
        if _is_ref(req):
            req = json.loads(self.store.get(req))
        if isinstance(req, dict) and "messages" in req:
            req = req["messages"]
        if not isinstance(req, list):
            raise SchemaError(
                f"a step's model.request holds {type(req).__name__}, expected a list of chat messages")
        return self.images(req)

    def _url(self, ref: dict[str, Any]) -> str:
        if self.image_mode == "path":
            p = self.store._path(ref)
            if not p.is_file():
                raise BlobMissing(f"blob {ref.get('sha256')} not found at {p}")
            return str(p.resolve())
        data = self.store.get(ref)
        return f"data:{ref.get('media_type', 'image/png')};base64,{base64.b64encode(data).decode('ascii')}"

    def images(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = copy.deepcopy(messages)
        for m in out:
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, list):
                continue
            for part in content:
                iu = part.get("image_url") if isinstance(part, dict) else None
                if isinstance(iu, dict) and _is_ref(iu.get("blob")):
                    part["image_url"] = {"url": self._url(iu["blob"])}
                elif isinstance(iu, dict) and _is_ref(iu.get("url")):
                    part["image_url"] = {"url": self._url(iu["url"])}
        return out


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def trim_context(messages: list[dict[str, Any]], turns: int | None, images: int | None) -> list[dict[str, Any]]:
    """Cut a step's request to its last ``turns`` (user, assistant) turns and last ``images`` screenshots.

    The head (system prompt, task) is everything before the first turn's user message (the one
    just before the first assistant message); the final user message is the current observation.
    Dropped screenshots become the same placeholder text the agent uses.
    """
    msgs = copy.deepcopy(messages)
    if turns is not None:
        asst = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
        if len(asst) > turns:
            first_user = asst[0] - 1 if asst[0] > 0 and msgs[asst[0] - 1].get("role") == "user" else asst[0]
            keep_from = asst[len(asst) - turns] - 1 if turns > 0 else asst[-1] + 1
            msgs = msgs[:first_user] + msgs[keep_from:]
    if images is not None:
        seen = 0
        for m in reversed(msgs):
            content = m.get("content")
            if not isinstance(content, list):
                continue
            for j in range(len(content) - 1, -1, -1):
                if _is_image(content[j]):
                    seen += 1
                    if seen > images:
                        content.pop(j)
            if content and not any(_is_image(p) for p in content) and not any(
                    isinstance(p, dict) and p.get("type") == "text" and p.get("text") for p in content) or not content:
                content.append({"type": "text", "text": OMITTED})
    return msgs


def _version_of(model: dict[str, Any], ep: _Episode) -> int | None:
    v = model.get("policy_version")
    return int(v) if v is not None else ep.version


def _steps_with_model_data(rec: dict[str, Any]) -> int:
    return sum(1 for s in rec.get("steps", []) if s.get("model") and s["model"].get("request") is not None
               and s["model"].get("response_token_ids"))


def _steps_with_request(rec: dict[str, Any]) -> int:
    return sum(1 for s in rec.get("steps", []) if s.get("model") and s["model"].get("request") is not None)


def _canonical(ep: _Episode) -> tuple[float, str]:
    """An order of a group's episodes that does not depend on when each finished."""
    steps = [(s.get("model") or {}).get("response_token_ids") or (s.get("model") or {}).get("response_text")
             for s in ep.record.get("steps", [])]
    return (-ep.reward, json.dumps(steps))


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _safe_name(task_id: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in task_id)
    return keep or "_"


# --------------------------------------------------------------------------- the data manager

EntropyFn = Callable[[Sample], float | None]
DiscardFn = Callable[[str, int, str], None]  # (task_id, episodes, reason)
AddedFn = Callable[[dict[str, Any], str], None]  # (record, outcome)


class StreamEntry(Protocol):
    """One entry of a record stream (``osfarm.stream.redis_stream.Entry``)."""

    id: str
    record: dict[str, Any]


class RecordStream(Protocol):
    """A consumer-group record stream (``osfarm.stream.redis_stream.RedisStreamSource``): blocking
    calls, run in a thread here."""

    def pending_mine(self, count: int = ...) -> Sequence[StreamEntry]: ...

    def read(self, count: int = ..., block_ms: int | None = ...) -> Sequence[StreamEntry]: ...

    def ack(self, *ids: str) -> int: ...


class DataManager:
    def __init__(self, config: DataConfig | None = None, *, blob_root: Path | None = None,
                 pool_dir: Path | None = None, entropy_fn: EntropyFn | None = None, version: int = 0,
                 on_discard: DiscardFn | None = None):
        self.config = config or DataConfig()
        self.blob_root = str(Path(blob_root).resolve()) if blob_root else None
        self.pool_dir = Path(pool_dir) if pool_dir else None
        self.entropy_fn = entropy_fn
        # accepted episodes that will never train (dropped group, gone stale): the rollout
        # controller's release(n) gives their staleness capacity back
        self.on_discard = on_discard
        self.version = version
        self.task_stats: dict[str, TaskStats] = {}
        self.pending: dict[str, list[_Episode]] = {}
        self.pool: dict[str, list[_Episode]] = {}
        self.seen: set[str] = set()
        self.counters: dict[str, int] = {k: 0 for k in ("records", ACCEPTED, *SKIP_REASONS, "groups", "groups_too_easy",
                                                        "groups_zero_variance", "groups_all_fail_dropped",
                                                        "pool_replacements", "samples", "entropy_filtered",
                                                        "steps_skipped", "pool_added", "stale_steps",
                                                        "groups_too_small", "pool_samples")}
        self.planned: dict[str, _Planned] = {}  # planned groups by id (open, then closed)
        self.closed: deque[str] = deque()  # closed planned groups, in closing order, not yet trained
        self._seq = 0
        self._group_seq = 0
        self._plan_seq = 0
        self._arrived = asyncio.Event()  # set when an episode is accepted (get_batch waits on it)
        if self.pool_dir:
            self._load_pool()

    # ------------------------------------------------------------------ intake

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def _discard(self, task: str, eps: list[_Episode], reason: str) -> None:
        n = sum(1 for e in eps if not e.from_pool)
        if n and self.on_discard is not None:
            self.on_discard(task, n, reason)

    def add(self, record: dict[str, Any], blob_root: Path | str | None = None) -> str:
        """Take one finished episode; returns ``"accepted"`` or the reason it is not training data."""
        root = str(Path(blob_root).resolve()) if blob_root else self.blob_root
        if root is None:
            raise ValueError("the data manager needs the dir the record's blobs are relative to: pass blob_root")
        self._count("records")
        try:
            check_record(record)
        except SchemaError as e:
            log.warning("episode record skipped: %s", e)
            self._count("invalid")
            return "invalid"
        eid = record["episode_id"]
        if eid in self.seen:
            self._count("duplicate")
            return "duplicate"
        self.seen.add(eid)
        status = record["status"]
        if status == "infra_error":
            self._count("infra_error")
            return "infra_error"
        if any(s.get("model") and s["model"].get("error") for s in record["steps"]):
            self._count("model_error")
            return "model_error"
        if status == "timeout" and not self.config.timeout_as_failure:
            self._count("timeout")
            return "timeout"
        task = record["task_id"]
        reward = float(record["score"] or 0.0)
        success = status == "success"
        self.task_stats.setdefault(task, TaskStats(window=self.config.stats_window)).add(
            reward, success, len(record["steps"]))
        ep = _Episode(record, root, reward, success, episode_version(record), self._next_seq(),
                      version_end=episode_version_end(record))
        if success and self.config.use_pool and _steps_with_request(record):
            self._pool_add(ep)
        if not success and len(record["steps"]) < self.config.min_failure_steps:
            self._count("short_failure")
            return "short_failure"
        if not _steps_with_model_data(record):
            self._count("no_model_data")
            return "no_model_data"
        if self.config.version_window is not None:
            if self._staleness_version(ep) is None:
                self._count("no_version")
                return "no_version"
            if not self._in_window(ep):
                self._count("stale")
                return "stale"
        planned = self.planned.get(record.get("group_id") or "")
        if planned is not None and planned.closed:  # a redundant rollout that finished after its group closed
            self._count("late")
            return "late"
        if planned is not None:
            planned.episodes.append(ep)
        else:
            self.pending.setdefault(task, []).append(ep)
        self._count(ACCEPTED)
        self._arrived.set()
        return ACCEPTED

    def _staleness_version(self, ep: _Episode) -> int | None:
        return ep.version_end if self.config.episode_version == "end" else ep.version

    def _in_window(self, ep: _Episode) -> bool:
        if self.config.version_window is None or ep.from_pool:
            return True
        return in_version_window(self._staleness_version(ep), self.version, self.config.version_window)

    # ------------------------------------------------------------------ planned groups

    def expect_group(self, group_id: str, task_id: str, size: int) -> None:
        """The rollout controller planned ``size`` rollouts of ``task_id`` as one group; their
        records carry ``group_id``."""
        if size < 1:
            raise ValueError(f"group {group_id}: size must be >= 1, got {size}")
        if group_id in self.planned:
            raise ValueError(f"group {group_id} is already planned")
        self._plan_seq += 1
        self.planned[group_id] = _Planned(task_id, size, order=self._plan_seq)

    def close_group(self, group_id: str) -> None:
        """The group's rollouts are done (finished, failed for good, or cancelled as redundant): it
        trains with the episodes it has, at the next batch."""
        p = self.planned.get(group_id)
        if p is None or p.closed:
            return
        p.closed = True
        self.closed.append(group_id)
        self._arrived.set()

    def pending_episodes(self) -> int:
        """Accepted episodes not yet trained on or discarded (they count against the staleness capacity)."""
        return (sum(len(eps) for eps in self.pending.values())
                + sum(len(p.episodes) for p in self.planned.values()))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def consume(self, records: AsyncIterable[dict[str, Any]] | Iterable[dict[str, Any]],
                      blob_root: Path | None = None, on_added: AddedFn | None = None) -> int:
        """Add every record of a (sync or async) iterable; a blocking iterable is read in a thread.

        ``on_added(record, outcome)`` is called after each (e.g. to tell the rollout controller
        whether the episode was accepted). Returns how many records were read.
        """
        n = 0
        if isinstance(records, AsyncIterable):
            async for rec in records:
                n += 1
                out = self.add(rec, blob_root)
                if on_added:
                    on_added(rec, out)
            return n
        async for rec in iterate_in_thread(iter(records)):
            n += 1
            out = self.add(rec, blob_root)
            if on_added:
                on_added(rec, out)
        return n

    async def consume_redis(self, source: GroupSource, blob_root: Path | None = None, *,
                            journal: Path | None = None, stop: Callable[[], bool] | None = None,
                            on_added: AddedFn | None = None, block_ms: int = 1000,
                            claim_idle_ms: int = CLAIM_IDLE_MS) -> int:
        """Read a :class:`osfarm.stream.redis_stream.RedisStreamSource` until ``stop()``.

        Each entry is written to ``journal`` (fsynced; default ``<blob root>/stream-journal.jsonl``)
        and acknowledged before it is added (:class:`osfarm.stream.consumer.StreamConsumer`): a
        trainer killed at any moment loses nothing and takes nothing twice. At the start, journaled
        records this state has not seen (added after the last checkpoint) are added again; entries
        of dead consumers are reclaimed on a timer; invalid entries go to the dead-letter stream."""
        root = Path(blob_root) if blob_root else (Path(self.blob_root) if self.blob_root else None)
        if journal is None and root is None:
            raise ValueError("consume_redis needs a journal path (or a blob_root to keep it in)")
        consumer = StreamConsumer(source, journal or Path(root or ".") / STREAM_JOURNAL, claim_idle_ms=claim_idle_ms)
        n = 0

        def take(record: dict[str, Any]) -> None:
            nonlocal n
            out = self.add(record, blob_root)
            n += 1
            if on_added:
                on_added(record, out)

        for rec in await asyncio.to_thread(lambda: list(consumer.replay())):
            if rec["episode_id"] not in self.seen:
                take(rec)
        while stop is None or not stop():
            for e in await asyncio.to_thread(consumer.poll, 16, block_ms):
                take(e.record)
        return n

    def set_version(self, version: int) -> int:
        """The learner's new version; pending episodes now outside the window are dropped (returned)."""
        if version < self.version:
            raise ValueError(f"policy version went backwards: {self.version} -> {version}")
        self.version = version
        dropped = 0
        if self.config.version_window is None:
            return 0
        for task, eps in self.pending.items():
            keep = [e for e in eps if self._in_window(e)]
            dropped += len(eps) - len(keep)
            self.pending[task] = keep
            if len(keep) < len(eps):
                self._discard(task, [e for e in eps if e not in keep], "stale")
        for p in self.planned.values():
            keep = [e for e in p.episodes if self._in_window(e)]
            if len(keep) < len(p.episodes):
                dropped += len(p.episodes) - len(keep)
                self._discard(p.task_id, [e for e in p.episodes if e not in keep], "stale")
                p.episodes = keep
        self._count("stale", dropped)
        return dropped

    # ------------------------------------------------------------------ experience pool

    def _pool_add(self, ep: _Episode) -> None:
        task = ep.record["task_id"]
        entries = [e for e in self.pool.get(task, []) if e.record["episode_id"] != ep.record["episode_id"]]
        entries.append(_Episode(ep.record, ep.blob_root, ep.reward, True, ep.version, ep.seq, from_pool=True))
        del entries[:-self.config.pool_per_task]
        self.pool[task] = entries
        self._count("pool_added")
        if self.pool_dir:
            _atomic_write(self.pool_dir / f"{_safe_name(task)}.json",
                          json.dumps({"task_id": task, "entries": [e.to_json() for e in entries]}))

    def _load_pool(self) -> None:
        assert self.pool_dir is not None
        if not self.pool_dir.is_dir():
            return
        for p in sorted(self.pool_dir.glob("*.json")):
            try:
                d = json.loads(p.read_text())
                self.pool[d["task_id"]] = [_Episode.from_json(e, from_pool=True) for e in d["entries"]]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{p}: not an experience-pool file ({e}); delete or fix it") from None

    def preload_pool(self, run_dir: Path) -> int:
        """Put the successful episodes of an eval run dir (``episodes.jsonl``) in the pool; returns how many."""
        path = Path(run_dir) / "episodes.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: pass an `osfarm eval` run dir")
        n = 0
        root = str(Path(run_dir).resolve())
        for rec in read_jsonl(path):
            if rec["status"] == "success" and _steps_with_request(rec):
                self._pool_add(_Episode(rec, root, float(rec["score"] or 1.0), True, episode_version(rec),
                                        self._next_seq(), from_pool=True))
                n += 1
        return n

    # ------------------------------------------------------------------ groups

    def group_size(self, task: str) -> int:
        c = self.config
        if c.group_size is not None:
            return max(c.min_group_size, c.group_size)
        st = self.task_stats.get(task)
        n = dart_rollout_n(st.success_rate if st else None, rollout_n=c.rollout_n, threshold=c.rollout_threshold)
        return max(c.min_group_size, n)

    def ready_tasks(self) -> list[str]:
        """Tasks with enough unused in-window episodes for a group (oldest waiting first)."""
        ready = [(eps[0].seq, t) for t, eps in self.pending.items() if eps and len(eps) >= self.group_size(t)]
        return [t for _, t in sorted(ready)]

    def _choose(self, eps: list[_Episode], n: int) -> list[_Episode]:
        """The newest n, keeping at least one success and one failure when the candidates have them."""
        by_new = sorted(eps, key=lambda e: -e.seq)
        chosen = by_new[:n]
        for want in (True, False):
            if not any(e.success == want for e in chosen):
                extra = next((e for e in by_new[n:] if e.success == want), None)
                if extra is not None:  # all chosen are of the other kind: the oldest makes room
                    chosen.remove(min(chosen, key=lambda e: e.seq))
                    chosen.append(extra)
        return sorted(chosen, key=lambda e: e.seq)

    def form_groups(self, max_groups: int | None = None) -> list[Group]:
        """Form up to ``max_groups`` groups from the ready tasks (records of no planned group);
        their episodes count as used."""
        groups: list[Group] = []
        for task in self.ready_tasks():
            if max_groups is not None and len(groups) >= max_groups:
                break
            eps = self.pending.pop(task)
            chosen = self._choose(eps, self.group_size(task))
            picked = {id(e) for e in chosen}
            unused = [e for e in eps if id(e) not in picked]
            if unused:
                self.pending[task] = unused
            self._group_seq += 1
            g = self._make_group(task, chosen, f"{task}@v{self.version}#{self._group_seq}")
            if g is not None:
                groups.append(g)
        return groups

    def take_planned(self, episodes: int | None = None) -> list[Group]:
        """Groups of the closed planned groups, in closing order, until they hold ``episodes``
        episodes (None: all of them)."""
        groups: list[Group] = []
        order: dict[str, int] = {}
        got = 0
        while self.closed and (episodes is None or got < episodes):
            gid = self.closed.popleft()
            p = self.planned.pop(gid)
            order[gid] = p.order
            eps = [e for e in p.episodes if self._in_window(e)]
            if len(eps) < len(p.episodes):
                self._count("stale", len(p.episodes) - len(eps))
                self._discard(p.task_id, [e for e in p.episodes if e not in eps], "stale")
            if len(eps) < self.config.min_group_size:
                self._count("groups_too_small")
                self._discard(p.task_id, eps, "too_small")
                continue
            chosen = self._choose(eps, p.size)
            extra = [e for e in eps if e not in chosen]
            if extra:  # a redundant rollout accepted before the others were cancelled
                self._discard(p.task_id, extra, "redundant")
            # by content, not arrival: the same episodes give the same samples in the same order
            chosen.sort(key=_canonical)
            g = self._make_group(p.task_id, chosen, gid)
            if g is not None:
                groups.append(g)
                got += len(g.episodes)
        # the order they were planned in, not the order they happened to finish in: the same
        # episodes make the same batch (entropy-selection ties, summation order), run after run
        return sorted(groups, key=lambda g: order[g.group_id])

    def _make_group(self, task: str, chosen: list[_Episode], group_id: str) -> Group | None:
        """GRPO group of ``chosen`` (the pool's success in for an all-failure group, no-signal
        groups dropped, advantages); None when it does not train (its episodes are discarded)."""
        c = self.config
        rewards = [e.reward for e in chosen]
        if max(rewards) == min(rewards) and not any(e.success for e in chosen):
            # all failures, no signal: the newest stored success of the task replaces the oldest
            stored = self.pool.get(task) if c.use_pool else None
            if not stored:
                self._count("groups_all_fail_dropped")
                self._discard(task, chosen, "all_fail")
                return None
            oldest, *rest = sorted(chosen, key=lambda e: e.seq)
            self._discard(task, [oldest], "replaced_by_pool")
            chosen = [*rest, stored[-1]]
            rewards = [e.reward for e in chosen]
            self._count("pool_replacements")
        if sum(rewards) / len(rewards) >= c.acc_max:
            self._count("groups_too_easy")
            if c.drop_no_signal:
                self._discard(task, chosen, "too_easy")
                return None
        elif max(rewards) == min(rewards):
            self._count("groups_zero_variance")
            if c.drop_no_signal:
                self._discard(task, chosen, "zero_variance")
                return None
        adv = grpo_advantages(rewards, std_normalize=c.std_normalize, eps=c.eps, unbiased=c.unbiased_std)
        if c.novelty_lambda > 0:
            adv = sharpen_advantages(adv, [e.success for e in chosen], [e.likelihood() for e in chosen],
                                     c.novelty_lambda)
        self._count("groups")
        return Group(task, group_id, chosen, adv)

    # ------------------------------------------------------------------ samples

    def build_samples(self, groups: list[Group]) -> Batch:
        """Samples of the groups (reads blobs: call from a worker thread in async code), with
        high-entropy selection applied over the whole batch."""
        samples: list[Sample] = []
        counts: dict[str, int] = {"steps_skipped": 0, "stale_steps": 0}
        window = self.config.version_window
        for g in groups:
            for ep, adv in zip(g.episodes, g.advantages, strict=True):
                got, skipped = self._episode_samples(ep, adv, g.group_id)
                if window is not None:  # a step of an interrupted episode may be older than its episode's version
                    fresh = [s for s in got if s.from_pool or s.policy_version is None
                             or in_version_window(s.policy_version, self.version, window)]
                    counts["stale_steps"] += len(got) - len(fresh)
                    got = fresh
                samples += got
                counts["steps_skipped"] += skipped
        if self.config.entropy_fraction < 1.0 and samples:
            keep = select_high_entropy([s.entropy for s in samples], self.config.entropy_fraction)
            counts["entropy_filtered"] = sum(1 for k in keep if not k)
            samples = [s for s, k in zip(samples, keep, strict=True) if k]
        counts["samples"] = len(samples)
        counts["pool_samples"] = sum(1 for s in samples if s.from_pool)
        return Batch(samples, groups, counts)

    def take_batch(self, max_groups: int | None = None) -> Batch:
        """Form groups (closed planned ones, then per task) and build their samples now (synchronous)."""
        groups = self.take_planned() if max_groups is None else []
        if max_groups is not None:
            while len(groups) < max_groups and self.closed:
                groups += self.take_planned(1)
        groups += self.form_groups(None if max_groups is None else max(0, max_groups - len(groups)))
        batch = self.build_samples(groups)
        self._merge(batch.counts)
        return batch

    def _take(self, episodes: int) -> list[Group]:
        """Groups holding up to about ``episodes`` episodes: closed planned groups first (whole
        groups: the last may overshoot), then per-task groups."""
        groups = self.take_planned(episodes)
        got = sum(len(g.episodes) for g in groups)
        while got < episodes:
            more = self.form_groups(1)
            if not more:
                break
            groups += more
            got += len(more[0].episodes)
        return groups

    async def get_batch(self, episodes: int, *, timeout_s: float | None = None,
                        flush: Callable[[], bool] | None = None, poll_s: float = 0.5) -> Batch:
        """Wait until whole groups holding at least ``episodes`` episodes are formed (or
        ``timeout_s`` passes, or ``flush()`` says nothing more can come: then the groups formed so
        far, possibly none), then build their samples in a worker thread."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        groups: list[Group] = []
        got = 0
        while True:
            self._arrived.clear()
            new = self._take(episodes - got)
            groups += new
            got += sum(len(g.episodes) for g in new)
            if got >= episodes or (groups and flush is not None and flush()):
                break
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                break
            wait = poll_s if flush is not None and (left is None or left > poll_s) else left
            try:
                await asyncio.wait_for(self._arrived.wait(), wait)
            except TimeoutError:
                if wait is not None and wait == left:
                    break
        batch = await asyncio.to_thread(self.build_samples, groups)
        self._merge(batch.counts)
        return batch

    def _merge(self, counts: dict[str, int]) -> None:
        for k, v in counts.items():
            self._count(k, v)

    def _entropy(self, s: Sample, raw_logprobs: list[Any] | None) -> float | None:
        if self.entropy_fn is not None:
            return self.entropy_fn(s)
        if not raw_logprobs:
            return None
        return topk_entropy(raw_logprobs) if isinstance(raw_logprobs[0], dict) and raw_logprobs[0].get(
            "top_logprobs") else surprisal_entropy(raw_logprobs)

    def _episode_samples(self, ep: _Episode, adv: float, group_id: str) -> tuple[list[Sample], int]:
        rec = ep.record
        res = _Resolver(ep.blob_root, self.config.image_mode)
        steps = [s for s in rec["steps"] if s.get("model")]
        skipped = len(rec["steps"]) - len(steps)
        if self.config.granularity == "trajectory":
            sample = self._trajectory_sample(ep, adv, group_id, steps, res)
            return ([sample] if sample else []), (0 if sample else 1)
        out = []
        for st in steps:
            m = st["model"]
            ids = m.get("response_token_ids")
            if not ids and not ep.from_pool:
                skipped += 1
                continue
            try:
                msgs = res.request(m.get("request"))
            except (BlobMissing, ValueError) as e:
                log.warning("episode %s step %s skipped: %s", rec["episode_id"], st["index"], e)
                msgs = None
            if msgs is None:
                skipped += 1
                continue
            msgs = trim_context(msgs, self.config.context_turns, self.config.context_images)
            raw = m.get("response_logprobs")
            lps = logprobs_as_floats(raw) if raw else None
            if lps is not None and ids and len(lps) != len(ids):
                log.warning("episode %s step %s: %d log-probs for %d tokens; step skipped", rec["episode_id"],
                            st["index"], len(lps), len(ids))
                skipped += 1
                continue
            s = Sample(messages=msgs, response_token_ids=list(ids) if ids else None, behav_logprobs=lps,
                       policy_version=_version_of(m, ep), advantage=adv, reward=ep.reward,
                       task_id=rec["task_id"], group_id=group_id, episode_id=rec["episode_id"],
                       step_index=st["index"], response_text=m.get("response_text") or "", from_pool=ep.from_pool)
            s.entropy = self._entropy(s, raw)
            out.append(s)
        return out, skipped

    def _trajectory_sample(self, ep: _Episode, adv: float, group_id: str, steps: list[dict[str, Any]],
                           res: _Resolver) -> Sample | None:
        """The last step's request + its reply; the assistant turns in it map back to the steps
        (from the end), so the agent must have run with history_turns ≥ the episode's length
        for the whole trajectory to train."""
        rec = ep.record
        if not steps:
            return None
        last = steps[-1]["model"]
        try:
            msgs = res.request(last.get("request"))
        except (BlobMissing, ValueError) as e:
            log.warning("episode %s skipped: %s", rec["episode_id"], e)
            return None
        if msgs is None:
            return None
        msgs = trim_context(msgs, self.config.context_turns, self.config.context_images)
        msgs.append({"role": "assistant", "content": last.get("response_text") or ""})
        asst = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
        turns = []
        all_lps: list[Any] = []
        for mi, st in zip(reversed(asst), reversed(steps), strict=False):
            m = st["model"]
            ids = m.get("response_token_ids")
            if not ids and not ep.from_pool:
                continue
            raw = m.get("response_logprobs")
            all_lps += raw or []
            turns.append({"message_index": mi, "step_index": st["index"], "token_ids": list(ids) if ids else None,
                          "logprobs": logprobs_as_floats(raw) if raw else None,
                          "policy_version": _version_of(m, ep)})
        if not turns:
            return None
        turns.reverse()
        lps = logprobs_as_floats(last["response_logprobs"]) if last.get("response_logprobs") else None
        ids = last.get("response_token_ids")
        s = Sample(messages=msgs, response_token_ids=list(ids) if ids else None, behav_logprobs=lps,
                   policy_version=_version_of(last, ep), advantage=adv, reward=ep.reward,
                   task_id=rec["task_id"], group_id=group_id, episode_id=rec["episode_id"], step_index=0,
                   response_text=last.get("response_text") or "", from_pool=ep.from_pool, turns=turns)
        s.entropy = self._entropy(s, all_lps)
        return s

    # ------------------------------------------------------------------ checkpoint

    def state(self) -> dict[str, Any]:
        return {"schema": STATE_SCHEMA, "version": self.version, "counters": dict(self.counters),
                "task_stats": {t: s.to_json() for t, s in self.task_stats.items()},
                "pending": {t: [e.to_json() for e in eps] for t, eps in self.pending.items() if eps},
                # planned groups, open or closed: their rollouts died with the process, so a resumed
                # run trains each with the episodes it has
                "planned": {gid: {"task_id": p.task_id, "size": p.size, "episodes": [e.to_json() for e in p.episodes]}
                            for gid, p in self.planned.items() if p.episodes},
                "seen": sorted(self.seen), "seq": self._seq, "group_seq": self._group_seq,
                "config": asdict(self.config)}

    def save_state(self, state_dir: Path, text: str | None = None) -> Path:
        """Write ``data_manager.json`` in ``state_dir`` (atomically); the pool is already on disk.
        ``text``: a :meth:`state_json` taken earlier (where the state may change meanwhile, e.g.
        written from another thread than the event loop that feeds this manager)."""
        p = Path(state_dir) / "data_manager.json"
        _atomic_write(p, text if text is not None else self.state_json())
        return p

    def state_json(self) -> str:
        """The state as JSON text: a snapshot, safe to write from another thread."""
        return json.dumps(self.state())

    def load_state(self, state_dir: Path) -> bool:
        """Restore what :meth:`save_state` wrote (False when there is nothing to restore)."""
        p = Path(state_dir) / "data_manager.json"
        if not p.is_file():
            return False
        try:
            d = json.loads(p.read_text())
        except ValueError as e:
            raise ValueError(f"{p}: not JSON ({e}); delete it to start the data manager afresh") from None
        if d.get("schema") != STATE_SCHEMA:
            raise ValueError(f"{p}: schema {d.get('schema')!r}, this reader knows {STATE_SCHEMA}")
        self.version = int(d["version"])
        self.counters.update({k: int(v) for k, v in d["counters"].items()})
        self.task_stats = {t: TaskStats.from_json(s) for t, s in d["task_stats"].items()}
        self.pending = {t: [_Episode.from_json(e) for e in eps] for t, eps in d["pending"].items()}
        self.planned, self.closed = {}, deque()
        for gid, g in d.get("planned", {}).items():
            self.planned[gid] = _Planned(g["task_id"], int(g["size"]), [_Episode.from_json(e) for e in g["episodes"]],
                                         closed=True)
            self.closed.append(gid)
        self.seen = set(d["seen"])
        self._seq = int(d["seq"])
        self._group_seq = int(d["group_seq"])
        return True


# --------------------------------------------------------------------------- async helpers


_END = object()
T = TypeVar("T")


async def iterate_in_thread(it: Iterator[T]) -> AsyncIterator[T]:
    """An async iterator over a blocking one (e.g. :func:`osfarm.stream.jsonl.follow_jsonl`):
    each ``next`` runs in a worker thread so the event loop keeps going."""
    while True:
        item = await asyncio.to_thread(next, it, _END)
        if item is _END:
            return
        yield item
