"""An accepted episode as the data manager holds it, and what it reads off a raw record.

A record (``osfarm.episode/1``) is read in many places of the curation (storage rules, the
version window, grouping, the pool, samples); its reward, outcome, policy versions and arrival
order are worked out once, when it is taken, and travel with it from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from osfarm.trainer.selection import logprobs_as_floats


@dataclass(eq=False)  # identity, not content: a group and the pending lists tell episodes apart by it
class Episode:
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
    def from_json(cls, d: dict[str, Any], from_pool: bool = False) -> Episode:
        rec = d["record"]
        return cls(rec, d["blob_root"], float(d["reward"]), bool(d["success"]), d.get("version"),
                   int(d.get("seq", 0)), from_pool, episode_version_end(rec))


def _recorded_version(rec: dict[str, Any], key: str, pick: Callable[[list[int]], int]) -> int | None:
    """``policy.<key>`` of the record; for a record without it, ``pick`` of its steps' versions."""
    v = (rec.get("policy") or {}).get(key)
    if v is not None:
        return int(v)
    vs = [s["model"]["policy_version"] for s in rec.get("steps", [])
          if s.get("model") and s["model"].get("policy_version") is not None]
    return pick(vs) if vs else None


def episode_version(rec: dict[str, Any]) -> int | None:
    """The oldest policy version that produced the episode (policy.version_start, else its steps')."""
    return _recorded_version(rec, "version_start", min)


def episode_version_end(rec: dict[str, Any]) -> int | None:
    """The newest policy version that produced a step (policy.version_end, else its steps')."""
    return _recorded_version(rec, "version_end", max)


def steps_with_model_data(rec: dict[str, Any]) -> int:
    return sum(1 for s in rec.get("steps", []) if s.get("model") and s["model"].get("request") is not None
               and s["model"].get("response_token_ids"))


def steps_with_request(rec: dict[str, Any]) -> int:
    return sum(1 for s in rec.get("steps", []) if s.get("model") and s["model"].get("request") is not None)
