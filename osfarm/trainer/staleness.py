"""AReaL's staleness control: how many rollouts may start now so no sample is more than η
versions old when the learner uses it (AReaL, Fu et al. 2025, "staleness-aware" asynchronous PPO).

Each learner update (version v → v + 1) consumes ``batch_size`` accepted rollouts. A rollout
may start only while

    capacity = min(max_concurrent − running, (η + v + 1)·batch_size − (accepted + running)) > 0

so at most (η + 1) batches beyond what versions 0..v−1 consumed are accepted or in flight:
a rollout started at version v is consumed by an update no later than v + η. η = 0 is
synchronous RL (generate one batch, train, repeat). When updates consume whole GRPO groups, an
update may take a little more than a batch; the gate then counts what was really ``consumed``
(v·batch_size is the special case) and may be given a ``slack`` of rollouts (the largest group
less one), so a learner waiting for whole groups is never left without room for them:

    capacity = min(max_concurrent − running, (η + 1)·batch_size + slack + consumed − (accepted + running))
 ``accepted`` counts finished rollouts that
became training data; rejected ones (infra errors, episodes the storage rules drop) give their
slot back. After a resume ``accepted`` restarts at v·batch_size: a counter restored as 0 (or
lost) would let (η + v + 1) whole batches start at once, the unbounded staleness AReaL's
users hit.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


def staleness_capacity(*, version: int, eta: int, batch_size: int, accepted: int, running: int,
                       max_concurrent: int | None = None, consumed: int | None = None, slack: int = 0) -> int:
    """How many more rollouts may start now (≤ 0: none). ``max_concurrent`` None = no env limit;
    ``consumed`` None = version·batch_size (every update took exactly one batch)."""
    if eta < 0 or batch_size < 1 or version < 0 or slack < 0:
        raise ValueError(f"need eta >= 0, batch_size >= 1, version >= 0, slack >= 0; got eta={eta}, "
                         f"batch_size={batch_size}, version={version}, slack={slack}")
    used = version * batch_size if consumed is None else consumed
    by_staleness = (eta + 1) * batch_size + slack + used - (accepted + running)
    if max_concurrent is None:
        return by_staleness
    return min(max_concurrent - running, by_staleness)


def accepted_after_resume(version: int, batch_size: int) -> int:
    """The ``accepted`` counter a resumed trainer at ``version`` starts from (AReaL's fix)."""
    return version * batch_size


def sample_staleness(current_version: int, policy_version: int) -> int:
    """How many updates old a sample is (its behaviour policy's version vs the learner's)."""
    return current_version - policy_version


def in_version_window(policy_version: int | None, current_version: int, window: int) -> bool:
    """A sample is usable while policy_version ≥ current − window (unknown version: not usable)."""
    if policy_version is None:
        return False
    return policy_version >= current_version - window


@dataclass
class StalenessState:
    version: int = 0
    accepted: int = 0
    running: int = 0
    rejected: int = 0
    submitted: int = 0
    consumed: int | None = None  # accepted episodes the updates trained on (None: version·batch_size)


class StalenessGate:
    """The counters behind :func:`staleness_capacity`, kept by whoever starts rollouts.

    ``submit(n)`` when rollouts are handed to the farm, ``accept()`` / ``reject()`` when each
    finishes, ``set_version(v)`` after each learner update. ``save``/``load`` persist the counters
    as JSON; ``load`` resets ``accepted`` to version·batch_size and ``running`` to 0 (in-flight
    rollouts of the dead process either arrive later — then they are counted as accepted or
    rejected normally and only make the bound tighter — or never do).
    """

    def __init__(
        self, eta: int, batch_size: int, max_concurrent: int | None = None, state: StalenessState | None = None
    ):
        if eta < 0 or batch_size < 1:
            raise ValueError(f"need eta >= 0 and batch_size >= 1, got eta={eta}, batch_size={batch_size}")
        self.eta, self.batch_size, self.max_concurrent = eta, batch_size, max_concurrent
        self.state = state or StalenessState()

    def capacity(self, slack: int = 0) -> int:
        s = self.state
        return staleness_capacity(version=s.version, eta=self.eta, batch_size=self.batch_size, accepted=s.accepted,
                                  running=s.running, max_concurrent=self.max_concurrent, consumed=s.consumed,
                                  slack=slack)

    def consume(self, n: int) -> None:
        """An update trained on ``n`` accepted episodes."""
        if self.state.consumed is None:
            self.state.consumed = self.state.version * self.batch_size
        self.state.consumed += n

    def submit(self, n: int = 1) -> None:
        self.state.running += n
        self.state.submitted += n

    def accept(self, n: int = 1) -> None:
        self.state.running = max(0, self.state.running - n)
        self.state.accepted += n

    def reject(self, n: int = 1) -> None:
        self.state.running = max(0, self.state.running - n)
        self.state.rejected += n

    def set_version(self, version: int) -> None:
        if version < self.state.version:
            raise ValueError(f"policy version went backwards: {self.state.version} -> {version}")
        self.state.version = version

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"eta": self.eta, "batch_size": self.batch_size, **asdict(self.state)}, indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, eta: int, batch_size: int, max_concurrent: int | None = None) -> StalenessGate:
        """Counters from ``path`` with AReaL's resume rule applied; a fresh gate when it does not exist."""
        path = Path(path)
        if not path.exists():
            return cls(eta, batch_size, max_concurrent)
        try:
            raw = json.loads(path.read_text())
            version = int(raw["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a staleness state file ({e}); delete it to start the counters afresh"
                             ) from None
        st = StalenessState(version=version, accepted=accepted_after_resume(version, batch_size), running=0,
                            rejected=int(raw.get("rejected", 0)), submitted=int(raw.get("submitted", 0)))
        return cls(eta, batch_size, max_concurrent, st)
