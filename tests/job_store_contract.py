"""One contract for every job store (tierq/models/store): PostgreSQL and the SQLite file
(tests/integration/test_job_store.py), and the in-memory one (tests/unit/test_job_store.py)
run these same tests. A module subclasses `JobStoreContract` and gives three fixtures:
`store`, an empty store; `tenants`, which makes tenants that jobs may belong to; and
`admin`, which sets what admission reads beside jobs (keys, a tenant's status, quotas,
prices); or subclasses `SqlJobStoreContract`, and gives `db`."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any, Protocol

import pytest
from sqlalchemy import delete, select, update

from tierq.core.ids import new_id
from tierq.core.messages import FAULT_UNIT, output_bound
from tierq.core.states import JobStatus
from tierq.core.tiers import Tier
from tierq.models import prices as price_repo
from tierq.models import quotas as quota_repo
from tierq.models import tenants as tenant_repo
from tierq.models.admission import Admission, Answer
from tierq.models.db import Database
from tierq.models.jobs import IdempotencyConflict, NewJob
from tierq.models.records import JobRecord, Progress
from tierq.models.store import JobStore, Result, SqlJobStore, Usage
from tierq.models.tables import HeldReservation, Job, Tenant, utcnow

MakeTenants = Callable[[int], Awaitable[list[str]]]

PRICE_IN, PRICE_OUT = Decimal("2.5"), Decimal("10")  # per million tokens
DISCOUNT = Decimal("0.5")  # the batch tier's, off the standard price
PROGRESS = Progress((11, 12, 13, 14), "abcd", 6, "simulated:bundled:m")
RESULT = Result("done", "length", 7, 3)


def tenant_maker(db: Database) -> MakeTenants:
    """`tenants` for a store on a database: tenant rows its jobs may refer to."""

    async def make(n: int) -> list[str]:
        async with db.transaction() as s:
            return [(await tenant_repo.create_tenant(s, new_id("name"))).id for _ in range(n)]

    return make


class Admin(Protocol):
    """What an operator sets that admission reads: on a database through the admin API's
    repository functions, in memory through the store's own setters."""

    async def key(self, tenant_id: str) -> str: ...
    async def revoke(self, key_id: str) -> None: ...
    async def suspend(self, tenant_id: str) -> None: ...
    async def quota(self, tenant_id: str, tier: str, **limits: Any) -> None: ...
    async def price(self, model: str, tier: Tier, input_: Decimal, output: Decimal) -> None: ...


class SqlAdmin:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def key(self, tenant_id: str) -> str:
        async with self.db.transaction() as s:
            return (await tenant_repo.issue_key(s, tenant_id)).id

    async def revoke(self, key_id: str) -> None:
        async with self.db.transaction() as s:
            await tenant_repo.revoke_key(s, key_id)

    async def suspend(self, tenant_id: str) -> None:
        async with self.db.transaction() as s:
            await tenant_repo.update_tenant(s, tenant_id, status="suspended")

    async def quota(self, tenant_id: str, tier: str, **limits: Any) -> None:
        async with self.db.transaction() as s:
            await quota_repo.set_quota(s, tenant_id, tier, **limits)

    async def price(self, model: str, tier: Tier, input_: Decimal, output: Decimal) -> None:
        async with self.db.transaction() as s:
            await price_repo.set_price(s, model, tier.value, input_, output)


def new_job(tenant_id: str, key: str | None = None, body: str = "a") -> NewJob:
    return NewJob(
        tenant_id=tenant_id,
        tier=Tier.STANDARD,
        model="m",
        messages=None,
        prompt="x",
        params={"max_tokens": 3},
        idempotency_key=key,
        request_hash=None if key is None else f"hash-{body}",
        reserved_tokens=10,
        input_price=PRICE_IN,
        output_price=PRICE_OUT,
    )


def admission(
    tenant_id: str,
    *,
    tier: Tier = Tier.STANDARD,
    key_id: str | None = None,
    key: str | None = None,
    body: str = "a",
    model: str = "m",
    bound: int = 0,
) -> Admission:
    """An online job's admission (it reserves 10 tokens, 3 of them its output)."""
    new = dataclasses.replace(
        new_job(tenant_id, key, body), tier=tier, model=model, input_price=None, output_price=None
    )
    return Admission(new_id("job"), new, key_id, utcnow(), bound, DISCOUNT)


def refusal(a: Admission, answer: Answer) -> quota_repo.Refusal | None:
    """The first refusal the rule words from a store's figures (as the service does)."""
    for quota, figures, held in answer.quotas:
        decided = quota_repo.decide(
            quota,
            figures,
            a.new.tier.value,
            a.new.reserved_tokens,
            answer.reserved_cost,
            a.created_at,
        )
        assert (decided is None) == held  # the store and the rule agree
        if decided is not None:
            return decided
    return None


def _price_key(price: Decimal | None) -> str:
    """A price as held_reservations keys it: its string, "" for none."""
    return "" if price is None else str(price)


class JobStoreContract:
    @pytest.fixture
    async def tenant(self, tenants: MakeTenants) -> str:
        return (await tenants(1))[0]

    async def mine(self, store: JobStore, tenant: str) -> list[JobRecord]:
        """The tenant's unfinished jobs: what admissions wrote."""
        return [
            j
            for j in await store.unfinished(utcnow() + timedelta(hours=1))
            if j.tenant_id == tenant
        ]

    # --- admission ----------------------------------------------------------------------

    async def test_an_admitted_job_is_written_at_the_price_in_force(
        self, store: JobStore, tenant: str, admin: Admin
    ) -> None:
        await admin.price("m", Tier.STANDARD, Decimal("0.37"), Decimal("1.1"))
        await admin.price("m", Tier.INTERACTIVE, Decimal("2.5"), Decimal("4"))
        answers = {t: await store.admit(admission(tenant, tier=t), counted=False) for t in Tier}
        for tier, answer in answers.items():
            assert answer.job is not None and answer.status == "active", tier
            assert answer.job.status == JobStatus.QUEUED and answer.job.tier == tier
            assert await store.get(answer.job.id, tenant) == answer.job
            assert await store.transitions(answer.job.id) == [("queued", None)]
        prices = {t: (a.job.input_price, a.job.output_price) for t, a in answers.items() if a.job}
        keep = 1 - DISCOUNT  # the batch tier without a price of its own: standard's, less it
        assert prices == {
            Tier.INTERACTIVE: (Decimal("2.5"), Decimal("4")),
            Tier.STANDARD: (Decimal("0.37"), Decimal("1.1")),
            Tier.BATCH: (Decimal("0.37") * keep, Decimal("1.1") * keep),
        }
        free = await store.admit(admission(tenant, model="unpriced"), counted=False)
        assert free.job is not None and (free.job.input_price, free.job.output_price) == (0, 0)

    async def test_a_replay_is_answered_first_and_writes_nothing(
        self, store: JobStore, tenants: MakeTenants, admin: Admin
    ) -> None:
        """A request with an Idempotency-Key used before gets the job it made back
        (another body: told so), before any check — a suspended tenant's retry included."""
        mine, other = await tenants(2)
        first = await store.admit(admission(mine, key="k"), counted=False)
        assert first.job is not None and first.replay is None
        again = await store.admit(admission(mine, key="k"), counted=False)
        assert again.job is None and (again.replay, again.same_request) == (first.job.id, True)
        changed = await store.admit(admission(mine, key="k", body="b"), counted=False)
        assert (changed.job, changed.replay, changed.same_request) == (None, first.job.id, False)
        await admin.suspend(mine)
        assert (await store.admit(admission(mine, key="k"), counted=False)).replay == first.job.id
        assert [j.id for j in await self.mine(store, mine)] == [first.job.id]
        theirs = await store.admit(admission(other, key="k"), counted=False)  # keys per tenant
        assert theirs.job is not None and theirs.replay is None

    async def test_a_suspended_tenant_or_a_revoked_key_is_refused_with_nothing_written(
        self, store: JobStore, tenants: MakeTenants, admin: Admin
    ) -> None:
        mine, other = await tenants(2)
        key, theirs = await admin.key(mine), await admin.key(other)
        assert (await store.admit(admission(mine, key_id=key), counted=False)).job is not None
        await admin.revoke(key)
        for key_id in (key, "key_unknown", theirs):  # another tenant's key is not this one's
            refused = await store.admit(admission(mine, key_id=key_id), counted=False)
            assert refused.job is None and refused.status == tenant_repo.REVOKED, key_id
        await admin.quota(mine, "*", requests_per_minute=100)
        await admin.suspend(mine)
        for counted in (False, True):  # refused before it would be sent back to be counted
            suspended = await store.admit(admission(mine), counted=counted)
            assert suspended.job is None and suspended.status == "suspended"
            assert not suspended.count_first
        unknown = await store.admit(admission("ten_unknown"), counted=False)
        assert unknown.job is None and unknown.status is None
        assert len(await self.mine(store, mine)) == 1

    async def test_a_tenant_with_quotas_is_counted_first_and_others_are_not(
        self, store: JobStore, tenant: str, admin: Admin
    ) -> None:
        await admin.quota(tenant, "*", max_running=2)  # the dispatcher's: not admission's
        assert (await store.admit(admission(tenant), counted=False)).job is not None
        await admin.quota(tenant, "batch", token_budget=100)
        sent_back = await store.admit(admission(tenant, tier=Tier.BATCH), counted=False)
        assert sent_back.job is None and sent_back.count_first
        assert len(await self.mine(store, tenant)) == 1  # nothing written
        standard = await store.admit(admission(tenant), counted=False)  # not its tier
        assert standard.job is not None and not standard.quotas
        counted = await store.admit(admission(tenant, tier=Tier.BATCH), counted=True)
        assert counted.job is not None
        [(quota, _figures, held)] = counted.quotas
        assert (quota.tier, quota.token_budget, held) == ("batch", 100, True)

    async def test_the_default_queue_bound_yields_to_a_quota_of_every_tier(
        self, store: JobStore, tenant: str, admin: Admin
    ) -> None:
        answers = [await store.admit(admission(tenant, bound=3), counted=False) for _ in range(4)]
        assert [a.job is not None for a in answers] == [True, True, True, False]
        assert answers[-1].queued == 3 and not answers[-1].quotas
        await admin.quota(tenant, "*", max_queued=4)
        fourth = await store.admit(admission(tenant, bound=3), counted=True)
        assert fourth.job is not None and fourth.queued is None
        fifth = await store.admit(admission(tenant, bound=3), counted=True)
        assert fifth.job is None
        decided = refusal(admission(tenant, bound=3), fifth)
        assert decided is not None and decided.code == "quota_exceeded"
        assert len(await self.mine(store, tenant)) == 4

    async def test_a_rate_limit_admits_exactly_its_number_of_concurrent_requests(
        self, store: JobStore, tenant: str, admin: Admin
    ) -> None:
        """Ten admissions of one tenant at once against 3 requests a minute: exactly 3 are
        written, and each refusal carries the figures the rule refuses it by."""
        await admin.quota(tenant, "standard", requests_per_minute=3)
        requests = [admission(tenant) for _ in range(10)]
        answers = await asyncio.gather(*(store.admit(a, counted=True) for a in requests))
        assert sum(a.job is not None for a in answers) == 3
        for a, answer in zip(requests, answers, strict=True):
            if answer.job is None:
                decided = refusal(a, answer)
                assert decided is not None and decided.code == "rate_limit_exceeded"
                assert 1 <= decided.retry_after_s <= 60
        assert len(await self.mine(store, tenant)) == 3

    async def test_a_token_budget_counts_what_is_held_and_what_was_spent(
        self, store: JobStore, tenant: str, admin: Admin
    ) -> None:
        """Each job reserves 10 tokens until it is billed, then counts what it used."""
        await admin.quota(tenant, "*", token_budget=28, budget_period="day")
        first = await store.admit(admission(tenant), counted=True)
        second = await store.admit(admission(tenant), counted=True)
        assert first.job is not None and second.job is not None
        third = await store.admit(admission(tenant), counted=True)
        assert third.job is None
        [(_quota, figures, held)] = third.quotas
        assert (figures.held_tokens, figures.spent_tokens, held) == (20, 0, False)
        decided = refusal(admission(tenant), third)
        assert decided is not None and decided.code == "budget_exceeded"
        # Billed for 7 + 1 tokens: the budget holds 8 spent + 10 held + 10 asked, to the token.
        assert await store.claim(first.job.id, "w1", 3) is not None
        assert await store.finish(first.job.id, Result("done", "stop", 7, 1)) is not None
        fourth = await store.admit(admission(tenant), counted=True)
        assert fourth.job is not None
        [(_quota, figures, _held)] = fourth.quotas
        assert (figures.held_tokens, figures.spent_tokens) == (10, 8)

    async def test_a_spend_budget_counts_the_most_each_waiting_job_can_cost(
        self, store: JobStore, tenant: str, admin: Admin
    ) -> None:
        # 7 prompt tokens at 1 per million and 3 output tokens at 100 per million: each job
        # reserves at most 0.000307.
        await admin.price("m", Tier.STANDARD, Decimal(1), Decimal(100))
        await admin.quota(tenant, "standard", spend_budget=Decimal("0.0007"))
        answers = [await store.admit(admission(tenant), counted=True) for _ in range(3)]
        assert [a.job is not None for a in answers] == [True, True, False]
        assert answers[-1].reserved_cost == Decimal("0.000307")
        [(_quota, figures, _held)] = answers[-1].quotas
        assert figures.held_cost == Decimal("0.000614")
        decided = refusal(admission(tenant), answers[-1])
        assert decided is not None and decided.code == "budget_exceeded"

    async def queued(self, store: JobStore, tenant: str, n: int = 1) -> list[JobRecord]:
        return [(await store.create(new_job(tenant)))[0] for _ in range(n)]

    async def running(self, store: JobStore, tenant: str, n: int = 1) -> list[JobRecord]:
        jobs = await self.queued(store, tenant, n)
        claimed = [await store.claim(j.id, "w1", 3) for j in jobs]
        assert all(c is not None for c in claimed)
        return [c for c in claimed if c is not None]

    # --- creating and reading -----------------------------------------------------------

    async def test_a_created_job_is_queued_and_read_back_by_its_tenant_only(
        self, store: JobStore, tenants: MakeTenants
    ) -> None:
        mine, other = await tenants(2)
        job, created = await store.create(new_job(mine))
        assert created and job.status == JobStatus.QUEUED and job.deliveries == 0
        assert job.input_price == PRICE_IN and job.reserved_tokens == 10
        assert await store.get(job.id) == job
        assert await store.get(job.id, mine) == job
        assert await store.get(job.id, other) is None
        head = await store.head(job.id, mine)
        assert head is not None and head.status == JobStatus.QUEUED
        assert await store.head(job.id, other) is None
        assert await store.get("job_unknown") is None
        assert await store.statuses([job.id, "job_unknown"]) == {job.id: JobStatus.QUEUED}
        assert await store.transitions(job.id) == [("queued", None)]

    async def test_an_idempotency_key_makes_one_job_and_refuses_another_body(
        self, store: JobStore, tenants: MakeTenants
    ) -> None:
        mine, other = await tenants(2)
        first, created = await store.create(new_job(mine, key="k"))
        again, created_again = await store.create(new_job(mine, key="k"))
        assert created and not created_again and again.id == first.id
        with pytest.raises(IdempotencyConflict):
            await store.create(new_job(mine, key="k", body="b"))
        # Keys are the tenant's own: another tenant's "k" is another job.
        theirs, created = await store.create(new_job(other, key="k"))
        assert created and theirs.id != first.id

    async def test_unfinished_jobs_page_oldest_first(self, store: JobStore, tenant: str) -> None:
        jobs = await self.queued(store, tenant, 5)
        await store.claim(jobs[1].id, "w1", 3)
        ended = await self.running(store, tenant)
        assert await store.finish(ended[0].id, RESULT) is not None
        later = utcnow() + timedelta(seconds=1)
        oldest_first = [j.id for j in sorted(jobs, key=lambda j: (j.created_at, j.id))]
        first = await store.unfinished(later, limit=3)
        assert [j.id for j in first] == oldest_first[:3]
        rest = await store.unfinished(later, limit=3, after=(first[-1].created_at, first[-1].id))
        assert [j.id for j in rest] == oldest_first[3:]
        assert await store.unfinished(min(j.created_at for j in jobs)) == []

    # --- claims -------------------------------------------------------------------------

    async def test_a_claim_runs_a_queued_job_and_a_redelivery_is_charged(
        self, store: JobStore, tenant: str
    ) -> None:
        (job,) = await self.queued(store, tenant)
        claimed = await store.claim(job.id, "w1", 3)
        assert claimed is not None and claimed.status == JobStatus.RUNNING
        assert (claimed.deliveries, claimed.worker_id, claimed.fault_charge) == (1, "w1", 0)
        assert claimed.started_at is not None
        # Found running: its last delivery was never settled, and is charged as told.
        again = await store.claim(job.id, "w2", 3, unsettled_charge=250)
        assert again is not None and (again.deliveries, again.worker_id) == (2, "w2")
        assert again.fault_charge == 250 and again.started_at == claimed.started_at
        assert await store.transitions(job.id) == [
            ("queued", None),
            ("running", "w1"),
            ("running", "w2"),
        ]
        assert await store.claim("job_unknown", "w1", 3) is None

    async def test_a_job_charged_its_deliveries_is_dead_lettered(
        self, store: JobStore, tenant: str
    ) -> None:
        (job,) = await self.queued(store, tenant)
        assert await store.claim(job.id, "w1", 2) is not None
        assert await store.claim(job.id, "w1", 2) is not None  # charged one failed delivery
        assert await store.claim(job.id, "w1", 2) is None  # a second: no third run
        dead = await store.get(job.id)
        assert dead is not None and dead.status == JobStatus.FAILED
        assert dead.error_code == "max_deliveries_exceeded"
        assert dead.fault_charge == 2 * FAULT_UNIT and dead.finished_at is not None
        assert (await store.transitions(job.id))[-1] == ("failed", "dead-lettered")
        assert await store.claim(job.id, "w1", 2) is None  # ended: never runs again

    async def test_a_queued_job_handed_back_with_its_last_charge_is_dead_lettered(
        self, store: JobStore, tenant: str
    ) -> None:
        # An engine error hands it back charged a whole failed delivery, twice: waiting in
        # its queue, it has used up two deliveries, and its next claim fails it.
        (job,) = await self.running(store, tenant)
        assert await store.requeue(job.id, "engine error", job.deliveries, charge=FAULT_UNIT)
        again = await store.claim(job.id, "w1", 2)
        assert again is not None and again.fault_charge == FAULT_UNIT
        assert await store.requeue(job.id, "engine error", again.deliveries, charge=FAULT_UNIT)
        assert await store.claim(job.id, "w1", 2) is None
        dead = await store.get(job.id)
        assert dead is not None and dead.status == JobStatus.FAILED
        assert dead.error_code == "max_deliveries_exceeded" and dead.deliveries == 2

    async def test_a_burst_of_claims_gets_each_its_own_answer(
        self, store: JobStore, tenant: str
    ) -> None:
        jobs = await self.queued(store, tenant, 12)
        ids = [j.id for j in jobs]
        got = await asyncio.gather(*(store.claim(i, "w1", 3) for i in [*ids, "job_unknown"]))
        assert [g.id for g in got[:-1] if g is not None] == ids and got[-1] is None
        assert all(g.deliveries == 1 for g in got[:-1] if g is not None)
        assert set((await store.statuses(ids)).values()) == {JobStatus.RUNNING}

    # --- endings ------------------------------------------------------------------------

    async def test_a_job_finishes_once_and_is_billed_once(
        self, store: JobStore, tenant: str
    ) -> None:
        (job,) = await self.running(store, tenant)
        ended = await store.finish(job.id, RESULT, job.deliveries)
        assert ended is not None and ended.status == JobStatus.SUCCEEDED
        assert (ended.result_text, ended.finish_reason) == ("done", "length")
        assert (ended.prompt_tokens, ended.completion_tokens) == (7, 3)
        assert ended.finished_at is not None and ended.progress is None
        assert await store.finish(job.id, RESULT, job.deliveries) is None  # again: nothing
        cost = (7 * PRICE_IN + 3 * PRICE_OUT) / Decimal(1_000_000)
        assert await store.usage(job.id) == [Usage(job.id, tenant, 7, 3, cost)]

    async def test_a_stale_delivery_cannot_end_or_hand_back_the_job(
        self, store: JobStore, tenant: str
    ) -> None:
        (job,) = await self.running(store, tenant)
        again = await store.claim(job.id, "w2", 3)
        assert again is not None
        stale = job.deliveries
        assert await store.finish(job.id, RESULT, stale) is None
        assert await store.fail(job.id, "engine_error", "x", delivery=stale) is None
        assert await store.requeue(job.id, "drain", stale) is None
        assert await store.usage(job.id) == []
        current = await store.get(job.id)
        assert current is not None and current.status == JobStatus.RUNNING
        ended = await store.finish(job.id, RESULT, again.deliveries)
        assert ended is not None and ended.worker_id == "w2"

    async def test_a_run_that_fails_fails_its_job(self, store: JobStore, tenant: str) -> None:
        (job,) = await self.running(store, tenant)
        failed = await store.fail(job.id, "engine_error", "it broke", delivery=job.deliveries)
        assert failed is not None and failed.status == JobStatus.FAILED
        assert (failed.error_code, failed.error_message) == ("engine_error", "it broke")
        assert await store.usage(job.id) == []
        # A queued job fails only when told it may.
        (waiting,) = await self.queued(store, tenant)
        assert await store.fail(waiting.id, "invalid", "x") is None
        refused = await store.fail(waiting.id, "invalid", "x", from_queued=True)
        assert refused is not None and refused.status == JobStatus.FAILED

    async def test_a_hand_back_counts_preemptions_and_charges_and_keeps_progress(
        self, store: JobStore, tenant: str
    ) -> None:
        (job,) = await self.running(store, tenant)
        back = await store.requeue(
            job.id, "preempted", job.deliveries, preempted=True, progress=PROGRESS
        )
        assert back is not None and back.status == JobStatus.QUEUED
        assert (back.preemptions, back.fault_charge, back.progress) == (1, 0, PROGRESS)
        assert (await store.transitions(job.id))[-1] == ("queued", "preempted")
        # Handed back again without progress: the kept one stays; a dead engine's share.
        again = await store.claim(job.id, "w1", 3)
        assert again is not None
        back = await store.requeue(job.id, "engine died", again.deliveries, charge=500)
        assert back is not None and (back.preemptions, back.fault_charge) == (1, 500)
        assert back.progress == PROGRESS
        # Its ending lets the progress go: nothing resumes after it.
        last = await store.claim(job.id, "w1", 3)
        assert last is not None
        ended = await store.finish(job.id, RESULT, last.deliveries)
        assert ended is not None and ended.progress is None

    # --- cancels ------------------------------------------------------------------------

    async def test_a_tenant_cancels_its_queued_or_running_job_once(
        self, store: JobStore, tenants: MakeTenants
    ) -> None:
        mine, other = await tenants(2)
        (waiting,) = await self.queued(store, mine)
        (busy,) = await self.running(store, mine)
        for job in (waiting, busy):  # not theirs: untouched
            assert await store.cancel(job.id, other) is None
        assert await store.statuses([waiting.id, busy.id]) == {
            waiting.id: JobStatus.QUEUED,
            busy.id: JobStatus.RUNNING,
        }
        for job in (waiting, busy):
            cancelled = await store.cancel(job.id, mine)
            assert cancelled is not None and cancelled.status == JobStatus.CANCELLED
            assert cancelled.error_code == "cancelled" and cancelled.finished_at is not None
            assert await store.cancel(job.id, mine) is None  # twice: nothing more
        assert await store.usage(waiting.id) == []
        # An ended job cannot be cancelled, and a cancelled one cannot end.
        (done,) = await self.running(store, mine)
        assert await store.finish(done.id, RESULT) is not None
        assert await store.cancel(done.id) is None
        assert await store.finish(busy.id, RESULT, busy.deliveries) is None
        assert await store.usage(busy.id) == []
        # Nor run again, nor go back to its queue.
        assert await store.claim(waiting.id, "w1", 3) is None
        assert await store.requeue(busy.id, "drain", busy.deliveries) is None
        assert await store.fail(busy.id, "engine_error", "x", delivery=busy.deliveries) is None
        assert await store.statuses([waiting.id, busy.id]) == {
            waiting.id: JobStatus.CANCELLED,
            busy.id: JobStatus.CANCELLED,
        }

    async def test_a_cancelled_run_is_billed_once_for_what_it_computed(
        self, store: JobStore, tenant: str
    ) -> None:
        (job,) = await self.running(store, tenant)
        assert await store.bill_cancelled(job.id, 20, 5) is None  # not cancelled yet
        assert await store.cancel(job.id) is not None
        billed = await asyncio.gather(*(store.bill_cancelled(job.id, 20, 5) for _ in range(3)))
        assert sum(b is not None for b in billed) == 1
        first = next(b for b in billed if b is not None)
        assert (first.prompt_tokens, first.completion_tokens) == (20, 5)
        cost = (20 * PRICE_IN + 5 * PRICE_OUT) / Decimal(1_000_000)
        assert await store.usage(job.id) == [Usage(job.id, tenant, 20, 5, cost)]

    async def test_cancelling_a_queued_job_bills_the_tokens_its_earlier_runs_kept(
        self, store: JobStore, tenant: str
    ) -> None:
        # Preempted after generating 4 tokens of a 6-token prompt, kept for the next run;
        # then cancelled while queued: no run will bill those tokens, the cancel does.
        kept, fresh = await self.running(store, tenant, 2)
        assert await store.requeue(kept.id, "preempted", kept.deliveries, progress=PROGRESS)
        assert await store.requeue(fresh.id, "drain", fresh.deliveries)  # nothing kept
        cancelled = await store.cancel(kept.id)
        assert cancelled is not None and cancelled.status == JobStatus.CANCELLED
        assert cancelled.to_api()["usage"] == {
            "prompt_tokens": 6,
            "completion_tokens": 4,
            "total_tokens": 10,
        }
        assert cancelled.progress is None
        assert [(u.prompt_tokens, u.completion_tokens) for u in await store.usage(kept.id)] == [
            (6, 4)
        ]
        # Billed: a late bill of the run that kept them (the worker's) adds nothing.
        assert await store.bill_cancelled(kept.id, 6, 4) is None
        assert len(await store.usage(kept.id)) == 1
        plain = await store.cancel(fresh.id)
        assert plain is not None and plain.to_api()["usage"] is None
        assert await store.usage(fresh.id) == []

    async def test_a_tenant_stopped_has_every_unfinished_job_cancelled_once(
        self, store: JobStore, tenants: MakeTenants
    ) -> None:
        """A suspension's bulk cancel: the tenant's queued and running jobs, not its ended
        ones nor another tenant's; kept progress billed as `cancel` bills it; a second
        bulk cancel finds nothing."""
        mine, other = await tenants(2)
        kept, busy, ended = await self.running(store, mine, 3)
        (waiting,) = await self.queued(store, mine)
        (theirs,) = await self.queued(store, other)
        assert await store.requeue(kept.id, "preempted", kept.deliveries, progress=PROGRESS)
        assert await store.finish(ended.id, RESULT) is not None
        stopped = await store.cancel_all(mine, "tenant_suspended", "the tenant was suspended")
        assert sorted(j.id for j in stopped) == sorted((kept.id, busy.id, waiting.id))
        for job in stopped:
            assert job.status == JobStatus.CANCELLED and job.error_code == "tenant_suspended"
            assert job.error_message == "the tenant was suspended" and job.progress is None
            assert await store.get(job.id) == job
            assert (await store.transitions(job.id))[-1] == ("cancelled", "tenant_suspended")
        billed = {j.id: j.to_api()["usage"] for j in stopped}
        assert billed[kept.id] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}
        assert billed[busy.id] is None and billed[waiting.id] is None  # the run bills busy
        assert len(await store.usage(kept.id)) == 1
        assert (await store.get(ended.id)).status == JobStatus.SUCCEEDED  # type: ignore[union-attr]
        assert (await store.get(theirs.id)).status == JobStatus.QUEUED  # type: ignore[union-attr]
        assert await store.cancel_all(mine, "tenant_suspended", "again") == []
        assert len(await store.usage(kept.id)) == 1


class SqlJobStoreContract(JobStoreContract):
    """The contract on `SqlJobStore`: a module gives `db`, an empty migrated database."""

    @pytest.fixture
    async def store(self, db: Database) -> AsyncIterator[JobStore]:
        store = SqlJobStore(db)
        yield store
        await store.close()

    @pytest.fixture
    def tenants(self, db: Database) -> MakeTenants:
        return tenant_maker(db)

    @pytest.fixture
    def admin(self, db: Database) -> Admin:
        return SqlAdmin(db)

    # --- what unfinished jobs hold, kept by the database ----------------------------------

    async def held_sums(
        self, db: Database
    ) -> tuple[Counter[tuple[Any, ...]], Counter[tuple[Any, ...]]]:
        """The running sums triggers keep (held_reservations), and the same sums taken
        over every queued or running job's row written `held_counted`: per tenant, tier
        and pair of prices, the jobs, their reserved tokens, prompt part and output bound."""
        kept: Counter[tuple[Any, ...]] = Counter()
        summed: Counter[tuple[Any, ...]] = Counter()
        async with db.session() as s:
            for h in (await s.execute(select(HeldReservation))).scalars():
                key = (h.tenant_id, h.tier, h.input_price, h.output_price)
                for name in ("jobs", "reserved_tokens", "prompt_tokens", "output_tokens"):
                    kept[(*key, name)] += getattr(h, name)
            held = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
            counted = select(Job).where(Job.status.in_(held), Job.held_counted)
            for j in (await s.execute(counted)).scalars():
                key = (j.tenant_id, j.tier, _price_key(j.input_price), _price_key(j.output_price))
                bound = output_bound(j.params)
                summed[(*key, "jobs")] += 1
                summed[(*key, "reserved_tokens")] += j.reserved_tokens
                summed[(*key, "prompt_tokens")] += max(j.reserved_tokens - bound, 0)
                summed[(*key, "output_tokens")] += bound
        # A key whose jobs all ended keeps zeros: dropped, and nothing else (a negative sum
        # is a job taken away twice, and must show).
        return Counter({k: n for k, n in kept.items() if n}), Counter(
            {k: n for k, n in summed.items() if n}
        )

    async def held(self, db: Database, tenant_id: str) -> tuple[int, Decimal]:
        async with db.session() as s:
            return await quota_repo.held_reservations(s, tenant_id, "*", utcnow())

    async def held_by_job(self, db: Database, tenant_id: str) -> tuple[int, Decimal]:
        """What the tenant's jobs hold, job by job: each queued or running one counted in
        the sums, and each cancelled while it ran whose usage is not recorded (all within
        the grace here)."""
        tokens, cost = 0, Decimal(0)
        async with db.session() as s:
            for j in (await s.execute(select(Job).where(Job.tenant_id == tenant_id))).scalars():
                unbilled = j.status == JobStatus.CANCELLED.value and j.started_at is not None
                waiting = j.status in (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
                if (waiting and j.held_counted) or (unbilled and j.prompt_tokens is None):
                    tokens += j.reserved_tokens
                    cost += quota_repo.reservation_cost(
                        j.reserved_tokens, output_bound(j.params), j.input_price, j.output_price
                    )
        return tokens, cost

    async def test_the_held_sums_follow_every_write_of_a_job(
        self, db: Database, store: JobStore, tenants: MakeTenants
    ) -> None:
        """A seeded walk through the store's own writes, eight at once (creates at several
        tiers, params and prices, counted in the sums or not, claims, hand-backs,
        finishes, failures, cancels, a tenant's bulk cancel, a job's row deleted), the sums
        compared after each round, and what a budget reads (the sums and the jobs they do
        not count) compared with every job's reservation; then a tenant deleted takes its
        sums with it."""
        rng = random.Random(34)
        owners = await tenants(3)
        params = [{"max_tokens": 16}, {"max_tokens": 4, "n": 3}, {"max_tokens": 8, "n": 0}, {}]
        prices = [(PRICE_IN, PRICE_OUT), (None, None), (Decimal("0.000001"), Decimal("7.25"))]
        ids: list[str] = []
        held = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)

        async def step() -> None:
            move = rng.choice(["create"] * 4 + ["claim"] * 3 + ["end", "requeue", "cancel"])
            if move == "create" or not ids:
                price_in, price_out = rng.choice(prices)
                new = dataclasses.replace(
                    new_job(rng.choice(owners)),
                    tier=rng.choice([Tier.INTERACTIVE, Tier.STANDARD, Tier.BATCH]),
                    params=rng.choice(params),
                    reserved_tokens=rng.randint(1, 60),
                    input_price=price_in,
                    output_price=price_out,
                    held_counted=rng.random() < 0.7,
                )
                ids.append((await store.create(new))[0].id)
                return
            job = await store.get(rng.choice(ids))
            assert job is not None
            if move == "claim":
                await store.claim(job.id, "w1", 5)
            elif move == "end":
                ending = rng.choice(["finish", "fail", "fail_queued"])
                if ending == "finish":
                    await store.finish(job.id, RESULT, job.deliveries)
                elif ending == "fail":
                    await store.fail(job.id, "engine_error", "x", delivery=job.deliveries)
                else:
                    await store.fail(job.id, "invalid", "x", from_queued=True)
            elif move == "requeue":
                await store.requeue(job.id, "drain", job.deliveries)
            else:
                await store.cancel(job.id, rng.choice([None, job.tenant_id]))

        for round_ in range(30):
            await asyncio.gather(*(step() for _ in range(8)))
            if round_ % 10 == 9:
                await store.cancel_all(rng.choice(owners), "tenant_suspended", "stopped")
                gone = ids.pop(rng.randrange(len(ids)))
                async with db.transaction() as s:  # by hand: a row removed, one put back
                    await s.execute(delete(Job).where(Job.id == gone))
                    ended = (await s.execute(select(Job.id).where(Job.status.not_in(held)))).first()
                    if ended is not None:
                        back = update(Job).where(Job.id == ended[0]).values(status="queued")
                        await s.execute(back)
            kept, summed = await self.held_sums(db)
            assert kept == summed, f"round {round_}"
            for owner in owners:  # a budget's read: the sums, and the jobs not counted
                assert await self.held(db, owner) == await self.held_by_job(db, owner)
        assert any(n for key, n in summed.items() if key[-1] == "jobs")  # not all ended
        async with db.transaction() as s:  # a tenant's row removed: its jobs go with it
            await s.execute(delete(Tenant).where(Tenant.id == owners[0]))
        kept, summed = await self.held_sums(db)
        assert kept == summed and all(key[0] != owners[0] for key in kept)

    async def test_a_budget_counts_the_tenants_jobs_from_then_on_and_those_waiting(
        self, db: Database, store: JobStore, tenants: MakeTenants, admin: Admin
    ) -> None:
        """Only the jobs of a tenant with a budget are counted in the sums (the others pay
        no trigger); setting one marks the jobs it has waiting, and counts those after."""
        plain, limited, budgeted = await tenants(3)
        await admin.quota(limited, "*", requests_per_minute=100)
        waiting = await store.admit(admission(budgeted), counted=True)
        running = await store.admit(admission(budgeted), counted=True)
        assert waiting.job is not None and running.job is not None
        assert await store.claim(running.job.id, "w1", 3) is not None
        assert (await self.held(db, budgeted))[0] == 0  # no budget: not read (tokens held)
        await admin.quota(budgeted, "batch", spend_budget=Decimal(5))  # any budget counts
        ids = {waiting.job.id, running.job.id}
        for tenant in (plain, limited, budgeted):
            answer = await store.admit(admission(tenant), counted=True)
            assert answer.job is not None
            if tenant == budgeted:
                ids.add(answer.job.id)
        async with db.session() as s:
            rows = await s.execute(select(Job.id, Job.held_counted))
            assert {job_id for job_id, flag in rows if flag} == ids
        assert (await self.held(db, budgeted))[0] == 30
        assert await store.cancel(waiting.job.id) is not None
        assert (await self.held(db, budgeted))[0] == 20
        kept, summed = await self.held_sums(db)
        assert kept == summed
