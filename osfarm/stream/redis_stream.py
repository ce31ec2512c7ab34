"""Episode records on a Redis Stream: a producer with backpressure and a consumer-group source.

Producer (``RedisStreamSink.publish``):
* one entry per episode id, ever: a Lua script checks a dedupe key and XADDs atomically, so a
  redelivered episode (Celery after a worker died) never yields a second entry;
* backpressure: while the stream holds more than ``max_backlog`` entries not yet acknowledged
  by its slowest consumer group (pending + never delivered; every entry when no group exists),
  ``publish`` waits up to ``wait_s``; then it appends the record to a local spill JSONL file and
  logs a warning saying so. Nothing is dropped: ``republish_spill`` puts spilled records back.
* no ``XADD MAXLEN``: trimming by length can delete entries nobody has read. ``trim_consumed``
  trims by ``MINID`` below the oldest entry some group still needs.

Consumer (``RedisStreamSource``): ``XREADGROUP`` new entries, ``XACK`` them once stored, and
``claim_stale`` (``XAUTOCLAIM``) takes over entries a dead consumer read but never acknowledged.
An entry that is not a valid record, or that was delivered ``max_deliveries`` times without an
ack (it kills whoever reads it), goes to the dead-letter stream ``<stream>:dead`` with the reason
and is acknowledged in the same transaction: the consumer moves on and nothing is lost silently.
:class:`osfarm.stream.consumer.StreamConsumer` adds the durable write before the ack and the
timer that reclaims entries of dead consumers.

Stores (``store_result``): a producer that also keeps a result per job (the Celery worker) writes
the result, the record's stream entry and its dedupe key in one Lua script, so a crash leaves
either all of them or none, and a rerun finds the result instead of publishing a second record.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.typing import EncodableT, FieldT, XReadGroupResponse

from osfarm.schema.episode import SchemaError, check_record
from osfarm.stream.jsonl import JsonlSink, read_jsonl
from osfarm.stream.redis_source import bound_connection_class

log = logging.getLogger("osfarm.stream")

DEFAULT_STREAM = "osfarm:episodes"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEDUPE_TTL_S = 30 * 24 * 3600
# An entry read this many times without an ack is poison (its consumer dies on it): dead-lettered.
MAX_DELIVERIES = 5
DEAD_SUFFIX = ":dead"

# KEYS[1] stream, KEYS[2] dedupe key; ARGV: episode id, record JSON, dedupe ttl.
# Returns the new entry id, or {"dup", existing id} when the episode was published before.
_PUBLISH_LUA = """
local prev = redis.call('GET', KEYS[2])
if prev then return {'dup', prev} end
local id = redis.call('XADD', KEYS[1], '*', 'episode_id', ARGV[1], 'record', ARGV[2])
redis.call('SET', KEYS[2], id, 'EX', tonumber(ARGV[3]))
return {'new', id}
"""


# KEYS[1] result key, KEYS[2] stream, KEYS[3] dedupe key; ARGV: result JSON, result ttl, episode
# id, record JSON ('' = no stream entry), dedupe ttl. Returns {'stored'|'existing', result JSON,
# entry id or ''}: an existing result wins (the job finished before: nothing is written).
_STORE_LUA = """
local prev = redis.call('GET', KEYS[1])
if prev then return {'existing', prev, ''} end
local entry = ''
if ARGV[4] ~= '' then
  entry = redis.call('GET', KEYS[3])
  if not entry then
    entry = redis.call('XADD', KEYS[2], '*', 'episode_id', ARGV[3], 'record', ARGV[4])
    redis.call('SET', KEYS[3], entry, 'EX', tonumber(ARGV[5]))
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
return {'stored', ARGV[1], entry}
"""


def connect(url: str, source_address: str | None = None) -> redis.Redis:
    """A client that retries a command across a short Redis outage (restart, failover); its
    connections leave from ``source_address`` when given (a worker bound to its host's address)."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    bound: dict[str, Any] = {}
    if source_address and url.startswith(("redis://", "rediss://")):  # a unix socket has no source address
        tls = url.startswith("rediss://")
        bound = {"connection_class": bound_connection_class(redis.SSLConnection if tls else redis.Connection),
                 "source_address": source_address}
    return redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5, socket_timeout=30,
                                health_check_interval=10, retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), 8),
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError], **bound)


# one stream entry as read through connect()'s decoding client; fields None: deleted while pending
EntryRow = tuple[str, dict[str, str] | None]


def _text(v: bytes | str) -> str:
    """A reply value as text (connect() decodes replies; bytes come only from a client made otherwise)."""
    return v.decode() if isinstance(v, bytes) else v


def _group_entries(resp: XReadGroupResponse) -> list[EntryRow]:
    """The entries of the one stream an XREADGROUP asked for (RESP2 reply: [[stream, entries]])."""
    if not resp:
        return []
    if not isinstance(resp, list):
        raise TypeError(f"XREADGROUP gave a RESP3 reply ({type(resp).__name__}); connect() speaks RESP2")
    entries: list[EntryRow] = resp[0][1]
    return entries


def dedupe_key(stream: str, episode_id: str) -> str:
    return f"{stream}:published:{episode_id}"


def dead_letter_stream(stream: str) -> str:
    return stream + DEAD_SUFFIX


def dead_letter(r: redis.Redis, stream: str, group: str, consumer: str, entry_id: str,
                fields: dict[str, str] | None, reason: str) -> str:
    """Move one entry to ``<stream>:dead`` (with the reason and who gave up on it) and acknowledge
    it, in one transaction: the entry is never both lost and acknowledged."""
    dead: dict[FieldT, EncodableT] = {
        "stream": stream, "entry_id": entry_id, "group": group, "consumer": consumer, "reason": reason[:4000],
        "fields": json.dumps(fields or {}, ensure_ascii=False), "at": f"{time.time():.3f}"}
    pipe = r.pipeline(transaction=True)
    pipe.xadd(dead_letter_stream(stream), dead)
    pipe.xack(stream, group, entry_id)
    dead_id = str(pipe.execute()[0])
    log.warning("stream %s entry %s dead-lettered to %s: %s", stream, entry_id, dead_letter_stream(stream), reason)
    return dead_id


def dead_letters(r: redis.Redis, stream: str, count: int = 1000) -> list[dict[str, Any]]:
    """The dead-lettered entries of ``stream`` (oldest first), each with its reason."""
    return [{"id": i, **{_text(k): _text(v) for k, v in (f or {}).items()}}
            for i, f in r.xrange(dead_letter_stream(stream), count=count) or []]


@dataclass
class Stored:
    status: str  # "stored" | "existing"
    result: str  # the result JSON now in Redis (ours, or the earlier one)
    entry_id: str | None  # the record's stream entry (None: no stream, or not ours to tell)


def store_result(r: redis.Redis, result_key: str, result_json: str, result_ttl_s: int, *, stream: str | None = None,
                 record: dict[str, Any] | None = None) -> Stored:
    """Store a job's result and publish its record, atomically and once (see the module doc).

    With ``stream``/``record`` unset only the result is stored (a spilled record, no stream)."""
    rec_json = json.dumps(record, ensure_ascii=False) if (stream and record is not None) else ""
    eid = record["episode_id"] if record is not None else ""
    keys = [result_key, stream or "-", dedupe_key(stream, eid) if stream and eid else "-"]
    kind, value, entry = r.eval(_STORE_LUA, 3, *keys, result_json, int(result_ttl_s), eid, rec_json, DEDUPE_TTL_S)
    return Stored(str(kind), str(value), str(entry) or None)


@dataclass
class Published:
    status: str  # "published" | "duplicate" | "spilled"
    entry_id: str | None  # the stream entry (the earlier one for a duplicate); None when spilled
    spill_path: Path | None = None


@dataclass
class GroupInfo:
    name: str
    consumers: int
    pending: int
    lag: int  # entries never delivered to this group
    last_delivered: str


def _lag(r: redis.Redis, stream: str, g: dict[str, Any], limit: int) -> int:
    lag = g.get("lag")
    if lag is not None:
        return int(lag)
    # Redis cannot tell (entries deleted in the middle): count what follows the last delivery
    return len(r.xrange(stream, min=f"({g['last-delivered-id']}", max="+", count=limit + 1) or [])


def groups(r: redis.Redis, stream: str, limit: int = 1_000_000) -> list[GroupInfo]:
    try:
        raw = r.xinfo_groups(stream)
    except redis.ResponseError as e:  # no such stream yet
        if "no such key" in str(e).lower():
            return []
        raise
    return [GroupInfo(name=g["name"], consumers=int(g["consumers"]), pending=int(g["pending"]),
                      lag=_lag(r, stream, g, limit), last_delivered=g["last-delivered-id"]) for g in raw]


def backlog(r: redis.Redis, stream: str, limit: int = 1_000_000) -> int:
    """Entries the slowest group has not acknowledged (every entry when no group reads yet)."""
    gs = groups(r, stream, limit)
    if not gs:
        return int(r.xlen(stream))
    return max(g.pending + g.lag for g in gs)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def trim_consumed(r: redis.Redis, stream: str) -> int:
    """Delete entries every group has acknowledged (XTRIM MINID); returns how many went."""
    gs = r.xinfo_groups(stream) if r.exists(stream) else []
    if not gs:
        return 0  # nobody has consumed anything we could prove
    keep_from: tuple[int, int] | None = None
    for g in gs:
        if int(g["pending"]):
            oldest = r.xpending(stream, g["name"])["min"]
            need = _id_key(oldest)
        else:
            ms, seq = _id_key(g["last-delivered-id"])
            need = (ms, seq + 1)
        keep_from = need if keep_from is None or need < keep_from else keep_from
    assert keep_from is not None
    return int(r.xtrim(stream, minid=f"{keep_from[0]}-{keep_from[1]}", approximate=False))


class RedisStreamSink:
    """Publishes episode records to ``stream`` (see the module doc for the guarantees)."""

    def __init__(self, url: str = DEFAULT_REDIS, stream: str = DEFAULT_STREAM, *, max_backlog: int = 10_000,
                 wait_s: float = 60.0, poll_s: float = 0.2, spill: Path | None = None,
                 client: redis.Redis | None = None, trim_every: int = 100):
        self.r = client or connect(url)
        self.stream = stream
        self.max_backlog = max_backlog
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.spill = Path(spill) if spill else Path(os.environ.get("OSFARM_STATE_DIR", ".")) / "stream-spill.jsonl"
        self.trim_every = trim_every
        self._n = 0
        self._script = self.r.register_script(_PUBLISH_LUA)

    def wait_for_room(self) -> bool:
        """Wait up to ``wait_s`` while the stream holds ``max_backlog`` unacknowledged entries;
        False when it is still full."""
        deadline = time.monotonic() + self.wait_s
        while True:
            if backlog(self.r, self.stream, self.max_backlog) < self.max_backlog:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_s)

    def has_room(self) -> bool:
        return backlog(self.r, self.stream, self.max_backlog) < self.max_backlog

    def publish(self, rec: dict[str, Any]) -> Published:
        """Publish once per episode id; waits while the stream is full, then spills (and says so)."""
        check_record(rec)
        eid = rec["episode_id"]
        prev = self.r.get(dedupe_key(self.stream, eid))
        if prev:
            return Published("duplicate", _text(prev))
        if not self.wait_for_room():
            JsonlSink(self.spill, fsync=True).publish(rec)
            log.warning("stream %s holds >= %d unconsumed episodes after %.0f s: episode %s spilled to %s "
                        "(re-publish with `osfarm stream republish %s`)", self.stream, self.max_backlog,
                        self.wait_s, eid, self.spill, self.spill)
            return Published("spilled", None, self.spill)
        return self.publish_now(rec)

    def publish_now(self, rec: dict[str, Any]) -> Published:
        """XADD without waiting for room (still once per episode id)."""
        eid = rec["episode_id"]
        kind, entry = self._script(keys=[self.stream, dedupe_key(self.stream, eid)],
                                   args=[eid, json.dumps(rec, ensure_ascii=False), DEDUPE_TTL_S])
        self._n += 1
        if self.trim_every and self._n % self.trim_every == 0:
            trim_consumed(self.r, self.stream)
        return Published("published" if kind == "new" else "duplicate", entry)


def republish_spill(sink: RedisStreamSink, path: Path) -> dict[str, int]:
    """Publish a spill file's records again, in order, while the stream has room; the records
    that still do not fit stay in the file (rewritten atomically)."""
    path = Path(path)
    left: list[dict[str, Any]] = []
    counts = {"published": 0, "duplicate": 0, "kept": 0}
    for rec in read_jsonl(path):
        if left or not sink.has_room():
            left.append(rec)
            continue
        counts[sink.publish_now(rec).status] += 1
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for rec in left:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    tmp.replace(path)
    counts["kept"] = len(left)
    return counts


@dataclass
class Entry:
    id: str
    record: dict[str, Any]


def _consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RedisStreamSource:
    """One consumer of a consumer group on ``stream`` (created at the stream's start if missing).

    Reads never raise on a bad entry: it is dead-lettered with the reason (``dead_lettered``
    counts them) and the read returns the good ones."""

    def __init__(self, url: str = DEFAULT_REDIS, stream: str = DEFAULT_STREAM, group: str = "trainer",
                 consumer: str | None = None, *, client: redis.Redis | None = None, start_id: str = "0",
                 max_deliveries: int = MAX_DELIVERIES):
        self.r = client or connect(url)
        self.stream, self.group = stream, group
        self.consumer = consumer or _consumer_name()
        self.max_deliveries = max_deliveries
        self.dead_lettered = 0
        self._ensure_group(start_id)

    def _ensure_group(self, start_id: str = "0") -> None:
        try:
            self.r.xgroup_create(self.stream, self.group, id=start_id, mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _dead(self, entry_id: str, fields: dict[str, str] | None, reason: str) -> None:
        dead_letter(self.r, self.stream, self.group, self.consumer, entry_id, fields, reason)
        self.dead_lettered += 1

    def _entries(self, raw: list[EntryRow]) -> list[Entry]:
        out = []
        for eid, fields in raw:
            if fields is None:  # deleted while pending (trimmed): nothing to read, nothing to keep
                self.ack(eid)
                continue
            try:
                text = fields["record"]
            except KeyError:
                self._dead(eid, fields, "no 'record' field in the entry")
                continue
            try:
                out.append(Entry(eid, check_record(json.loads(text))))
            except (ValueError, SchemaError) as e:  # JSONDecodeError is a ValueError
                self._dead(eid, fields, f"invalid record: {e}")
        return out

    def read(self, count: int = 10, block_ms: int | None = 1000) -> list[Entry]:
        """New entries for this consumer (they stay pending until :meth:`ack`)."""
        resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        return self._entries(_group_entries(resp))

    def pending_mine(self, count: int = 100) -> list[Entry]:
        """Entries this consumer read before (e.g. before a restart) and never acknowledged."""
        resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: "0"}, count=count)
        return self._entries(_group_entries(resp))

    def ack(self, *ids: str) -> int:
        return int(self.r.xack(self.stream, self.group, *ids)) if ids else 0

    def trim(self) -> int:
        """Delete the entries every group of the stream has acknowledged."""
        return trim_consumed(self.r, self.stream)

    def claim_stale(self, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Take over entries other consumers read and left unacknowledged for ``min_idle_ms``.

        An entry already delivered ``max_deliveries`` times is dead-lettered instead: each of its
        consumers died on it, and one more would too."""
        out: list[Entry] = []
        cursor = "0-0"
        while True:
            resp = self.r.xautoclaim(self.stream, self.group, self.consumer, min_idle_time=min_idle_ms,
                                     start_id=cursor, count=count)
            cursor, claimed = resp[0], resp[1]
            for deleted in (resp[2] if len(resp) > 2 else []):  # trimmed while pending: XAUTOCLAIM dropped them
                log.info("stream %s: pending entry %s was deleted before it was acknowledged", self.stream, deleted)
            out += self._entries(self._without_poison(claimed))
            if cursor == "0-0" or not claimed:
                return out

    def _without_poison(self, claimed: list[EntryRow]) -> list[EntryRow]:
        if not claimed:
            return claimed
        ids = [eid for eid, _ in claimed]
        info = self.r.xpending_range(self.stream, self.group, min=ids[0], max=ids[-1], count=len(ids) + 1000)
        times = {p["message_id"]: int(p["times_delivered"]) for p in info}
        keep = []
        for eid, fields in claimed:
            n = times.get(eid, 1)
            if n > self.max_deliveries and fields is not None:
                self._dead(eid, fields, f"delivered {n} times without an acknowledgement "
                                        f"(every consumer that read it died or failed on it)")
            else:
                keep.append((eid, fields))
        return keep

    def forget_idle_consumers(self, min_idle_ms: int) -> list[str]:
        """Remove consumers idle that long with nothing pending (their entries were claimed)."""
        gone = []
        for c in self.r.xinfo_consumers(self.stream, self.group):
            if c["name"] != self.consumer and int(c["pending"]) == 0 and int(c["idle"]) >= min_idle_ms:
                self.r.xgroup_delconsumer(self.stream, self.group, c["name"])
                gone.append(c["name"])
        return gone


def stream_stats(r: redis.Redis, stream: str) -> dict[str, Any]:
    """Length, first/last entry, and per group: consumers, pending, lag (never delivered)."""
    if not r.exists(stream):
        return {"stream": stream, "exists": False, "length": 0, "groups": []}
    info = r.xinfo_stream(stream)
    out_groups = []
    for g in groups(r, stream):
        consumers = [{"name": c["name"], "pending": int(c["pending"]), "idle_ms": int(c["idle"])}
                     for c in r.xinfo_consumers(stream, g.name)]
        out_groups.append({"name": g.name, "consumers": consumers, "pending": g.pending, "lag": g.lag,
                           "last_delivered": g.last_delivered})
    first = info.get("first-entry")
    last = info.get("last-entry")
    return {"stream": stream, "exists": True, "length": int(info["length"]),
            "first_id": first[0] if first else None, "last_id": last[0] if last else None,
            "backlog": backlog(r, stream), "groups": out_groups}
