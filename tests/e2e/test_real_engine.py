"""The whole platform as real processes with the real vLLM engine and the bundled model.

`tierq run` with the real PostgreSQL and Redis URLs: submit, poll, SSE with a late
joiner, cancel of a long job, prompts past the context refused at admission (and a
long one that fits run), a
worker killed with SIGKILL mid-job (its engine process dies with it; the job finishes on
the restarted worker), an engine that dies under a live worker, interactive work behind
a full engine, the engine core waiting for its steps without spinning, the prefix cache
kept per tenant, the official `openai` SDK (chat, streaming, a small batch) against it, and
structured outputs (JSON schemas through the SDK and in batch lines).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from typing import Any

import httpx
import jsonschema
import openai
import psutil
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI
from pydantic import BaseModel, Field
from sqlalchemy import text

from tests.conftest import REDIS_TEST_URL
from tests.e2e.conftest import PG_ADMIN_KEY, LivePlatform
from tests.helpers import client, read_sse, wait_for
from tierq.core import token_count
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings
from tierq.models.db import Database

pytestmark = pytest.mark.e2e

PARIS = {
    "tier": "interactive",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 32,
    "temperature": 0,
}
STORY = {
    "messages": [{"role": "user", "content": "Write a long story about a dragon and a knight."}],
    "max_tokens": 300,
    "temperature": 0,
}


async def test_submit_and_poll_gets_the_engines_answer(pg_platform: LivePlatform) -> None:
    async with client(pg_platform.url, pg_platform.key) as c:
        job = (await c.post("/v1/jobs", json=PARIS)).json()
        done = await wait_for(c, job["id"], timeout=120)
    assert done["status"] == "succeeded"
    assert "Paris" in done["result"]["text"]
    assert done["result"]["finish_reason"] == "stop"
    assert done["usage"]["prompt_tokens"] > 10 and done["usage"]["completion_tokens"] > 3
    assert done["model"] == "SmolLM2-135M-Instruct"


async def test_jobs_of_all_tiers_run_together_in_one_engine(pg_platform: LivePlatform) -> None:
    async with client(pg_platform.url, pg_platform.key) as c:
        bodies = [{**STORY, "tier": t, "max_tokens": 24} for t in ("batch", "standard") * 4]
        bodies.append({**PARIS})
        ids = [
            r.json()["id"]
            for r in await asyncio.gather(*(c.post("/v1/jobs", json=b) for b in bodies))
        ]
        jobs = [await wait_for(c, i, timeout=180) for i in ids]
    assert all(j["status"] == "succeeded" for j in jobs)
    # Continuous batching: the jobs overlapped in the engine rather than running one by one.
    starts = sorted(j["started_at"] for j in jobs)
    ends = sorted(j["finished_at"] for j in jobs)
    assert starts[-1] <= ends[0] + 1


async def test_sse_live_reader_and_late_joiner_get_the_same_complete_stream(
    pg_platform: LivePlatform,
) -> None:
    async with client(pg_platform.url, pg_platform.key, timeout=180) as c:
        job = (await c.post("/v1/jobs", json={**STORY, "max_tokens": 64})).json()
        live_task = asyncio.create_task(read_sse(c, f"/v1/jobs/{job['id']}/events"))
        # It streams (its first event is out): the late reader joins mid-stream or after.
        await read_sse(c, f"/v1/jobs/{job['id']}/events", limit=1)
        late = await read_sse(c, f"/v1/jobs/{job['id']}/events")
        live = await live_task
        final = (await c.get(f"/v1/jobs/{job['id']}")).json()
    assert final["status"] == "succeeded"
    assert live == late
    assert live[-1]["event"] == "done" and live[-1]["data"] == final
    assert [int(e["id"]) for e in live] == list(range(1, len(live) + 1))
    assert "".join(e["data"]["text"] for e in live[:-1]) == final["result"]["text"]


async def test_cancel_aborts_a_long_running_job(pg_platform: LivePlatform) -> None:
    async with client(pg_platform.url, pg_platform.key, timeout=180) as c:
        job = (
            await c.post("/v1/jobs", json={**STORY, "max_tokens": 1500, "temperature": 1.0})
        ).json()
        first = await read_sse(c, f"/v1/jobs/{job['id']}/events", limit=1)
        assert first[0]["event"] == "delta"
        cancelled = (await c.post(f"/v1/jobs/{job['id']}/cancel")).json()
        assert cancelled["status"] == "cancelled"
        events = await read_sse(c, f"/v1/jobs/{job['id']}/events")
        # The engine is free again: a new job runs to completion. By then the cancelled
        # run's worker has settled it: it stays cancelled, with no result.
        nxt = await wait_for(c, (await c.post("/v1/jobs", json=PARIS)).json()["id"], timeout=120)
        after = (await c.get(f"/v1/jobs/{job['id']}")).json()
    assert events[-1]["event"] == "done" and events[-1]["data"]["status"] == "cancelled"
    assert after["status"] == "cancelled" and after["result"] is None
    assert nxt["status"] == "succeeded"


async def test_the_engine_core_waits_for_each_step_without_spinning(
    pg_platform: LivePlatform,
) -> None:
    """vLLM's engine core reads each step's result from its model worker through a
    shared-memory ring; left alone it spins on sched_yield() meanwhile (half a core or more
    here). On the CPU build the worker has it block instead (tierq/workers/engine/quiet_waits.py):
    while one long job decodes, the engine core's process takes a small part of a core."""
    (core,) = [
        p for p in _engine_processes(pg_platform.pid_of("worker")) if "EngineCor" in p.name()
    ]
    async with client(pg_platform.url, pg_platform.key, timeout=180) as c:
        job = (
            await c.post("/v1/jobs", json={**STORY, "max_tokens": 1500, "temperature": 1.0})
        ).json()
        await read_sse(c, f"/v1/jobs/{job['id']}/events", limit=3)  # decoding now
        before, started = core.cpu_times(), time.monotonic()
        await asyncio.sleep(3)
        after, wall = core.cpu_times(), time.monotonic() - started
        running = (await c.get(f"/v1/jobs/{job['id']}")).json()["status"]
        await c.post(f"/v1/jobs/{job['id']}/cancel")
    assert running == "running"  # it decoded all along
    busy = (after.user + after.system - before.user - before.system) / wall
    assert busy < 0.3, f"the engine core took {busy:.0%} of a core while one job decoded"


def _engine_processes(pid: int) -> list[psutil.Process]:
    """The processes a worker started (vLLM's engine core and what it started)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


async def _history_and_usage(database_url: str | None, job_id: str) -> tuple[list[str], list[int]]:
    assert database_url is not None
    db = Database(database_url)
    try:
        async with db.session() as s:
            history = await s.execute(
                text("SELECT status FROM job_transitions WHERE job_id = :id ORDER BY id"),
                {"id": job_id},
            )
            usage = await s.execute(
                text("SELECT completion_tokens FROM usage_records WHERE job_id = :id"),
                {"id": job_id},
            )
            return list(history.scalars().all()), list(usage.scalars().all())
    finally:
        await db.close()


async def test_prompts_past_the_context_are_refused_and_a_long_one_that_fits_runs(
    pg_platform: LivePlatform,
) -> None:
    """70 prompts of about 3,000 tokens (the context is 2,048) from one tenant: each is
    refused at admission with context_length_exceeded (the API counts them with the served
    model's tokenizer), none is queued, and a normal job after them runs at once. A long
    prompt that fits (tokenized in a thread on the worker, its ids handed to vLLM) runs,
    its prompt counted as the engine counts it."""
    too_long = {"prompt": "word " * 3000, "max_tokens": 16, "tier": "standard"}
    fits = {"prompt": "word " * 1200 + "\nHow many words?", "max_tokens": 16, "temperature": 0}
    async with client(pg_platform.url, pg_platform.key, timeout=300) as c:
        before = (await c.get("/v1/jobs", params={"limit": 100})).json()["data"]
        refused = [await c.post("/v1/jobs", json=too_long) for _ in range(70)]
        after = (await c.get("/v1/jobs", params={"limit": 100})).json()["data"]
        started = time.monotonic()
        ok = await wait_for(c, (await c.post("/v1/jobs", json=PARIS)).json()["id"], timeout=120)
        waited = time.monotonic() - started
        long = await wait_for(c, (await c.post("/v1/jobs", json=fits)).json()["id"], timeout=120)
    assert {(r.status_code, r.json()["error"]["code"]) for r in refused} == {
        (400, "context_length_exceeded")
    }
    assert [j["id"] for j in after] == [j["id"] for j in before]  # nothing was queued
    assert ok["status"] == "succeeded" and "Paris" in ok["result"]["text"]
    assert waited < 30, f"the normal job waited {waited:.1f} s behind the refused ones"
    assert long["status"] == "succeeded", long
    # 1,200 words and a question: the engine counted every token (BOS included).
    assert 1200 < long["usage"]["prompt_tokens"] < 1300, long["usage"]


async def test_a_worker_killed_mid_job_is_restarted_and_the_job_finishes_once(
    pg_platform: LivePlatform,
) -> None:
    async with client(pg_platform.url, pg_platform.key, timeout=300) as c:
        job = (await c.post("/v1/jobs", json={**STORY, "max_tokens": 200})).json()
        stream = asyncio.create_task(read_sse(c, f"/v1/jobs/{job['id']}/events"))
        await read_sse(c, f"/v1/jobs/{job['id']}/events", limit=3)  # generation under way
        worker_pid = pg_platform.pid_of("worker")
        engine = _engine_processes(worker_pid)
        assert engine, "the worker hosts no engine process"
        # vLLM's engine core armed the parent-death signal (tierq's scheduler hook), so it
        # does not rely on the supervisor killing the group (compose has no such thing).
        armed = f"dies with its parent {worker_pid}"
        assert armed in (pg_platform.state_dir / "logs" / "worker.log").read_text()
        os.kill(worker_pid, signal.SIGKILL)  # the worker alone: nothing tells its engine
        left = _wait_gone(engine, timeout=15)
        assert left == [], f"engine processes outlived their worker: {left}"
        done = await wait_for(c, job["id"], timeout=300)
        events = await stream
    assert done["status"] == "succeeded"
    assert "".join(e["data"]["text"] for e in events[:-1]) == done["result"]["text"]
    assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))
    history, usage = await _history_and_usage(pg_platform.database_url, job["id"])
    assert history == ["queued", "running", "running", "succeeded"]
    assert usage == [done["usage"]["completion_tokens"]]


async def test_a_dead_engine_is_noticed_its_jobs_handed_back_and_its_worker_restarted(
    pg_platform: LivePlatform,
) -> None:
    """The engine core dies under a live worker: within seconds the worker stops taking
    work, hands its job back and exits non-zero; the supervisor starts a new one, which
    finishes the job."""
    async with client(pg_platform.url, pg_platform.key, timeout=300) as c:
        job = (await c.post("/v1/jobs", json={**STORY, "max_tokens": 200})).json()
        await read_sse(c, f"/v1/jobs/{job['id']}/events", limit=3)  # generation under way
        worker_pid = pg_platform.pid_of("worker")
        worker = psutil.Process(worker_pid)
        for proc in _engine_processes(worker_pid):
            proc.kill()
        # The worker notices, hands the job back and exits (status 3) on its own.
        deadline = time.monotonic() + 30
        while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the worker did not notice its dead engine"
            await asyncio.sleep(0.2)
        for _ in range(50):  # the supervisor saw it exit with EXIT_ENGINE_DEAD
            if "worker exited with 3" in pg_platform.output.read_text():
                break
            await asyncio.sleep(0.2)
        assert "worker exited with 3" in pg_platform.output.read_text()
        back = (await c.get(f"/v1/jobs/{job['id']}")).json()
        assert back["status"] in ("queued", "running", "succeeded")  # never stuck on the dead one
        done = await wait_for(c, job["id"], timeout=300)
    assert done["status"] == "succeeded"
    history, usage = await _history_and_usage(pg_platform.database_url, job["id"])
    assert history[:3] == ["queued", "running", "queued"]  # handed back by the worker itself
    assert history[-1] == "succeeded" and len(usage) == 1


async def test_an_interactive_job_behind_a_full_engine_of_batch_work_starts_at_once(
    pg_platform: LivePlatform,
) -> None:
    """16 slots: 20 long batch jobs fill every one; two interactive jobs then get their
    first token while every batch job is still unfinished — each takes a batch request's
    slot inside vLLM (tierq's scheduler preempts it; it resumes later, output kept)."""
    # ignore_eos: a sampled story may end early, and a batch job that finished on its own
    # would say nothing about the interactive jobs.
    long_job = {**STORY, "tier": "batch", "max_tokens": 400, "temperature": 0.8, "ignore_eos": True}
    async with client(pg_platform.url, pg_platform.key, timeout=300) as c:
        posts = await asyncio.gather(*(c.post("/v1/jobs", json=long_job) for _ in range(20)))
        batch = [p.json()["id"] for p in posts]
        for _ in range(240):  # until every one of the 16 slots is taken
            page = (await c.get("/v1/jobs", params={"status": "running", "limit": 100})).json()
            if len({j["id"] for j in page["data"]} & set(batch)) >= 16:
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError("the batch jobs never filled the engine")
        chats = [(await c.post("/v1/jobs", json=PARIS)).json()["id"] for _ in range(2)]
        firsts = await asyncio.gather(
            *(read_sse(c, f"/v1/jobs/{i}/events", limit=1) for i in chats)
        )
        statuses = [(await c.get(f"/v1/jobs/{b}")).json()["status"] for b in batch]
        assert all(f[0]["event"] == "delta" for f in firsts)
        assert "succeeded" not in statuses, statuses
        for job_id in batch:  # leave the engine empty for the tests after this one
            await c.post(f"/v1/jobs/{job_id}/cancel")
        finals = [await wait_for(c, i, timeout=120) for i in chats]
    assert [f["status"] for f in finals] == ["succeeded", "succeeded"]
    # The worker's vLLM ran tierq's scheduler throughout, and never fell back to its own.
    worker_log = (pg_platform.state_dir / "logs" / "worker.log").read_text()
    assert (
        "Using custom scheduler class tierq.workers.engine.vllm_scheduler.TieredScheduler"
        in worker_log
    )
    assert "tierq's scheduler does not fit this vLLM" not in worker_log


async def test_a_batch_job_preempted_inside_vllm_finishes_with_the_text_it_has_alone(
    pg_platform: LivePlatform,
) -> None:
    """Greedy: a batch job run alone, then 16 copies of it filling the engine when an
    interactive job arrives. tierq's scheduler preempts one copy inside vLLM (of equals,
    the one with the least KV to compute again; the worker's log names it); it resumes once
    a slot frees, is never re-queued, and ends with the very text and token count the job
    had alone."""
    # Long enough (about 25 s in a full engine here) that the interactive job surely arrives
    # while the copies run; greedy, and ended by its length, not by a near-tie of EOS.
    probe = {**STORY, "tier": "batch", "max_tokens": 128}
    preempted_before = await _engine_preemptions(pg_platform)
    async with client(pg_platform.url, pg_platform.key, timeout=300) as c:
        alone = await wait_for(c, (await c.post("/v1/jobs", json=probe)).json()["id"], timeout=240)
        assert alone["status"] == "succeeded"
        posts = await asyncio.gather(*(c.post("/v1/jobs", json=probe) for _ in range(16)))
        copies = [p.json()["id"] for p in posts]
        for job_id in copies:  # all 16 in the engine, generating: every slot is busy
            first = await read_sse(c, f"/v1/jobs/{job_id}/events", limit=1)
            assert first[0]["event"] == "delta"
        started = time.monotonic()
        chat = (await c.post("/v1/jobs", json=PARIS)).json()["id"]
        chat_first = await read_sse(c, f"/v1/jobs/{chat}/events", limit=1)
        waited = time.monotonic() - started
        assert chat_first[0]["event"] == "delta"
        statuses = [(await c.get(f"/v1/jobs/{j}")).json()["status"] for j in copies]
        done = {job_id: await wait_for(c, job_id, timeout=600) for job_id in copies}
        assert (await wait_for(c, chat, timeout=120))["status"] == "succeeded"
    worker_log = (pg_platform.state_dir / "logs" / "worker.log").read_text()
    preempted = [j for j in copies if f"tierq: preempted request {j}" in worker_log]
    assert preempted, (
        f"the interactive job's first token came {waited:.1f} s after it was sent, when the "
        f"copies were {statuses}; the worker's log of preemptions and of the chat:\n"
        + "\n".join(
            line for line in worker_log.splitlines()[-400:] if "preempt" in line or chat in line
        )
    )
    for job_id in preempted:
        assert done[job_id]["status"] == "succeeded"
        assert done[job_id]["result"]["text"] == alone["result"]["text"]
        assert done[job_id]["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]
        history, usage = await _history_and_usage(pg_platform.database_url, job_id)
        assert history == ["queued", "running", "succeeded"] and len(usage) == 1
    # Counted from vLLM's own statistics, on the worker's metrics port.
    assert await _engine_preemptions(pg_platform) >= preempted_before + 1


async def _engine_preemptions(live: LivePlatform) -> float:
    """tierq_engine_preemptions_total on the worker's metrics port (RUN_METRICS_PORT + 1)."""
    assert live.metrics_port is not None
    async with httpx.AsyncClient() as h:
        text = (await h.get(f"http://127.0.0.1:{live.metrics_port + 1}/metrics")).text
    found = re.search(r"^tierq_engine_preemptions_total (\S+)$", text, re.M)
    assert found, text[-2000:]
    return float(found.group(1))


async def test_a_job_preempted_midway_resumes_after_its_tokens_with_the_text_it_has_alone(
    pg_platform: LivePlatform,
) -> None:
    """Greedy: a batch job run alone; then the same job preempted midway by the message the
    dispatcher sends to its worker, which aborts it in vLLM and hands it back with the ids
    of the tokens it generated. The next run prefills the prompt and those tokens and
    generates only the rest: the text, the usage and what a follower streamed are those of
    the uninterrupted run, and the engine generated no token twice."""
    probe = {**STORY, "tier": "batch", "max_tokens": 160, "ignore_eos": True}
    async with client(pg_platform.url, pg_platform.key, timeout=300) as c:
        alone = await wait_for(c, (await c.post("/v1/jobs", json=probe)).json()["id"], timeout=240)
        job_id = (await c.post("/v1/jobs", json=probe)).json()["id"]
        follower = asyncio.create_task(read_sse(c, f"/v1/jobs/{job_id}/events"))
        await read_sse(c, f"/v1/jobs/{job_id}/events", limit=8)  # midway: text is flowing
        worker_id = await _worker_of(pg_platform.database_url, job_id)
        r = aioredis.Redis.from_url(REDIS_TEST_URL)
        try:
            names = RedisNames(pg_platform.redis_prefix)
            # Pub/sub delivers at most once (the dispatcher decides again each round): sent
            # again if the run is not put back within 5 s, as long as the job runs.
            for _ in range(3):
                assert await r.publish(names.preempt_channel(worker_id), job_id) == 1
                if await _put_back(pg_platform.database_url, job_id, within_s=5.0):
                    break
        finally:
            await r.aclose()
        done = await wait_for(c, job_id, timeout=240)
        events = await asyncio.wait_for(follower, 60)
    assert done["status"] == "succeeded"
    assert done["result"]["text"] == alone["result"]["text"]
    assert done["usage"] == alone["usage"]
    assert (
        "".join(e["data"]["text"] for e in events if e["event"] == "delta")
        == alone["result"]["text"]
    )
    history, usage = await _history_and_usage(pg_platform.database_url, job_id)
    assert history == ["queued", "running", "queued", "running", "succeeded"], history
    assert usage == [alone["usage"]["completion_tokens"]]
    worker_log = (pg_platform.state_dir / "logs" / "worker.log").read_text()
    runs = [
        int(n) for n in re.findall(rf"job {job_id}: the engine generated (\d+) tokens", worker_log)
    ]
    kept = re.findall(rf"job {job_id} resumes after (\d+) generated tokens", worker_log)
    assert len(runs) == 2 and len(kept) == 1 and runs[0] == int(kept[0]) > 0, (runs, kept)
    assert sum(runs) == alone["usage"]["completion_tokens"]  # no token generated twice


async def _put_back(database_url: str | None, job_id: str, within_s: float) -> bool:
    """Whether the job's run was put back (a transition after queued, running) in time."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        history, _ = await _history_and_usage(database_url, job_id)
        if len(history) > 2:
            return True
    return False


async def _worker_of(database_url: str | None, job_id: str) -> str:
    assert database_url is not None
    db = Database(database_url)
    try:
        async with db.session() as s:
            got = await s.execute(text("SELECT worker_id FROM jobs WHERE id = :id"), {"id": job_id})
            return str(got.scalar_one())
    finally:
        await db.close()


def _cached_prompt_tokens(live: LivePlatform) -> float:
    """The worker's tierq_worker_prefix_cached_tokens_total, over its tiers."""
    assert live.metrics_port is not None
    text = httpx.get(f"http://127.0.0.1:{live.metrics_port + 1}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tierq_worker_prefix_cached_tokens_total{")
    )


async def test_the_prefix_cache_is_each_tenants_own(pg_platform: LivePlatform) -> None:
    """A long system prompt, new to the engine, sent by one tenant twice and then by another
    twice: vLLM's own count of cached prompt tokens is 0 for each tenant's first request
    and most of the prompt for its second — the first tenant's blocks never serve the
    second (each request carries its tenant as vLLM's cache_salt)."""
    system = (
        f"[{os.urandom(8).hex()}] You are the archivist of the Northern Library. "
        + (
            "Answer in one short sentence, cite the shelf, never invent a title, and keep "
            "the reader's question in mind. "
        )
        * 20
    )
    async with client(pg_platform.url, PG_ADMIN_KEY) as a:
        other = (await a.post("/admin/tenants", json={"name": "cache-other"})).json()
        other_key = (await a.post(f"/admin/tenants/{other['id']}/keys")).json()["key"]

    async def cached(key: str, question: str) -> float:
        before = _cached_prompt_tokens(pg_platform)
        body = {
            "tier": "standard",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 4,
            "temperature": 0,
        }
        async with client(pg_platform.url, key, timeout=180) as c:
            job = (await c.post("/v1/jobs", json=body)).json()
            done = await wait_for(c, job["id"], timeout=120)
        assert done["status"] == "succeeded", done
        return _cached_prompt_tokens(pg_platform) - before

    first = await cached(pg_platform.key, "Where are the atlases?")
    again = await cached(pg_platform.key, "Where are the herbals?")
    other_first = await cached(other_key, "Where are the atlases?")
    other_again = await cached(other_key, "Where are the maps?")
    assert first == 0 and other_first == 0, (first, again, other_first, other_again)
    # The system prompt is about 500 tokens: most of it was served from the cache.
    assert again >= 256 and other_again >= 256, (first, again, other_first, other_again)


async def test_the_openai_sdk_chats_streams_and_runs_a_batch_on_the_real_engine(
    pg_platform: LivePlatform,
) -> None:
    """The official SDK, unchanged but for base URL and key: a chat completion, a streamed
    one, and a small batch through Files and Batches (Celery, the batch tier, the engine)."""
    sdk = AsyncOpenAI(base_url=f"{pg_platform.url}/v1", api_key=pg_platform.key, timeout=300)
    model = "SmolLM2-135M-Instruct"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = await sdk.chat.completions.create(
        model=model, messages=question, max_tokens=32, temperature=0, service_tier="priority"
    )
    assert "Paris" in (chat.choices[0].message.content or "")
    assert chat.service_tier == "priority" and chat.usage and chat.usage.prompt_tokens > 10
    stream = await sdk.chat.completions.create(
        model=model,
        messages=question,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in streamed
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 3

    lines = [
        {
            "custom_id": f"capital-{country}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"What is the capital of {country}?"}],
                "max_tokens": 24,
                "temperature": 0,
            },
        }
        for country in ("France", "Italy", "Spain", "Germany")
    ]
    # A line that passes every check before the engine (its characters are well within
    # the limit) but whose prompt is past the model's context once tokenised: the engine's
    # own validation error fails it, and the batch still completes.
    past_context = [{"role": "user", "content": "word " * 3000}]
    lines.append(
        {
            **lines[0],
            "custom_id": "too-long",
            "body": {**lines[0]["body"], "messages": past_context},
        }
    )
    batch, output, errors = await _run_batch(sdk, "capitals.jsonl", lines)
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)
    assert batch.id in [b.id for b in (await sdk.batches.list()).data]
    answers = {
        x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"] for x in output
    }
    assert "Paris" in answers["capital-France"]  # the small model knows this one
    assert all(answers.values()) and len(answers) == 4
    assert [e["custom_id"] for e in errors] == ["too-long"]
    assert errors[0]["error"]["code"] == "context_length_exceeded"


async def test_on_shared_services_tierq_run_makes_no_tenant(pg_platform: LivePlatform) -> None:
    """With service URLs (a fleet's PostgreSQL) `tierq run` adds no dev tenant and no key:
    the only tenant is the one the operator made, with its one key."""
    assert pg_platform.database_url is not None
    db = Database(pg_platform.database_url)
    try:
        async with db.session() as s:
            rows = (
                await s.execute(
                    text(
                        "SELECT t.name, count(k.id) AS keys FROM tenants t "
                        "LEFT JOIN api_keys k ON k.tenant_id = t.id GROUP BY t.name"
                    )
                )
            ).all()
    finally:
        await db.close()
    # (other tests of this module make tenants of their own)
    assert {r.name: r.keys for r in rows}["dev"] == 1
    assert "No tenant is made on shared services" in pg_platform.output.read_text()


class Capital(BaseModel):
    """What the SDK's `parse` turns into a strict JSON schema (additionalProperties false)."""

    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


async def test_structured_outputs_validate_against_their_schema_on_the_real_engine(
    pg_platform: LivePlatform,
) -> None:
    """`response_format` through the official SDK: a JSON schema (plain, streamed, and the
    SDK's own `parse` from a pydantic model), any JSON object, and a schema the engine could
    not compile refused with a 400 before anything is queued."""
    sdk = AsyncOpenAI(base_url=f"{pg_platform.url}/v1", api_key=pg_platform.key, timeout=300)
    model = "SmolLM2-135M-Instruct"
    ask = [{"role": "user", "content": "Describe a person called Ada, aged 36, as JSON."}]
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    chat = await sdk.chat.completions.create(
        model=model, messages=ask, max_tokens=120, temperature=0, response_format=person
    )
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content or ""), PERSON_SCHEMA)

    stream = await sdk.chat.completions.create(
        model=model,
        messages=ask,
        max_tokens=120,
        temperature=0,
        response_format=person,
        stream=True,
    )
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(streamed), PERSON_SCHEMA)

    parsed = await sdk.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Name the capital of France, as JSON."}],
        max_tokens=120,
        temperature=0,
        response_format=Capital,
    )
    capital = parsed.choices[0].message.parsed
    assert isinstance(capital, Capital) and capital.capital

    anything = await sdk.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give the capital of France as a JSON object."}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_object"},
    )
    content = anything.choices[0].message.content or ""
    assert anything.choices[0].finish_reason == "stop", content
    assert isinstance(json.loads(content), dict) and "\n" not in content  # compact

    before = await _job_count(pg_platform)
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(
            model=model,
            messages=ask,
            max_tokens=120,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "string", "pattern": "["}},
            },
        )
    assert refused.value.status_code == 400
    assert "the JSON schema cannot be used" in refused.value.message
    assert refused.value.code == "invalid_response_format"
    assert await _job_count(pg_platform) == before  # nothing was queued


async def test_a_batch_of_schema_lines_returns_json_of_the_schema(
    pg_platform: LivePlatform,
) -> None:
    """Batch lines with a JSON schema each run constrained; a line whose schema cannot be
    compiled fails alone, with its error in the error file."""
    sdk = AsyncOpenAI(base_url=f"{pg_platform.url}/v1", api_key=pg_platform.key, timeout=300)
    body = {
        "model": "SmolLM2-135M-Instruct",
        "max_tokens": 120,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
    }
    lines = [
        {
            "custom_id": f"person-{name}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                **body,
                "messages": [{"role": "user", "content": f"Describe {name} as JSON."}],
            },
        }
        for name in ("Ada", "Alan", "Grace")
    ]
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}}
    lines.append(
        {**lines[0], "custom_id": "bad", "body": {**lines[0]["body"], "response_format": bad}}
    )
    _, output, errors = await _run_batch(sdk, "people.jsonl", lines)
    assert sorted(x["custom_id"] for x in output) == ["person-Ada", "person-Alan", "person-Grace"]
    for x in output:
        content = x["response"]["body"]["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), PERSON_SCHEMA)
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert "the JSON schema cannot be used" in errors[0]["error"]["message"]


async def _run_batch(
    sdk: AsyncOpenAI, name: str, lines: list[dict[str, Any]]
) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]:
    """Upload `lines` as a batch file to chat completions, run it to its end (it must
    complete, with both an output and an error file) and read both files."""
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file = await sdk.files.create(file=(name, data), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for _ in range(600):
        batch = await sdk.batches.retrieve(batch.id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        await asyncio.sleep(0.5)
    assert batch.status == "completed", batch
    assert batch.output_file_id and batch.error_file_id
    output = [
        json.loads(x) for x in (await sdk.files.content(batch.output_file_id)).text.splitlines()
    ]
    errors = [
        json.loads(x) for x in (await sdk.files.content(batch.error_file_id)).text.splitlines()
    ]
    return batch, output, errors


async def _job_count(live: LivePlatform) -> int:
    assert live.database_url is not None
    db = Database(live.database_url)
    try:
        async with db.session() as s:
            return int((await s.execute(text("SELECT count(*) FROM jobs"))).scalar_one())
    finally:
        await db.close()


async def test_logit_bias_forces_and_bounds_tokens_on_the_real_engine(
    pg_platform: LivePlatform,
) -> None:
    """`logit_bias` reaches vLLM: +100 on one token id makes every greedy step that token;
    an id past the vocabulary is a 400 at admission."""
    from tokenizers import Tokenizer

    folder = token_count.own_folder(Settings())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    (zebra,) = tokenizer.encode(" zebra", add_special_tokens=False).ids
    sdk = AsyncOpenAI(base_url=f"{pg_platform.url}/v1", api_key=pg_platform.key, timeout=300)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    forced = await sdk.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=question,
        max_tokens=4,
        temperature=0,
        logit_bias={str(zebra): 100},
    )
    assert forced.choices[0].message.content == " zebra" * 4
    with pytest.raises(openai.BadRequestError, match="past this model's vocabulary"):
        await sdk.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=question,
            max_tokens=4,
            logit_bias={str(tokenizer.get_vocab_size()): -100},
        )


async def test_logprobs_on_the_real_engine_plain_streamed_and_in_a_batch(
    pg_platform: LivePlatform,
) -> None:
    """vLLM's log probabilities in OpenAI's shapes: greedy decoding picks the most likely
    token, so each chosen token is the first of its top_logprobs, with the same value; the
    tokens spell the text; streamed and batch answers carry them alike."""
    sdk = AsyncOpenAI(base_url=f"{pg_platform.url}/v1", api_key=pg_platform.key, timeout=300)
    model = "SmolLM2-135M-Instruct"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = await sdk.chat.completions.create(
        model=model, messages=question, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and chat.usage is not None
    assert len(content) == chat.usage.completion_tokens
    # The tokens spell the text; a run that ended on its own ends with the end-of-turn
    # token, which is generated (and counted) but not part of the text.
    spelled = "".join(t.token for t in content)
    if chat.choices[0].finish_reason == "stop":
        assert content[-1].token == "<|im_end|>"
        spelled = spelled.removesuffix("<|im_end|>")
    assert spelled == chat.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        values = [c.logprob for c in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
    stream = await sdk.chat.completions.create(
        model=model,
        messages=question,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        t
        async for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]

    legacy = await sdk.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    lp = legacy.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert "".join(lp.tokens).removesuffix("<|im_end|>") == legacy.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value and len(top) == 2 and max(top.values()) == value

    line = {
        "custom_id": "scored",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": question,
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        },
    }
    bad = {**line, "custom_id": "too-many", "body": {**line["body"], "top_logprobs": 30}}
    _, output, errors = await _run_batch(sdk, "scored.jsonl", [line, bad])
    [answer] = output
    scored = answer["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["logprob"]) for t in scored] == [(t.token, t.logprob) for t in content]
    assert [e["custom_id"] for e in errors] == ["too-many"]


async def test_n_choices_on_the_real_engine_plain_streamed_and_in_a_batch(
    pg_platform: LivePlatform,
) -> None:
    """n = 3 through vLLM's parallel sampling: three choices, each with its own index and
    finish, sampled apart; streamed choices carry their index; usage counts every choice's
    tokens; a batch line takes n too."""
    sdk = AsyncOpenAI(base_url=f"{pg_platform.url}/v1", api_key=pg_platform.key, timeout=300)
    model = "SmolLM2-135M-Instruct"
    question = [{"role": "user", "content": "Write one word about the sea."}]
    chat = await sdk.chat.completions.create(
        model=model, messages=question, max_tokens=16, temperature=1.0, n=3, logprobs=True
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in chat.choices)
    # Every choice's tokens are counted (each has its entry), and they were sampled apart.
    tokens = [len(c.logprobs.content or []) for c in chat.choices]  # type: ignore[union-attr]
    assert chat.usage is not None and chat.usage.completion_tokens == sum(tokens)
    assert min(tokens) > 0
    assert len({c.message.content for c in chat.choices}) > 1
    stream = await sdk.chat.completions.create(
        model=model,
        messages=question,
        max_tokens=16,
        temperature=1.0,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    async for c in stream:
        usage = c.usage or usage
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(texts) == sorted(finishes) == [0, 1, 2] and all(texts.values())
    assert usage is not None and usage.completion_tokens >= 3
    line = {
        "custom_id": "three",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": question, "max_tokens": 16, "n": 3},
    }
    bad = {**line, "custom_id": "too-many", "body": {**line["body"], "n": 99}}
    _, output, errors = await _run_batch(sdk, "three.jsonl", [line, bad])
    [answer] = output
    body = answer["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] >= 3
    assert [e["custom_id"] for e in errors] == ["too-many"]
