"""One contract for every job store (tierq/models/store): PostgreSQL and the SQLite file
(tests/integration/test_job_store.py), and the in-memory one (tests/unit/test_job_store.py)
run these same tests. A module subclasses `JobStoreContract` and gives two fixtures:
`store`, an empty store, and `tenants`, which makes tenants that jobs may belong to; or
`SqlJobStoreContract`, and gives `db`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from decimal import Decimal

import pytest

from tierq.core.ids import new_id
from tierq.core.messages import FAULT_UNIT
from tierq.core.states import JobStatus
from tierq.core.tiers import Tier
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database
from tierq.models.jobs import IdempotencyConflict, NewJob
from tierq.models.records import JobRecord, Progress
from tierq.models.store import JobStore, Result, SqlJobStore, Usage
from tierq.models.tables import utcnow

MakeTenants = Callable[[int], Awaitable[list[str]]]

PRICE_IN, PRICE_OUT = Decimal("2.5"), Decimal("10")  # per million tokens
PROGRESS = Progress((11, 12, 13, 14), "abcd", 6, "simulated:bundled:m")
RESULT = Result("done", "length", 7, 3)


def tenant_maker(db: Database) -> MakeTenants:
    """`tenants` for a store on a database: tenant rows its jobs may refer to."""

    async def make(n: int) -> list[str]:
        async with db.transaction() as s:
            return [(await tenant_repo.create_tenant(s, new_id("name"))).id for _ in range(n)]

    return make


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


class JobStoreContract:
    @pytest.fixture
    async def tenant(self, tenants: MakeTenants) -> str:
        return (await tenants(1))[0]

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
