"""The policy's rounds as the dispatcher runs them: told only which tenants changed, it
decides exactly what it decides when it looks at every tenant each round — over random
arrivals, preempted jobs, caps, failed hand-offs, corrections (negative too) and cache
affinity. And `offered` (the dispatcher's view, at the cost of the capped tenants) offers
what `offer` does. Pure: no I/O."""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

import pytest

from dispatcher.allowance import offer, offered
from dispatcher.policy import (
    Assignment,
    PolicyConfig,
    QueuedJob,
    RunningJob,
    TierqPolicy,
    WorkerSlots,
)
from tierq.tiers import TIER_ORDER, Tier

TENANTS = [f"t{i}" for i in range(12)]


def key(job: QueuedJob) -> tuple[bool, float]:
    return (job.preemptions == 0, job.enqueued_at)


def summary(decided: Sequence[Assignment]) -> list[tuple[str, str]]:
    return [(a.job.entry_id, a.worker_id) for a in decided]


@pytest.mark.parametrize("seed", range(40))
def test_told_what_changed_it_decides_as_when_it_looks_at_every_tenant(seed: int) -> None:
    rng = random.Random(seed)
    config = PolicyConfig(
        slo_s={Tier.INTERACTIVE: 5.0, Tier.STANDARD: 30.0, Tier.BATCH: 600.0},
        tenant_weights={"t0": 2.0, "t3": 0.5},
        affinity_lookahead=rng.choice([0, 4]),
    )
    whole, told = TierqPolicy(config), TierqPolicy(config)
    ordered: dict[Tier, dict[str, list[QueuedJob]]] = {t: {} for t in TIER_ORDER}
    caps = {"t1": {"*": 2}, "t2": {"batch": 1, "*": 3}} if rng.random() < 0.7 else {}
    running: dict[str, RunningJob] = {}
    changed: dict[Tier, set[str]] = {t: set() for t in TIER_ORDER}
    now, n = 0.0, 0
    decided_any = 0
    for _round in range(120):
        now += rng.uniform(0.05, 2.0)
        for _ in range(rng.choice([0, 0, 1, 3, 8])):  # arrivals, some put back preempted
            n += 1
            tier, tenant = rng.choice(TIER_ORDER), rng.choice(TENANTS)
            pre = 1 if rng.random() < 0.08 else 0
            prefix = rng.choice([None, "sys-a", "sys-b"])
            j = QueuedJob(
                f"{n}-0",
                f"j{n}",
                tier,
                tenant,
                now - rng.uniform(0, 3),
                rng.randint(5, 90),
                pre,
                prefix,
            )
            bisect.insort(ordered[tier].setdefault(tenant, []), j, key=key)
            changed[tier].add(tenant)
        for tier, tenant in [(rng.choice(TIER_ORDER), rng.choice(TENANTS)) for _ in range(2)]:
            delta = rng.uniform(-40, 40)  # a worker's report corrects the estimate
            whole.charge(tier, tenant, delta, now)
            told.charge(tier, tenant, delta, now)
        workers = [
            WorkerSlots(f"w{i}", free, max(0, free - 1), capacity=8)
            for i, free in enumerate(rng.choices([0, 1, 2, 4], k=3))
        ]
        views, capped = offered(ordered, running.values(), caps)
        for tier, tenants in capped.items():
            changed[tier] |= tenants
        a = whole.assign(views, workers, now)
        b = told.assign(views, workers, now, changed)
        assert summary(a) == summary(b), f"round {_round}"
        changed = {t: set() for t in TIER_ORDER}
        decided_any += len(a)
        for d in a:
            if rng.random() < 0.1:  # its worker left: the job stays, its charge goes back
                whole.charge(d.job.tier, d.job.tenant_id, -d.job.cost, now)
                told.charge(d.job.tier, d.job.tenant_id, -d.job.cost, now)
                changed[d.job.tier].add(d.job.tenant_id)
                continue
            queue = ordered[d.job.tier][d.job.tenant_id]
            queue.remove(d.job)
            if not queue:
                del ordered[d.job.tier][d.job.tenant_id]
            running[d.job.job_id] = RunningJob(
                d.job.job_id, d.job.tier, d.worker_id, now, 0, d.job.tenant_id
            )
        for job_id in [j for j in running if rng.random() < 0.3]:  # finished
            del running[job_id]
    assert decided_any > 50  # the rounds did decide things


@pytest.mark.parametrize("seed", range(30))
def test_the_dispatchers_view_offers_what_offer_does(seed: int) -> None:
    rng = random.Random(seed)
    ordered: dict[Tier, dict[str, list[QueuedJob]]] = {t: {} for t in TIER_ORDER}
    for n in range(rng.randint(0, 60)):
        tier, tenant = rng.choice(TIER_ORDER), rng.choice(TENANTS[:5])
        j = QueuedJob(
            f"{n}-0", f"j{n}", tier, tenant, rng.uniform(0, 10), 10, rng.choice([0, 0, 1])
        )
        bisect.insort(ordered[tier].setdefault(tenant, []), j, key=key)
    caps = {
        t: {
            s: rng.randint(0, 4)
            for s in rng.sample(["*", "interactive", "batch"], rng.randint(1, 2))
        }
        for t in rng.sample(TENANTS[:5], rng.randint(0, 3))
    }
    running = [
        RunningJob(f"r{i}", rng.choice(TIER_ORDER), "w", 0.0, 0, rng.choice(TENANTS[:5]))
        for i in range(rng.randint(0, 6))
    ]
    views, capped = offered(ordered, running, caps)
    expected = offer(ordered, running, caps)
    for tier in TIER_ORDER:
        assert {t: list(q) for t, q in views[tier].items()} == expected[tier]
        for tenant in TENANTS[:5]:  # a lookup agrees with the walk
            assert list(views[tier].get(tenant) or []) == expected[tier].get(tenant, [])
        assert capped[tier] <= set(caps)
