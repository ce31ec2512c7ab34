"""Two runs side by side: the tasks that flipped and the change per domain, on the tasks both
runs have (a task only one of them ran is counted apart, never as a flip)."""

from __future__ import annotations

from dataclasses import dataclass

from osfarm.dashboard.runs import EvalRun, TaskRow
from osfarm.dashboard.stats import Rate


@dataclass(frozen=True)
class Flip:
    task_id: str
    domain: str
    a: TaskRow
    b: TaskRow


@dataclass(frozen=True)
class DomainDelta:
    domain: str
    n: int
    a: Rate
    b: Rate

    @property
    def delta(self) -> float:
        return self.b.value - self.a.value


@dataclass(frozen=True)
class Comparison:
    common: int
    rate_a: Rate
    rate_b: Rate
    gained: list[Flip]  # failed in a, succeeded in b
    lost: list[Flip]  # succeeded in a, failed in b
    only_a: list[str]
    only_b: list[str]
    domains: list[DomainDelta]

    @property
    def delta(self) -> float:
        return self.rate_b.value - self.rate_a.value


def compare(a: EvalRun, b: EvalRun) -> Comparison:
    rows_a = {r.task_id: r for r in a.rows}
    rows_b = {r.task_id: r for r in b.rows}
    common = [t for t in rows_a if t in rows_b]
    gained: list[Flip] = []
    lost: list[Flip] = []
    for t in common:
        ra, rb = rows_a[t], rows_b[t]
        if ra.ok != rb.ok:
            (gained if rb.ok else lost).append(Flip(t, rb.domain or ra.domain, ra, rb))
    domains = sorted({rows_b[t].domain or rows_a[t].domain for t in common})
    per_domain = []
    for d in domains:
        ts = [t for t in common if (rows_b[t].domain or rows_a[t].domain) == d]
        per_domain.append(DomainDelta(d, len(ts), Rate(sum(rows_a[t].ok for t in ts), len(ts)),
                                      Rate(sum(rows_b[t].ok for t in ts), len(ts))))
    return Comparison(
        common=len(common),
        rate_a=Rate(sum(rows_a[t].ok for t in common), len(common)),
        rate_b=Rate(sum(rows_b[t].ok for t in common), len(common)),
        gained=sorted(gained, key=lambda f: (f.domain, f.task_id)),
        lost=sorted(lost, key=lambda f: (f.domain, f.task_id)),
        only_a=sorted(t for t in rows_a if t not in rows_b),
        only_b=sorted(t for t in rows_b if t not in rows_a),
        domains=per_domain,
    )
