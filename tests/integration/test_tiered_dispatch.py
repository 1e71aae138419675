"""The tiered policy end to end: real dispatcher and worker code, real Redis and PostgreSQL,
the simulated engine (named as such: the engine is not the subject here)."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import Platform
from tests.helpers import client, read_sse, until, wait_for
from tierq.models import jobs as job_repo
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

LONG = {"prompt": "x" * 40, "max_tokens": 150, "tier": "batch"}
SHORT = {"prompt": "y" * 40, "max_tokens": 10, "tier": "interactive"}


async def _two_interactive_jobs_behind_batch_work(
    platform: Platform, tenant_key: str, running: int
) -> tuple[list[str], dict[str, list[str]]]:
    """Five long batch jobs on a 4-slot worker (`running` of them run); two interactive jobs
    then get their first token while no batch job has finished, and every job finishes
    once, whole. Returns the batch jobs and their status histories."""
    platform.start_dispatcher()
    await platform.start_worker("w1", cost=CostModel(slots=4).scaled(2))
    _, _, engine = platform.workers["w1"]
    async with client(platform.url, tenant_key) as c:
        batch = [(await c.post("/v1/jobs", json=LONG)).json()["id"] for _ in range(5)]
        for job_id in batch[:running]:
            await wait_for(c, job_id, ("running",))
        # Claimed in the database; in the engine from its next step.
        await until(lambda: engine.running == running, f"{running} running in the engine", 5)
        inter = [(await c.post("/v1/jobs", json=SHORT)).json()["id"] for _ in range(2)]
        firsts = [
            await asyncio.wait_for(read_sse(c, f"/v1/jobs/{i}/events", limit=1), 10) for i in inter
        ]
        statuses = [(await c.get(f"/v1/jobs/{b}")).json()["status"] for b in batch]
        assert all(f[0]["event"] == "delta" for f in firsts)
        assert "succeeded" not in statuses  # neither waited for a batch job to end
        finals = [await wait_for(c, j, timeout=60) for j in inter + batch]
    assert all(f["status"] == "succeeded" for f in finals)
    assert all(f["usage"]["completion_tokens"] == 150 for f in finals[2:])
    async with platform.db.session() as s:
        histories = {b: [st for st, _ in await job_repo.transitions(s, b)] for b in batch}
        usage = {b: await job_repo.usage_for_job(s, b) for b in batch}
    assert all(len(u) == 1 for u in usage.values())
    return batch, histories


async def test_interactive_work_takes_a_slot_of_a_full_engine_inside_it_and_the_victim_finishes(
    platform: Platform, tenant_key: str
) -> None:
    """The default: lower tiers fill every slot; interactive jobs go to the worker beyond
    them and the engine preempts batch requests for them (the victims keep their output and
    are never re-queued)."""
    platform.settings.max_num_seqs = 4
    platform.settings.interactive_reserve = 0
    _, histories = await _two_interactive_jobs_behind_batch_work(platform, tenant_key, running=4)
    worker, _, engine = platform.workers["w1"]
    assert worker.engine_preempts and worker.capacity == 4 + platform.settings.interactive_overflow
    assert engine.preemptions == 2
    assert all(h == ["queued", "running", "succeeded"] for h in histories.values()), histories


@pytest.mark.with_settings(engine_preemption=False)
async def test_interactive_work_preempts_a_full_engine_and_the_victim_still_finishes_once(
    platform: Platform, tenant_key: str
) -> None:
    """An engine that cannot preempt for priority: one slot is the interactive reserve, and
    for the second job the dispatcher aborts a batch job and re-queues it."""
    platform.settings.max_num_seqs = 4
    platform.settings.interactive_reserve = 1
    _, histories = await _two_interactive_jobs_behind_batch_work(platform, tenant_key, running=3)
    preempted = [b for b, h in histories.items() if h.count("running") > 1]
    assert preempted, histories  # the second interactive job took a batch job's slot
    for b in preempted:
        assert histories[b][:3] == ["queued", "running", "queued"]


async def test_a_small_tenant_is_not_starved_by_a_big_backlog_in_its_tier(
    platform: Platform, tenant_key: str, other_tenant_key: str
) -> None:
    platform.settings.max_num_seqs = 2
    platform.settings.interactive_reserve = 0
    platform.start_dispatcher()
    async with (
        client(platform.url, tenant_key) as big,
        client(platform.url, other_tenant_key) as small,
    ):
        job = {"prompt": "z" * 40, "max_tokens": 5, "tier": "batch"}
        big_ids = [
            r.json()["id"]
            for r in await asyncio.gather(*(big.post("/v1/jobs", json=job) for _ in range(40)))
        ]
        small_ids = [
            r.json()["id"]
            for r in await asyncio.gather(*(small.post("/v1/jobs", json=job) for _ in range(4)))
        ]
        await platform.start_worker("w1", cost=CostModel(slots=2).scaled(4))
        small_done = [await wait_for(small, i, timeout=60) for i in small_ids]
    assert all(d["status"] == "succeeded" for d in small_done)
    # Fair shares by tokens: the small tenant's four jobs were done while most of the big
    # tenant's forty still waited (FCFS would have run all forty first). Judged from the
    # recorded start times, not from how far the big backlog got while the test polled.
    async with platform.db.session() as s:
        small_end = max(
            r.finished_at for r in [await job_repo.get_job(s, i) for i in small_ids] if r
        )
        big_started = [r.started_at for r in [await job_repo.get_job(s, i) for i in big_ids] if r]
    assert small_end is not None
    started_before = sum(1 for t in big_started if t is not None and t <= small_end)
    assert started_before <= 15, started_before
