"""Preemption that keeps its work: a run stopped unfinished (preempted for interactive
work, or handed back by a worker that stops) goes back to its queue with the tokens it
generated, and the next run continues after them. Real dispatcher and worker code, real
Redis and PostgreSQL, the simulated engine (named as such: its text is a deterministic
count, " tok1 tok2 ...", so an uninterrupted run's text is known); the real engine's side
is in tests/e2e/test_real_engine.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from sqlalchemy import select, update

from benchmarks.decode_ledger import DecodeLedger
from tests.conftest import Platform
from tests.helpers import admin, client, read_sse, until, until_async, wait_for
from tierq.models import jobs as job_repo
from tierq.models.records import Progress
from tierq.models.tables import Job
from tierq.workers.engine.base import Chunk, Engine, EngineWrapper
from tierq.workers.engine.simulated_engine import CostModel, SimulatedEngine

pytestmark = pytest.mark.integration

MAX_TOKENS = 150
LONG = {"prompt": "x" * 40, "max_tokens": MAX_TOKENS, "tier": "batch"}
WHOLE = "".join(f" tok{i}" for i in range(1, MAX_TOKENS + 1))  # an uninterrupted run's text


class Ledgered(EngineWrapper):
    """Counts every token the engine generates, per request, across runs and workers."""

    def __init__(self, inner: Engine, ledger: DecodeLedger) -> None:
        super().__init__(inner, f"ledgered-{inner.name}")
        self.ledger = ledger
        self.resumed: list[int] = []  # len(resume) of each run

    def observe(
        self, request_id: str, resume: Sequence[int], run: AsyncIterator[Chunk]
    ) -> AsyncIterator[Chunk]:
        self.resumed.append(len(resume))
        return self.ledger.counted(request_id, resume, run)


async def _generating(engine: SimulatedEngine, job_id: str, tokens: int) -> None:
    """Until the engine has generated `tokens` of the job in its current run."""
    for _ in range(3000):
        req = engine._running.get(job_id)
        if req is not None and req.generated >= tokens:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"job {job_id} never reached {tokens} tokens")


async def _start(platform: Platform, worker_id: str, ledger: DecodeLedger) -> Ledgered:
    wrapped: list[Ledgered] = []

    def wrap(inner: Engine) -> Engine:
        wrapped.append(Ledgered(inner, ledger))
        return wrapped[0]

    await platform.start_worker(worker_id, cost=CostModel(slots=4).scaled(2), wrap=wrap)
    return wrapped[0]


def _source(platform: Platform) -> str:
    """What a worker on the simulated engine names its kept token ids' vocabulary."""
    model = platform.settings.model_path or "bundled"
    return f"simulated:{model}:{platform.settings.served_model_name}"


async def _progress_column(platform: Platform, job_id: str) -> Any:
    async with platform.db.session() as s:
        return (await s.execute(select(Job.progress).where(Job.id == job_id))).scalar_one()


@pytest.mark.with_settings(engine_preemption=False)
async def test_a_preempted_job_resumes_after_its_tokens_and_streams_no_gap_nor_repeat(
    platform: Platform, tenant_key: str
) -> None:
    """Preempted midway (the dispatcher's message to its worker): it goes back to its queue
    with the 40-odd tokens it generated; the next run generates only the rest; the text,
    the usage and what a follower streamed are those of an uninterrupted run."""
    platform.start_dispatcher()
    ledger = DecodeLedger()
    engine = await _start(platform, "w1", ledger)
    sim = platform.workers["w1"][2]
    async with client(platform.url, tenant_key) as c:
        job_id = (await c.post("/v1/jobs", json=LONG)).json()["id"]
        follower = asyncio.create_task(read_sse(c, f"/v1/jobs/{job_id}/events"))
        await _generating(sim, job_id, 40)
        await platform.r.publish(platform.dispatcher.names.preempt_channel("w1"), job_id)
        done = await wait_for(c, job_id, timeout=60)
        events = await asyncio.wait_for(follower, 30)
    assert done["status"] == "succeeded"
    assert done["result"]["text"] == WHOLE
    assert done["usage"]["completion_tokens"] == MAX_TOKENS
    assert engine.resumed[0] == 0 and engine.resumed[1] >= 40, engine.resumed
    assert ledger.generated[job_id] == MAX_TOKENS and ledger.wasted() == 0
    streamed = "".join(e["data"]["text"] for e in events if e["event"] == "delta")
    assert streamed == WHOLE
    assert [e["event"] for e in events if e["event"] != "delta"] == ["done"]
    async with platform.db.session() as s:
        history = [st for st, _ in await job_repo.transitions(s, job_id)]
        usage = await job_repo.usage_for_job(s, job_id)
        record = await job_repo.get_job(s, job_id)
    assert history == ["queued", "running", "queued", "running", "succeeded"], history
    assert len(usage) == 1 and usage[0].completion_tokens == MAX_TOKENS
    assert record is not None and record.preemptions == 1
    assert await _progress_column(platform, job_id) is None  # cleared once it ended
    # Admitted once; put back once, which is no arrival (the autoscaling signal's count).
    assert await platform.r.get(platform.dispatcher.names.arrivals) == "1"


async def test_a_job_handed_back_by_a_stopping_worker_resumes_on_another(
    platform: Platform, tenant_key: str
) -> None:
    """A worker stopped past its drain hands its running job back with what it generated;
    another worker continues it: no token generated twice, the text whole."""
    platform.start_dispatcher()
    ledger = DecodeLedger()
    await _start(platform, "w1", ledger)
    worker, task, sim = platform.workers["w1"]
    async with client(platform.url, tenant_key) as c:
        job_id = (await c.post("/v1/jobs", json=LONG)).json()["id"]
        await _generating(sim, job_id, 30)
        worker.request_stop()
        worker.request_stop()  # the second signal: no drain, hand back now
        await asyncio.wait_for(task, 10)
        kept = await _progress_column(platform, job_id)
        assert kept is not None and len(kept["token_ids"]) >= 30
        assert kept["text"] == WHOLE[: len(kept["text"])]
        await _start(platform, "w2", ledger)
        done = await wait_for(c, job_id, timeout=60)
    assert done["status"] == "succeeded" and done["result"]["text"] == WHOLE
    assert ledger.generated[job_id] == MAX_TOKENS and ledger.wasted() == 0


@pytest.mark.with_settings(engine_preemption=False)
async def test_a_job_with_penalties_starts_again_and_says_what_was_wasted(
    platform: Platform, tenant_key: str
) -> None:
    """Presence and frequency penalties count only the tokens a run generated itself, so a
    job with them cannot continue another run's tokens as that run would have: it starts
    again, the work thrown away is counted, and it still finishes whole, once."""
    platform.start_dispatcher()
    ledger = DecodeLedger()
    engine = await _start(platform, "w1", ledger)
    sim = platform.workers["w1"][2]
    async with client(platform.url, tenant_key) as c:
        body = {**LONG, "frequency_penalty": 0.5}
        job_id = (await c.post("/v1/jobs", json=body)).json()["id"]
        await _generating(sim, job_id, 20)
        await platform.r.publish(platform.dispatcher.names.preempt_channel("w1"), job_id)
        done = await wait_for(c, job_id, timeout=60)
    assert done["status"] == "succeeded" and done["result"]["text"] == WHOLE
    assert engine.resumed == [0, 0]
    assert ledger.wasted() >= 20


async def test_kept_progress_its_followers_never_saw_is_not_resumed_after(
    platform: Platform, tenant_key: str
) -> None:
    """Redis lost the job's replay buffer and nobody restored it: followers lack what was
    kept, and the event numbers they hold no longer match what a resumed run would write
    (one delta for the kept text, where the first run wrote many: a follower's next events
    would be dropped as seen). The job starts again and streams as the first run did: the
    follower's text is whole."""
    ledger = DecodeLedger()
    async with client(platform.url, tenant_key) as c:
        job_id = (await c.post("/v1/jobs", json=LONG)).json()["id"]
        text = "".join(f" tok{i}" for i in range(1, 41))
        kept = Progress(tuple(range(1, 41)), text, 10, _source(platform))
        async with platform.db.transaction() as s:
            await s.execute(update(Job).where(Job.id == job_id).values(progress=kept.to_json()))
        follower = asyncio.create_task(read_sse(c, f"/v1/jobs/{job_id}/events"))
        platform.start_dispatcher()
        engine = await _start(platform, "w1", ledger)
        done = await wait_for(c, job_id, timeout=60)
        events = await asyncio.wait_for(follower, 30)
    assert done["result"]["text"] == WHOLE and done["usage"]["completion_tokens"] == MAX_TOKENS
    assert "".join(e["data"]["text"] for e in events if e["event"] == "delta") == WHOLE
    assert engine.resumed == [0] and ledger.generated[job_id] == MAX_TOKENS


class _ResumeStalls(EngineWrapper):
    """A run that resumes after kept tokens generates nothing until it is aborted (the
    first run of a request is the inner engine's own)."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner, "resume-stalls")
        self.stalled: set[str] = set()
        self.aborted: set[str] = set()

    async def observe(
        self, request_id: str, resume: Sequence[int], run: AsyncIterator[Chunk]
    ) -> AsyncIterator[Chunk]:
        if resume:
            # Only this run's abort ends its stall, not the one that preempted the last run.
            self.aborted.discard(request_id)
            self.stalled.add(request_id)
            for _ in range(3000):  # 30 s at most
                if request_id in self.aborted:
                    return  # aborted before its first token: a run with no chunk
                await asyncio.sleep(0.01)
        async for chunk in run:
            yield chunk

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)
        await self.inner.abort(request_id)


@pytest.mark.with_settings(engine_preemption=False)
async def test_a_resumed_run_cancelled_before_its_first_token_bills_what_was_kept(
    platform: Platform, tenant_key: str
) -> None:
    """Preempted after 40-odd tokens; the run that resumes after them is cancelled before
    it generates one: the tenant is billed the prompt and the kept tokens (no earlier run
    billed them), once."""
    platform.start_dispatcher()
    stalls: list[_ResumeStalls] = []

    def wrap(inner: Engine) -> Engine:
        stalls.append(_ResumeStalls(inner))
        return stalls[0]

    await platform.start_worker("w1", cost=CostModel(slots=4).scaled(2), wrap=wrap)
    sim = platform.workers["w1"][2]
    async with client(platform.url, tenant_key) as c:
        job_id = (await c.post("/v1/jobs", json=LONG)).json()["id"]
        await _generating(sim, job_id, 40)
        await platform.r.publish(platform.dispatcher.names.preempt_channel("w1"), job_id)
        await until(lambda: job_id in stalls[0].stalled, "the job never resumed", 10)
        async with platform.db.session() as s:
            record = await job_repo.get_job(s, job_id)
        assert record is not None and record.progress is not None
        kept = record.progress
        assert len(kept.token_ids) >= 40
        assert (await c.post(f"/v1/jobs/{job_id}/cancel")).status_code == 200

        async def billed() -> bool:
            return (await c.get(f"/v1/jobs/{job_id}")).json()["usage"] is not None

        await until_async(billed, f"{job_id} billed", 10)
        job = (await c.get(f"/v1/jobs/{job_id}")).json()
    assert job["status"] == "cancelled"
    assert job["usage"] == {
        "prompt_tokens": kept.prompt_tokens,
        "completion_tokens": len(kept.token_ids),
        "total_tokens": kept.prompt_tokens + len(kept.token_ids),
    }
    async with platform.db.session() as s:
        usage = await job_repo.usage_for_job(s, job_id)
        record = await job_repo.get_job(s, job_id)
    assert [(u.prompt_tokens, u.completion_tokens) for u in usage] == [
        (kept.prompt_tokens, len(kept.token_ids))
    ]
    assert record is not None and record.deliveries == 2  # the preempted run, the cancelled one


class _FailsOnce(EngineWrapper):
    """The first run of each request raises an unknown error after 30 tokens."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner, "fails-once")
        self.failed: set[str] = set()

    async def observe(
        self, request_id: str, resume: Sequence[int], run: AsyncIterator[Chunk]
    ) -> AsyncIterator[Chunk]:
        n = 0
        async for chunk in run:
            yield chunk
            n += chunk.new_tokens
            if n >= 30 and request_id not in self.failed:
                self.failed.add(request_id)
                await self.inner.abort(request_id)
                raise RuntimeError("injected: an unknown engine error")


async def test_an_unknown_engine_error_midway_keeps_what_was_generated(
    platform: Platform, tenant_key: str
) -> None:
    """An unknown error goes back for another delivery, which resumes after the tokens
    the failed run generated: none generated twice, the text whole."""
    ledger = DecodeLedger()
    platform.start_dispatcher()
    engines: list[Ledgered] = []

    def wrap(inner: Engine) -> Engine:
        engines.append(Ledgered(_FailsOnce(inner), ledger))
        return engines[0]

    await platform.start_worker("w1", cost=CostModel(slots=4).scaled(2), wrap=wrap)
    async with client(platform.url, tenant_key) as c:
        job_id = (await c.post("/v1/jobs", json=LONG)).json()["id"]
        done = await wait_for(c, job_id, timeout=60)
    assert done["status"] == "succeeded" and done["result"]["text"] == WHOLE
    assert engines[0].resumed == [0, 30] and ledger.generated[job_id] == MAX_TOKENS


async def test_a_suspended_tenants_jobs_keep_no_progress(
    platform: Platform, tenant_key: str
) -> None:
    """Cancelling a tenant's unfinished jobs (suspension) drops what they kept."""
    async with client(platform.url, tenant_key) as c:
        job_id = (await c.post("/v1/jobs", json=LONG)).json()["id"]
        tenant_id = (await c.get("/v1/usage")).json()["tenant_id"]
    kept = Progress((1, 2), " tok1 tok2", 10, "simulated:bundled:x")
    async with platform.db.transaction() as s:
        await s.execute(update(Job).where(Job.id == job_id).values(progress=kept.to_json()))
    async with admin(platform) as a:
        assert (await a.post(f"/admin/tenants/{tenant_id}/suspend")).status_code == 200
    async with platform.db.session() as s:
        record = await job_repo.get_job(s, job_id)
    assert record is not None and record.status.value == "cancelled"
    assert await _progress_column(platform, job_id) is None


async def test_progress_of_another_engine_or_model_is_not_resumed_after(
    platform: Platform, tenant_key: str
) -> None:
    """Token ids in another vocabulary (vLLM's, another model's) mean nothing here: the
    job starts again, whole."""
    ledger = DecodeLedger()
    async with client(platform.url, tenant_key) as c:
        job_id = (await c.post("/v1/jobs", json=LONG)).json()["id"]
        kept = Progress((5, 6, 7), " x y z", 10, "vllm:/models/other:SmolLM2-135M-Instruct")
        async with platform.db.transaction() as s:
            await s.execute(update(Job).where(Job.id == job_id).values(progress=kept.to_json()))
        platform.start_dispatcher()
        engine = await _start(platform, "w1", ledger)
        done = await wait_for(c, job_id, timeout=60)
    assert done["result"]["text"] == WHOLE and engine.resumed == [0]
