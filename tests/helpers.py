"""Small helpers the tests share: a client with a key, waiting for a state, reading SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from benchmarks.harness import sse_events
from tierq.core.redis_names import RedisNames

TERMINAL = ("succeeded", "failed", "cancelled")


def client(url: str, key: str | None, timeout: float = 30) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout)


def admin(platform: Any) -> httpx.AsyncClient:
    """A client of a test platform's admin API (tests.conftest.Platform)."""
    return client(platform.url, platform.settings.admin_api_key)


async def new_tenant(platform: Any, **body: Any) -> tuple[str, str]:
    """A tenant made through the admin API, and a key of it."""
    async with admin(platform) as a:
        resp = await a.post("/admin/tenants", json={"name": f"t-{uuid.uuid4().hex[:8]}", **body})
        assert resp.status_code == 200, resp.text
        tenant = resp.json()
        key = (await a.post(f"/admin/tenants/{tenant['id']}/keys")).json()
    return tenant["id"], key["key"]


async def admit_as(platform: Any, tenant: Any, body: Any, key_id: str | None = None) -> Any:
    """Admission as a route runs it, for a tenant (and key) authenticated a moment earlier:
    what a request already past authentication meets inside the admission transaction."""
    from tierq.core.queue import Enqueuer
    from tierq.services import admission

    queue = Enqueuer(platform.r, platform.dispatcher.names)
    return await admission.submit(
        platform.jobs, queue, platform.settings, tenant, body, None, key_id=key_id
    )


async def until(check: Callable[[], bool], what: str, seconds: float = 30) -> None:
    """Poll `check` every 0.1 s until it holds; fail naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


async def until_async(probe: Callable[[], Awaitable[bool]], what: str, seconds: float = 30) -> None:
    """`until` for a check that must await (Redis, the database, the API)."""
    deadline = time.monotonic() + seconds
    while not await probe():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


async def waiting_on_a_lock(platform: Any) -> bool:
    """Whether a session of the test's PostgreSQL database waits on a lock (an admission
    blocked on a tenant's row lock the test holds)."""
    from sqlalchemy import text

    async with platform.db.session() as s:
        waiting = await s.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
        )
        return bool(waiting.scalar_one())


async def until_streamed(platform: Any, job_id: str, seconds: float = 10) -> None:
    """Until the job's replay buffer in Redis holds an event: it is generating."""
    key = RedisNames(platform.settings.redis_prefix).job_events(job_id)

    async def streamed() -> bool:
        return int(await platform.r.llen(key)) > 0

    await until_async(streamed, f"job {job_id} streams", seconds)


async def admit_retrying(
    c: httpx.AsyncClient,
    body: dict[str, Any],
    key: str,
    deadline: float,
    passing: tuple[int, ...] = (503,),
) -> str:
    """Admit a job by POST /v1/jobs (its Idempotency-Key makes a retry the same job),
    retrying while the platform answers one of `passing` or the connection fails (a
    failover), until `deadline` (time.monotonic()); its id."""
    while True:
        with contextlib.suppress(httpx.TransportError):
            got = await c.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
            if got.status_code in (200, 201, 202):
                return str(got.json()["id"])
            assert got.status_code in passing, got.text
        assert time.monotonic() < deadline, f"{key} was never admitted"
        await asyncio.sleep(0.25)


async def wait_for(
    c: httpx.AsyncClient, job_id: str, statuses: tuple[str, ...] = TERMINAL, timeout: float = 30
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = (await c.get(f"/v1/jobs/{job_id}")).json()
        if job["status"] in statuses:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {job['status']} after {timeout} s")
        await asyncio.sleep(0.05)


async def read_sse(
    c: httpx.AsyncClient, path: str, headers: dict[str, str] | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """Every event of an SSE response until it ends (or `limit` events), as the benchmarks'
    reader gives them (its id only where the event set one), with its data's JSON read.
    Events without a name are not the job's: skipped."""
    events: list[dict[str, Any]] = []
    async with c.stream("GET", path, headers=headers or {}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for event in sse_events(resp):
            if "event" not in event:
                continue
            events.append({**event, "data": json.loads(event["data"] or "null")})
            if limit is not None and len(events) >= limit:
                break
    return events


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "code" in err
    if code is not None:
        assert err["code"] == code, err


def error_code(resp: Any) -> str | None:
    """The OpenAI-shaped error code of a response, if it has one."""
    try:
        return str(resp.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


async def jobs_of(platform: Any, tenant_id: str) -> list[Any]:
    """Every job row of a tenant (models.tables.Job), as the database has them."""
    from sqlalchemy import select

    from tierq.models.tables import Job

    async with platform.db.session() as s:
        return list((await s.execute(select(Job).where(Job.tenant_id == tenant_id))).scalars())


def stop_group(proc: subprocess.Popen[bytes] | None, grace_s: float = 10) -> None:
    """SIGTERM a server a test started in its own session (its whole process group), then
    SIGKILL what is left after `grace_s`."""
    if proc is None:
        return
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    # What is left of its group, its leader gone or not (a child it started).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
