"""The metrics a running platform exports, against the real PostgreSQL and Redis, on the
simulated engine: every series the dashboards query is exported by some component (the
API's /metrics and /admin/metrics, a real `tierq dispatcher --metrics-port`, a real Celery
worker's CELERY_METRICS_PORT), and after a known workload the series hold the expected
counts — jobs per tier, and SLO attainment as computed by hand from the job rows."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from benchmarks.ports import free_port
from tests.conftest import ADMIN_KEY, Platform
from tests.dashboards import dashboard_metric_names
from tests.helpers import admin, client, new_tenant, wait_for
from tests.integration.batch_helpers import finished, jsonl, line, sdk, submit
from tests.integration.celery_proc import CeleryWorker, child_env
from tests.integration.test_dispatcher_failover import DispatcherProc
from tierq.core.metrics import summed_registry
from tierq.core.settings import Settings
from tierq.models.db import Database
from tierq.models.tables import Job, Tenant
from tierq.services.bootstrap import ensure_tenant_key
from tierq.workers.engine.base import Engine
from tierq.workers.engine.faulty_engine import FaultyEngine
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
BATCH_LINES = 12


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of a series' samples whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def scrape(url: str, key: str | None = None) -> Samples:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=10, headers=headers) as c:
        resp = await c.get(url)
    assert resp.status_code == 200, resp.text
    return parse(resp.text)


async def until(
    what: str, probe: Callable[[], Awaitable[bool]], timeout: float = 30, log: str = ""
) -> None:
    deadline = time.monotonic() + timeout
    while not await probe():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}\n{log}"
        await asyncio.sleep(0.1)


@pytest.fixture
async def celery(platform: Platform, tmp_path: Path) -> AsyncIterator[CeleryWorker]:
    """A real Celery worker (and beat) serving its metrics from a multiprocess folder: its
    prefork pool runs tasks in two child processes, whose counts it sums."""
    folder = tmp_path / "prometheus-multiproc"
    folder.mkdir()
    worker = CeleryWorker(
        platform.settings,
        pool="prefork",
        CELERY_METRICS_PORT=str(free_port()),
        PROMETHEUS_MULTIPROC_DIR=str(folder),
        BATCH_MAX_OUTSTANDING=str(BATCH_LINES),
    )
    worker.start()
    yield worker
    worker.stop()


def celery_url(celery: CeleryWorker) -> str:
    return f"http://127.0.0.1:{celery.env['CELERY_METRICS_PORT']}/metrics"


async def celery_samples(celery: CeleryWorker) -> Samples | None:
    try:
        return await scrape(celery_url(celery))
    except httpx.HTTPError:
        assert celery.proc is not None and celery.proc.poll() is None, celery.output()
        return None  # not serving yet


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


async def _jobs(platform: Platform, key: str, tier: str, n: int, max_tokens: int = 12) -> list[str]:
    async with client(platform.url, key) as c:
        ids = []
        for i in range(n):
            body = {"tier": tier, "prompt": f"Count to {i}.", "max_tokens": max_tokens}
            resp = await c.post("/v1/jobs", json=body)
            assert resp.status_code == 202, resp.text
            ids.append(resp.json()["id"])
        return ids


async def _refusals(platform: Platform, key: str, n: int) -> None:
    async with client(platform.url, key) as c:
        for _ in range(n):  # past the model's context: refused before anything is written
            resp = await c.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 50_000})
            assert resp.status_code == 400, resp.text


async def test_every_metric_the_dashboards_query_is_exported(
    platform: Platform, celery: CeleryWorker
) -> None:
    """The dispatcher runs as its own process (`tierq dispatcher --metrics-port`), Celery
    as its own; the API and the worker share this process (and its registry)."""
    wanted = dashboard_metric_names()
    tenant_id, key = await new_tenant(platform)
    dispatcher = DispatcherProc(platform, "dispatcher")
    try:
        await dispatcher.wait_metric("tierq_dispatcher_leader", 1)
        batch = await submit(sdk(platform, key), jsonl([line(f"l-{i}") for i in range(3)]))
        ids = await _jobs(platform, key, "interactive", 3) + await _jobs(
            platform, key, "standard", 3
        )
        await _refusals(platform, key, 1)
        await platform.start_worker("w1")
        async with client(platform.url, key) as c:
            for job_id in ids:
                assert (await wait_for(c, job_id))["status"] == "succeeded"
        await finished(sdk(platform, key), batch.id, celery)

        exported: set[str] = set()
        dispatcher_url = f"http://127.0.0.1:{dispatcher.port}/metrics"

        async def everything_seen() -> bool:
            exported.update(names(await scrape(f"{platform.url}/metrics")))
            exported.update(
                names(
                    await scrape(f"{platform.url}/admin/metrics", platform.settings.admin_api_key)
                )
            )
            exported.update(names(await scrape(dispatcher_url)))
            from_celery = await celery_samples(celery)
            exported.update(names(from_celery or {}))
            return wanted <= exported

        try:
            await until("every dashboard metric", everything_seen)
        except AssertionError:
            raise AssertionError(f"not exported: {sorted(wanted - exported)}") from None
        # Each component serves its own: the dispatcher's gauges come from its process
        # (published once a second, a worker's slots while its heartbeat is fresh).
        gauges = {"tierq_queue_depth", "tierq_worker_slots", "tierq_tier_served_token_share"}

        async def from_the_dispatcher() -> bool:
            return gauges <= names(await scrape(dispatcher_url))

        await until("the dispatcher's own gauges", from_the_dispatcher)
        from_celery = await celery_samples(celery)
        assert from_celery is not None and "tierq_batch_lines" in names(from_celery)
        # Celery's endpoint is unauthenticated: no tenant there.
        assert not any(n.startswith("tierq_tenant_") for n in names(from_celery))
        assert all(("tenant", tenant_id) not in ls for _, ls in from_celery)
    finally:
        dispatcher.stop()


async def _rows(platform: Platform, tenant_id: str) -> list[Any]:
    async with platform.db.session() as s:
        result = await s.execute(select(Job).where(Job.tenant_id == tenant_id))
        return list(result.scalars())


@pytest.mark.with_settings(slo_interactive_s=0.2, slo_standard_s=300.0)
async def test_after_a_known_workload_the_series_hold_the_expected_counts(
    platform: Platform, celery: CeleryWorker
) -> None:
    tenant_id, key = await new_tenant(platform)
    api = f"{platform.url}/metrics"
    before = await scrape(api)
    await until("Celery's metrics", lambda: _serving(celery), log=celery.output())
    celery_before = await celery_samples(celery)
    assert celery_before is not None
    platform.start_dispatcher()

    # No worker yet: everything waits, and the dispatcher sees it wait.
    batch = await submit(sdk(platform, key), jsonl([line(f"l-{i}") for i in range(BATCH_LINES)]))
    waiting = {
        "interactive": await _jobs(platform, key, "interactive", 6),
        "standard": await _jobs(platform, key, "standard", 4),
    }
    await _refusals(platform, key, 2)

    async def queued_as_submitted() -> bool:
        now = await scrape(api)
        return (
            value(now, "tierq_queue_depth", tier="interactive") == 6
            and value(now, "tierq_queue_depth", tier="standard") == 4
            and value(now, "tierq_queue_depth", tier="batch") == BATCH_LINES
        )

    await until("the queue depths", queued_as_submitted, log=celery.output())

    async def lines_pending() -> bool:
        now = await celery_samples(celery)
        return now is not None and value(now, "tierq_batch_lines", state="queued") == BATCH_LINES

    await until("the batch's lines, queued", lines_pending, log=celery.output())
    waited = await scrape(api)
    for tier in ("interactive", "standard", "batch"):
        assert value(waited, "tierq_queue_oldest_job_age_seconds", tier=tier) > 0
    assert value(waited, "tierq_tier_slo_seconds", tier="interactive") == 0.2
    assert value(waited, "tierq_tier_min_share", tier="standard") == 0.20
    assert value(waited, "tierq_tier_min_share", tier="batch") == 0.10
    await asyncio.sleep(0.3)  # the interactive jobs are now past their SLO

    await platform.start_worker("w1")
    later = await _jobs(platform, key, "interactive", 4)  # these may well start in time
    async with client(platform.url, key) as c:
        for job_id in [*waiting["interactive"], *waiting["standard"], *later]:
            assert (await wait_for(c, job_id))["status"] == "succeeded"
    done = await finished(sdk(platform, key), batch.id, celery)
    assert done.status == "completed" and done.request_counts.completed == BATCH_LINES

    async def drained() -> bool:
        now = await scrape(api)
        return sum(value(now, "tierq_queue_depth", tier=t) for t in TIERS) == 0 and (
            value(now, "tierq_worker_slots", worker="w1", state="used") == 0
        )

    await until("empty queues and a free worker", drained)
    after = await scrape(api)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    rows = await _rows(platform, tenant_id)
    slo = platform.settings.tier_slo_s
    for tier in TIERS:
        mine = [r for r in rows if r.tier == tier]
        started = [r for r in mine if r.started_at is not None]
        within = [r for r in started if (r.started_at - r.created_at).total_seconds() <= slo[tier]]
        succeeded = [r for r in mine if r.status == "succeeded"]
        assert (
            len(succeeded) == len(mine) == {"interactive": 10, "standard": 4}.get(tier, BATCH_LINES)
        )
        assert delta("tierq_jobs_started_total", tier=tier) == len(started), tier
        assert delta("tierq_jobs_started_within_slo_total", tier=tier) == len(within), tier
        assert delta("tierq_jobs_finished_total", tier=tier, status="succeeded") == len(succeeded)
        assert delta("tierq_jobs_dispatched_total", tier=tier) == len(mine)
        assert delta("tierq_end_to_end_latency_seconds_count", tier=tier) == len(succeeded)
        assert delta("tierq_time_to_first_token_seconds_count", tier=tier) == len(succeeded)
        several = [r for r in succeeded if (r.completion_tokens or 0) > 1]
        assert delta("tierq_time_per_output_token_seconds_count", tier=tier) == len(several)
        completion = sum(r.completion_tokens or 0 for r in succeeded)
        assert delta("tierq_tokens_served_total", tier=tier, kind="completion") == completion
    # Online jobs are admitted by the API, batch lines by Celery: each counts its own.
    assert delta("tierq_jobs_submitted_total", tier="interactive") == 10
    assert delta("tierq_jobs_submitted_total", tier="standard") == 4
    assert delta("tierq_jobs_submitted_total", tier="batch") == 0
    celery_after = await celery_samples(celery)
    assert celery_after is not None
    submitted_by_celery = value(celery_after, "tierq_jobs_submitted_total", tier="batch") - value(
        celery_before, "tierq_jobs_submitted_total", tier="batch"
    )
    assert submitted_by_celery == BATCH_LINES
    assert delta("tierq_jobs_refused_total", code="context_length_exceeded") == 2
    # The interactive jobs that waited for the worker all missed their 0.2 s; the
    # standard ones (300 s) all made it: the attainment is not a constant.
    assert delta("tierq_jobs_started_within_slo_total", tier="interactive") <= 4
    assert delta("tierq_jobs_started_within_slo_total", tier="standard") == 4
    # Shares as the policy counts them, beside the minimums.
    shares = [value(after, "tierq_tier_served_token_share", tier=t) for t in TIERS]
    assert all(0 <= s <= 1 for s in shares) and abs(sum(shares) - 1) < 1e-6, shares
    assert value(after, "tierq_worker_slots", worker="w1", state="free") > 0

    async with admin(platform) as a:
        tenants = parse((await a.get("/admin/metrics")).text)
    assert value(tenants, "tierq_tenant_jobs_admitted_total", tenant=tenant_id) == 14
    assert (
        value(
            tenants,
            "tierq_tenant_jobs_refused_total",
            tenant=tenant_id,
            code="context_length_exceeded",
        )
        == 2
    )

    async def batch_lines_settled() -> bool:  # no unfinished batch: every state at 0
        now = await celery_samples(celery)
        return (
            now is not None and sum(v for (n, _), v in now.items() if n == "tierq_batch_lines") == 0
        )

    await until("the batch lines to settle", batch_lines_settled, log=celery.output())


TIERS = ("interactive", "standard", "batch")


async def _serving(celery: CeleryWorker) -> bool:
    return await celery_samples(celery) is not None


async def test_dead_letters_are_counted_as_the_job_rows_say(platform: Platform) -> None:
    """An engine that fails every request with an unknown error: each job is retried until
    MAX_DELIVERIES, then fails for good (engine_error) — a dead letter."""
    platform.settings.max_deliveries = 2
    tenant_id, key = await new_tenant(platform)
    api = f"{platform.url}/metrics"
    before = await scrape(api)
    platform.start_dispatcher()

    def failing(engine: Engine) -> Engine:
        return FaultyEngine(engine, 1.0, seed=7, kinds=("random",))

    await platform.start_worker("w1", wrap=failing)
    # The fault comes within a run's first 8 tokens, and a second run resumes after the
    # tokens of the first: 24 leave it at least 16, so it meets its fault too (with 12 a
    # resumed run could end before it, and the job succeed).
    ids = await _jobs(platform, key, "standard", 3, max_tokens=24)
    async with client(platform.url, key) as c:
        for job_id in ids:
            final = await wait_for(c, job_id)
            assert (final["status"], (final["error"] or {}).get("code")) == (
                "failed",
                "engine_error",
            ), final
    after = await scrape(api)
    rows = await _rows(platform, tenant_id)
    dead = [r for r in rows if r.status == "failed" and r.deliveries == 2]
    assert len(dead) == 3

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("tierq_jobs_dead_lettered_total", tier="standard") == len(dead)
    assert delta("tierq_jobs_finished_total", tier="standard", status="failed") == len(dead)
    assert delta("tierq_end_to_end_latency_seconds_count", tier="standard") == len(dead)
    assert delta("tierq_jobs_started_total", tier="standard") == len(dead)  # once each


@pytest.mark.with_settings(engine_preemption=False)
async def test_preemptions_are_counted_as_the_job_rows_say(platform: Platform) -> None:
    """An engine that cannot preempt for priority: interactive work that finds every slot
    taken makes the dispatcher preempt standard jobs, which go back with their progress."""
    tenant_id, key = await new_tenant(platform)
    api = f"{platform.url}/metrics"
    before = await scrape(api)
    platform.start_dispatcher()
    await platform.start_worker("w1", cost=CostModel(slots=8).scaled(2))
    slow = await _jobs(platform, key, "standard", 4, max_tokens=240)
    async with client(platform.url, key) as c:  # they run, and take every slot standard may
        for job_id in slow:
            await wait_for(c, job_id, ("running",), timeout=10)
    quick = await _jobs(platform, key, "interactive", 8, max_tokens=40)
    async with client(platform.url, key) as c:
        for job_id in [*quick, *slow]:
            assert (await wait_for(c, job_id, timeout=60))["status"] == "succeeded"
    after = await scrape(api)
    rows = await _rows(platform, tenant_id)
    for tier in ("interactive", "standard"):
        preempted = sum(r.preemptions for r in rows if r.tier == tier)
        counted = value(after, "tierq_preemptions_total", tier=tier) - value(
            before, "tierq_preemptions_total", tier=tier
        )
        assert counted == preempted, tier
    assert sum(r.preemptions for r in rows) > 0  # the workload did preempt


async def test_several_api_processes_behind_one_port_serve_their_sum(
    settings: Settings, db: Database, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """`tierq api --workers 2`: whichever process answers a scrape, it serves the counts of
    both (the jobs each admitted), and the per-tenant ones only behind the admin key."""
    key = await ensure_tenant_key(settings, "multi", None)
    async with db.session() as s:
        tenant_id = (await s.execute(select(Tenant.id).where(Tenant.name == "multi"))).scalar_one()
    folder = tmp_path / "api-metrics"
    folder.mkdir()
    port = free_port()
    log = tmp_path / "api.log"
    env = child_env(settings, ADMIN_API_KEY=ADMIN_KEY, PROMETHEUS_MULTIPROC_DIR=str(folder))
    tierq = str(Path(sys.executable).parent / "tierq")
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [tierq, "api", "--port", str(port), "--workers", "2"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        async def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                async with httpx.AsyncClient() as c:
                    return (await c.get(f"{url}/healthz")).status_code == 200
            except httpx.HTTPError:
                return False

        await until("the API", up, timeout=60, log=str(log))

        def per_process() -> dict[str, float]:
            """Jobs each process admitted, read from its own file alone."""
            counts = {}
            for file in folder.glob("counter_*.db"):
                alone = tmp_path / f"alone-{file.stem}"
                alone.mkdir(exist_ok=True)
                shutil.copy(file, alone / file.name)
                samples = parse(generate_latest(summed_registry(str(alone), False)).decode())
                counts[file.stem] = value(samples, "tierq_jobs_submitted_total")
            return counts

        admitted = 0
        while sum(1 for n in per_process().values() if n > 0) < 2:  # both took some
            assert admitted < 60, per_process()
            async with client(url, key) as c:  # a new connection each time
                resp = await c.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4})
            assert resp.status_code == 202, resp.text
            admitted += 1
        for _ in range(6):  # each scrape on a new connection: either process answers
            open_ = await scrape(f"{url}/metrics")
            assert value(open_, "tierq_jobs_submitted_total") == admitted
            assert not any(n.startswith("tierq_tenant_") for n in names(open_))
            tenants = await scrape(f"{url}/admin/metrics", ADMIN_KEY)
            assert value(tenants, "tierq_tenant_jobs_admitted_total", tenant=tenant_id) == admitted
            assert "tierq_jobs_submitted_total" not in names(tenants)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def test_reclaims_are_counted_as_the_job_rows_say(platform: Platform) -> None:
    """A worker killed with jobs in its inbox: the dispatcher moves them back once its
    heartbeat is old, and another worker runs them (each job delivered twice)."""
    tenant_id, key = await new_tenant(platform)
    api = f"{platform.url}/metrics"
    before = await scrape(api)
    platform.start_dispatcher()
    slow = CostModel(slots=8).scaled(2)
    await platform.start_worker("doomed", cost=slow)
    ids = await _jobs(platform, key, "standard", 3, max_tokens=120)
    async with client(platform.url, key) as c:
        for job_id in ids:
            await wait_for(c, job_id, ("running",))
        await platform.kill_worker("doomed")
        await platform.start_worker("survivor", cost=slow)
        for job_id in ids:
            assert (await wait_for(c, job_id, timeout=60))["status"] == "succeeded"
    after = await scrape(api)
    rows = await _rows(platform, tenant_id)
    moved = [r for r in rows if r.deliveries == 2]
    assert len(moved) == 3
    reclaimed = value(after, "tierq_jobs_reclaimed_total") - value(
        before, "tierq_jobs_reclaimed_total"
    )
    assert reclaimed == len(moved)
    # Started once each, though run twice.
    started = value(after, "tierq_jobs_started_total", tier="standard") - value(
        before, "tierq_jobs_started_total", tier="standard"
    )
    assert started == 3
