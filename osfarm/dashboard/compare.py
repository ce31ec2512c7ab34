"""Two runs side by side: the tasks that flipped, the change per domain and a paired test of the
difference, on the tasks both runs have (a task only one of them ran is counted apart, never as
a flip). With repeats a task's outcome is its success rate over its repeats: it "flipped" when
that rate went up or down, and the rates count every episode."""

from __future__ import annotations

from dataclasses import dataclass

from osfarm.dashboard.runs import EvalRun, TaskRow, outcomes
from osfarm.dashboard.stats import Rate
from osfarm.runner.variance import PairedTest, TaskCount, paired_test, task_counts


@dataclass(frozen=True)
class Flip:
    task_id: str
    domain: str
    a: TaskRow  # the task's first episode in each run (the one the link opens)
    b: TaskRow
    a_count: TaskCount  # its successes over its repeats
    b_count: TaskCount


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
    gained: list[Flip]  # a higher success rate in b than in a (K=1: failed in a, succeeded in b)
    lost: list[Flip]  # lower in b than in a
    only_a: list[str]
    only_b: list[str]
    domains: list[DomainDelta]
    test: PairedTest  # is b - a more than noise (runner.variance.paired_test)

    @property
    def delta(self) -> float:
        return self.rate_b.value - self.rate_a.value


def _rate(counts: dict[str, TaskCount], tasks: list[str]) -> Rate:
    return Rate(sum(counts[t].c for t in tasks), sum(counts[t].n for t in tasks))


def compare(a: EvalRun, b: EvalRun) -> Comparison:
    first_a: dict[str, TaskRow] = {}
    first_b: dict[str, TaskRow] = {}
    for rows, first in ((a.rows, first_a), (b.rows, first_b)):
        for r in rows:
            first.setdefault(r.task_id, r)
    ca, cb = task_counts(outcomes(a.rows)), task_counts(outcomes(b.rows))
    common = [t for t in ca if t in cb]
    gained: list[Flip] = []
    lost: list[Flip] = []
    domain_of = {t: first_b[t].domain or first_a[t].domain for t in common}
    for t in common:
        if ca[t].rate != cb[t].rate:
            f = Flip(t, domain_of[t], first_a[t], first_b[t], ca[t], cb[t])
            (gained if cb[t].rate > ca[t].rate else lost).append(f)
    per_domain = []
    for d in sorted(set(domain_of.values())):
        ts = [t for t in common if domain_of[t] == d]
        per_domain.append(DomainDelta(d, len(ts), _rate(ca, ts), _rate(cb, ts)))
    return Comparison(
        common=len(common),
        rate_a=_rate(ca, common),
        rate_b=_rate(cb, common),
        gained=sorted(gained, key=lambda f: (f.domain, f.task_id)),
        lost=sorted(lost, key=lambda f: (f.domain, f.task_id)),
        only_a=sorted(t for t in ca if t not in cb),
        only_b=sorted(t for t in cb if t not in ca),
        domains=per_domain,
        test=paired_test({t: ca[t] for t in common}, {t: cb[t] for t in common}),
    )
