"""The policy's rounds as the dispatcher runs them: told only which tenants changed, it
decides exactly what it decides when it looks at every tenant each round — over random
arrivals, preempted jobs, caps set, moved and lifted, failed hand-offs, corrections
(negative too), a successor's restore, forgotten idle counters and cache affinity. And `offered` (the dispatcher's view, at the cost of the capped tenants) offers
what `offer` does. Pure: no I/O."""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Sequence

import pytest
import redis.asyncio as aioredis

from tierq.core.messages import JobMessage
from tierq.core.settings import Settings
from tierq.core.tiers import TIER_ORDER, Tier
from tierq.dispatcher import policy as policy_module
from tierq.dispatcher.allowance import offer, offered
from tierq.dispatcher.loop import Dispatcher
from tierq.dispatcher.policy import (
    Assignment,
    PolicyConfig,
    QueuedJob,
    RunningJob,
    TierqPolicy,
    WorkerSlots,
)

TENANTS = [f"t{i}" for i in range(12)]


def key(job: QueuedJob) -> tuple[bool, float]:
    return (job.preemptions == 0, job.enqueued_at)


def summary(decided: Sequence[Assignment]) -> list[tuple[str, str]]:
    return [(a.job.entry_id, a.worker_id) for a in decided]


def idle_dispatcher(settings: Settings) -> Dispatcher:
    """A Dispatcher whose bookkeeping is driven by hand: nothing here awaits Redis (its
    client is made, never connected)."""
    return Dispatcher(settings, aioredis.Redis(host="127.0.0.1", port=1))


@pytest.mark.parametrize("seed", range(40))
def test_told_what_changed_it_decides_as_when_it_looks_at_every_tenant(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatcher's own bookkeeping (jobs read, handed off, put back; caps set, moved
    and lifted; a successor's restore) drives its policy, told only what changed; beside it
    a policy looks at every tenant of the same offer each round."""
    monkeypatch.setattr(policy_module, "IDLE_COUNTERS_KEPT", 4)  # forgetting runs too
    rng = random.Random(seed)
    config = PolicyConfig(
        slo_s={Tier.INTERACTIVE: 5.0, Tier.STANDARD: 30.0, Tier.BATCH: 600.0},
        tenant_weights={"t0": 2.0, "t3": 0.5},
        affinity_lookahead=rng.choice([0, 4]),
    )
    d = idle_dispatcher(Settings(_env_file=None))  # type: ignore[call-arg]
    told = TierqPolicy(config)
    d.policy = told
    whole = TierqPolicy(config)
    now, n, decided_any = 0.0, 0, 0
    for _round in range(150):
        now += rng.uniform(0.05, 2.0)
        if rng.random() < 0.15:  # the admin API sets, moves or lifts caps
            d.max_running = {
                t: {rng.choice(["*", "batch", "standard"]): rng.randint(0, 2)}
                for t in rng.sample(TENANTS, rng.randint(0, 3))
            }
        for _ in range(rng.choice([0, 0, 1, 3, 8])):  # arrivals, some put back preempted
            n += 1
            tier, tenant = rng.choice(TIER_ORDER), rng.choice(TENANTS)
            pre = 1 if rng.random() < 0.08 else 0
            stream = f"preempted:{tier.value}" if pre else f"stream:{tier.value}:{tenant}"
            msg = JobMessage(
                f"j{n}",
                tenant,
                tier,
                now - rng.uniform(0, 3),
                rng.randint(5, 90),
                pre,
                prefix=rng.choice([None, "sys-a", "sys-b"]),
            )
            d._buffer(stream, f"{int(now * 1000)}-0", msg)  # ids repeat across streams
        for tier, tenant in [(rng.choice(TIER_ORDER), rng.choice(TENANTS)) for _ in range(2)]:
            delta = rng.uniform(-40, 40)  # a worker's report corrects the estimate
            whole.charge(tier, tenant, delta, now)
            told.charge(tier, tenant, delta, now)
        if rng.random() < 0.05:  # a successor carries on from the saved accounting
            saved = json.loads(json.dumps(told.snapshot()))
            whole.restore(saved)
            told.restore(saved)
        workers = [
            WorkerSlots(f"w{i}", free, max(0, free - 1), capacity=8)
            for i, free in enumerate(rng.choices([0, 1, 2, 4], k=3))
        ]
        every = offer(d.ordered, d.running.values(), d.max_running)
        a = whole.assign(every, workers, now)
        b = d.decide(workers, now)
        assert summary(a) == summary(b), f"round {_round}"
        decided_any += len(a)
        for dec in b:
            if rng.random() < 0.1:  # its worker left: the job stays, its charge goes back
                for policy in (whole, told):
                    policy.charge(dec.job.tier, dec.job.tenant_id, -dec.job.cost, now)
                d._changed_tenant(dec.job.tier, dec.job.tenant_id)
                continue
            d._drop(dec.job)
            d.running[dec.job.job_id] = RunningJob(
                dec.job.job_id, dec.job.tier, dec.worker_id, now, 0, dec.job.tenant_id
            )
        for job_id in [j for j in d.running if rng.random() < 0.3]:  # finished
            del d.running[job_id]
    assert decided_any > 50  # the rounds did decide things


def test_two_streams_may_give_one_entry_id_and_both_jobs_are_kept() -> None:
    d = idle_dispatcher(Settings(_env_file=None))  # type: ignore[call-arg]
    d._buffer("s:batch:t1", "1700000000000-0", JobMessage("own", "t1", Tier.BATCH))
    d._buffer("p:batch", "1700000000000-0", JobMessage("back", "t1", Tier.BATCH, preemptions=1))
    d._buffer("p:batch", "1700000000000-0", JobMessage("back", "t1", Tier.BATCH, preemptions=1))
    assert [j.job_id for j in d.ordered[Tier.BATCH]["t1"]] == ["back", "own"]
    assert d._queued_jobs[Tier.BATCH] == 2


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
