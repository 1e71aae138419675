"""`tierq bench curves`: how tierq's costs grow with its work — each figure at several
sizes, printed as a curve (size -> cost) with its fitted growth.

Three parts, each on real servers of the bench's own (a redis-server and a scratch
PostgreSQL database, benchmarks.harness.ScratchPlatform); no engine runs, since none of
these costs is the engine's:

- `ledger`: one tenant's ledger grows through `ledger_sizes` usage records (spread over
  the last 30 days, written by PostgreSQL itself and summed into the day and hour rows as an
  import is, `rebuild_days`), its jobs table beside it up to `jobs_cap` rows. At each size, the real
  API process (no dispatcher, so admitted jobs stay queued) is measured for: admission
  latency p50/p99 and its CPU per job (`POST /v1/jobs` from `clients` clients, the tenant
  under a quota: checked under its exclusive row lock); `GET /v1/usage` over the whole
  ledger (by day) and over a span that starts and ends mid-day (by tier and model), on the
  hour (the edge days' whole hours from their sums) and, apart, cutting an hour (whose
  records are read); and the admin usage report (by model).
- `backlog`: one tenant under budgets (a token budget and a spend budget, every tier, and a
  per-minute rate) whose queued jobs grow through `backlog_sizes`: a batch's, as a bulk
  tenant's backlog is (online jobs waiting are bounded by `max_queued`), written by
  PostgreSQL itself as an expansion writes them (the database's triggers keep what they
  hold). At each size, the real API process (no dispatcher) is measured for admission
  latency p50/p99 and its CPU per job: each admission checks both budgets against what
  the whole backlog holds.
- `dispatch`: the real dispatcher (dispatcher.loop.Dispatcher) against batch-tier queues
  filled through the API's own enqueuer (tierq.core.queue.Enqueuer): at each number of tenants
  with queued work (`tenant_counts`, `tenants_queue` jobs among them) and each queue length
  (`queue_lengths` jobs, `queue_tenants` tenants): a read round (the read-ahead topped up
  by XREADGROUP) after a round's hand-out of 256 jobs, taken shard after shard, and after
  every shard gave up half its read-ahead (the most a round can have to read); the first
  read, which also creates the consumer groups, apart; a decision (the dispatcher's
  `decide`, the policy's `assign` over the read-ahead, p99 over rounds that each hand
  their jobs out and top the read-ahead up) and, apart, the first one after a recovery
  (which builds the policy's indexes over every tenant); and Redis's memory per queued job.
- `streams`: `streams` SSE followers of queued jobs held open on one API process: the API's
  resident memory and Redis's memory per open stream.

Growth: the exponent k of a least-squares fit of log(cost) on log(size) (cost ~ size^k):
below 0.05 flat, below 0.25 logarithmic or slower, 1 linear; a logarithmic cost shows a
small k that shrinks as sizes grow, so the last two points' ratio is printed too. Logs go
to stderr; one JSON line is printed last on stdout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psutil
import redis.asyncio as aioredis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from benchmarks.admission import AdmissionConfig, make_tenants, phase, start_api
from benchmarks.harness import ScratchPlatform
from tierq.core.messages import JobMessage
from tierq.core.queue import Enqueuer
from tierq.core.redis_names import DISPATCH_GROUP, RedisNames
from tierq.core.settings import Settings
from tierq.core.tiers import Tier
from tierq.dispatcher.loop import Dispatcher
from tierq.dispatcher.policy import WorkerSlots
from tierq.models import billing, quotas
from tierq.models.tables import Batch

log = logging.getLogger("tierq.bench")

REDIS_PREFIX = "tqcrv"
PARTS = ("ledger", "backlog", "dispatch", "streams")
ENQUEUE_AT_ONCE = 2048  # enqueues in flight while a queue is filled (the Enqueuer batches them)
DECISIONS = 200  # assign() calls timed per point
READ_ROUNDS = 3  # read rounds timed per point and kind, each after a hand-out
HANDED_PER_ROUND = 256  # jobs a dispatch round hands out before the timed read


@dataclass(frozen=True)
class CurvesConfig:
    ledger_sizes: tuple[int, ...] = (10**3, 10**4, 10**5, 10**6, 10**7)
    jobs_cap: int = 10**6  # the jobs table grows with the ledger up to this many rows
    admission_n: int = 1000  # measured admissions per size
    clients: int = 8
    usage_calls: int = 5  # each usage report's calls per size (the median is reported)
    tenant_counts: tuple[int, ...] = (10, 100, 1000, 10**4, 10**5)
    tenants_queue: int = 10**5  # queued jobs at every tenant count
    queue_lengths: tuple[int, ...] = (10**3, 10**4, 10**5, 10**6)
    queue_tenants: int = 100
    backlog_sizes: tuple[int, ...] = (10**2, 10**3, 10**4, 10**5)
    streams: int = 200
    parts: tuple[str, ...] = PARTS
    keep_logs: bool = False


# --- growth ---------------------------------------------------------------------------


def growth(points: list[tuple[float, float]]) -> dict[str, Any]:
    """The fitted exponent of cost ~ size^k over the points with a positive cost, and the
    cost's ratio between the last two sizes beside their sizes' ratio."""
    pts = [(x, y) for x, y in points if x > 0 and y > 0]
    if len(pts) < 2:
        return {"exponent": None, "last_step": None, "verdict": "too few points"}
    lx = [math.log(x) for x, _ in pts]
    ly = [math.log(y) for _, y in pts]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    sxx = sum((a - mx) ** 2 for a in lx)
    k = sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sxx if sxx else 0.0
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    # ln(size) over 10^3..10^7 fits k = 0.09, over 10..10^5 k = 0.17.
    if k < 0.05:
        verdict = "flat"
    elif k < 0.25:
        verdict = "logarithmic or slower"
    elif k < 0.8:
        verdict = f"grows as size^{k:.2f}"
    else:
        verdict = "linear or worse"
    return {
        "exponent": round(k, 3),
        "last_step": {"size_x": round(x1 / x0, 2), "cost_x": round(y1 / y0, 3)},
        "verdict": verdict,
    }


def curve(
    rows: list[dict[str, Any]], size: str, cost: str, by_nature: str | None = None
) -> dict[str, Any]:
    """One figure's curve from the rows of a part: its points and its growth. `by_nature`:
    why this cost grows with the size whatever the code does (no index can serve it: a
    recovery reads every shard once); such a curve is reported but not held to the
    flat-or-logarithmic target."""
    points = [(float(r[size]), float(r[cost])) for r in rows if r.get(cost) is not None]
    out = {"points": [[x, y] for x, y in points], **growth(points)}
    if by_nature:
        out["by_nature"] = by_nature
    return out


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


# --- the ledger -------------------------------------------------------------------------

# When row g of the fill ended: spread over the 30 days before `until`. The ledger's
# records and the jobs table's rows share it, so each job ends when its record is written.
_ENDED = (
    "CAST(:until AS timestamptz) - ((g % 30) + 1) * interval '1 day'"
    " + ((g * 7919) % 86400) * interval '1 second'"
)
_ROWS = "FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint) - 1) AS g"

# Records of one tenant, rows `lo` to `hi` - 1 of the fill (3 tiers, 2 models, varied
# costs); foreign keys unchecked, as a restore loads.
_FILL_LEDGER = f"""
INSERT INTO usage_records (job_id, tenant_id, tier, model, prompt_tokens, completion_tokens,
    input_price, output_price, cost, created_at)
SELECT 'job_curve_' || g, :tenant, (ARRAY['batch', 'standard', 'interactive'])[1 + g % 3],
    'model-' || (g % 2), 10 + g % 7, 20 + g % 11, '3', '7',
    ((10 + g % 7) * 3 + (20 + g % 11) * 7) * 0.0000001, {_ENDED}
{_ROWS}
"""


async def _columns(s: Any, table: str) -> list[str]:
    got = await s.execute(
        text(
            "SELECT column_name FROM information_schema.columns WHERE table_name = :t "
            "ORDER BY ordinal_position"
        ),
        {"t": table},
    )
    return [row[0] for row in got]


async def _fill(
    p: ScratchPlatform,
    tenant_id: str,
    template_job: str,
    lo: int,
    hi: int,
    jobs_lo: int,
    jobs_hi: int,
    until: datetime,
) -> None:
    db = p.database()
    async with db.transaction() as s:
        await s.execute(text("SET LOCAL session_replication_role = replica"))
        await s.execute(
            text(_FILL_LEDGER), {"tenant": tenant_id, "lo": lo, "hi": hi, "until": until}
        )
        if jobs_hi > jobs_lo:
            # Finished copies of one admitted job: the table's rows as the API writes them.
            cols = await _columns(s, "jobs")
            # Finished as its ledger record was written, with the tokens it bills.
            shown = {
                "id": "'job_curve_' || g",
                "status": "'succeeded'",
                "idempotency_key": "NULL",
                "created_at": f"{_ENDED} - interval '2 seconds'",
                "started_at": f"{_ENDED} - interval '1 second'",
                "finished_at": _ENDED,
                "result_text": "'a finished answer'",
                "finish_reason": "'length'",
                "prompt_tokens": "10 + g % 7",
                "completion_tokens": "20 + g % 11",
            }
            picked = ", ".join(shown.get(c, f"t.{c}") for c in cols)
            await s.execute(
                text(
                    f"INSERT INTO jobs ({', '.join(cols)}) SELECT {picked} "
                    f"{_ROWS}, jobs t WHERE t.id = :template"
                ),
                {"lo": jobs_lo, "hi": jobs_hi, "template": template_job, "until": until},
            )
    async with db.transaction() as s:
        await billing.rebuild_days(s, tenant_id)
    await _vacuum(p, "usage_records", "usage_days", "usage_hours", "jobs")


async def _vacuum(p: ScratchPlatform, *tables: str) -> None:
    """As autovacuum leaves a loaded table: its visibility map and statistics current."""
    assert p.db_url is not None
    engine = create_async_engine(p.db_url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            for table in tables:
                await conn.execute(text(f"VACUUM ANALYZE {table}"))
    finally:
        await engine.dispose()


async def _retire(p: ScratchPlatform, tenant_id: str, keeping: str | None = None) -> None:
    """The jobs a size's admissions left queued (no dispatcher runs) end, an hour back: the
    next size's admissions meet the same queue and the same last minute, and only what the
    fill grew (the ledger and the jobs table, or the backlog: the jobs whose ids start with
    `keeping`, which stay queued) has grown."""
    kept = "" if keeping is None else " AND id NOT LIKE :keeping"
    async with p.database().transaction() as s:
        await s.execute(
            text(
                "UPDATE jobs SET status = 'cancelled', created_at = created_at - interval "
                "'1 hour', finished_at = now() - interval '1 hour' "
                f"WHERE tenant_id = :t AND status = 'queued'{kept}"
            ),
            {"t": tenant_id, "keeping": f"{keeping}%"},
        )


async def _relation_mb(p: ScratchPlatform, table: str) -> float:
    async with p.database().session() as s:
        got = await s.execute(text("SELECT pg_total_relation_size(:t)"), {"t": table})
        return round(int(got.scalar_one()) / 2**20, 1)


async def _tenant_of(client: httpx.AsyncClient, auth: dict[str, str]) -> str:
    me = await client.get("/v1/usage", headers=auth)
    me.raise_for_status()
    return str(me.json()["tenant_id"])


async def _template_job(client: httpx.AsyncClient, auth: dict[str, str]) -> str:
    """A job admitted through the API: the fills copy its row, as the API writes one."""
    first = await client.post(
        "/v1/jobs", json={"prompt": "a template job", "max_tokens": 16}, headers=auth
    )
    first.raise_for_status()
    return str(first.json()["id"])


async def _timed(calls: int, call: Callable[[], Awaitable[httpx.Response]]) -> dict[str, Any]:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        resp = await call()
        times.append(time.perf_counter() - started)
        resp.raise_for_status()
    return {"median_ms": _ms(statistics.median(times)), "max_ms": _ms(max(times))}


async def _ledger(base: Settings, cfg: CurvesConfig) -> dict[str, Any]:
    tag = f"curves_{uuid.uuid4().hex[:8]}"
    rows: list[dict[str, Any]] = []
    async with ScratchPlatform(base, "curves", "simulated", REDIS_PREFIX, tag, cfg.keep_logs) as p:
        api, sup = await start_api(p)
        adm = AdmissionConfig(clients=cfg.clients, n=cfg.admission_n, tenants=1, quota=True)
        (key,) = await make_tenants(p.url, p.admin_key, adm)
        assert api.proc is not None
        pids = [api.proc.pid]
        host, port, model = p.settings.api_host, p.settings.api_port, p.settings.served_model_name
        tenant_auth = {"Authorization": f"Bearer {key}"}
        admin_auth = {"Authorization": f"Bearer {p.admin_key}"}
        async with httpx.AsyncClient(base_url=p.url, timeout=120) as client:
            tenant_id = await _tenant_of(client, tenant_auth)
            template = await _template_job(client, tenant_auth)
            until = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
            # A span from mid-day to mid-day on the hour: whole days from their sums, the
            # edge days' whole hours from theirs; and one whose bounds cut an hour, whose
            # edge hours' records are read too.
            span = {
                "from": int((until - timedelta(days=20, hours=12)).timestamp()),
                "to": int((until - timedelta(days=5, hours=12)).timestamp()),
                "group_by": "tier,model",
            }
            cut = timedelta(minutes=34, seconds=56)
            span_cut = {
                **span,
                "from": int((until - timedelta(days=20, hours=12) + cut).timestamp()),
                "to": int((until - timedelta(days=5, hours=12) + cut).timestamp()),
            }
            filled, jobs_filled = 0, 0
            for size in cfg.ledger_sizes:
                jobs_to = min(size, cfg.jobs_cap)
                started = time.monotonic()
                await _fill(p, tenant_id, template, filled, size, jobs_filled, jobs_to, until)
                log.info(
                    "ledger %d records, jobs %d: filled in %.0f s",
                    size,
                    jobs_to,
                    time.monotonic() - started,
                )
                filled, jobs_filled = size, max(jobs_filled, jobs_to)
                admitted = await phase("jobs", host, port, [key], adm, pids, model)
                await _retire(p, tenant_id)

                def own(params: dict[str, Any] | None = None) -> Awaitable[httpx.Response]:
                    return client.get("/v1/usage", params=params, headers=tenant_auth)

                whole = await _timed(cfg.usage_calls, own)
                part = await _timed(cfg.usage_calls, lambda: own(span))
                part_cut = await _timed(cfg.usage_calls, lambda: own(span_cut))
                report = await _timed(
                    cfg.usage_calls,
                    lambda: client.get(
                        f"/admin/tenants/{tenant_id}/usage",
                        params={"group_by": "model"},
                        headers=admin_auth,
                    ),
                )
                row = {
                    "ledger_records": size,
                    "jobs_rows": jobs_filled,
                    "admission_p50_ms": admitted["p50_ms"],
                    "admission_p99_ms": admitted["p99_ms"],
                    "admission_errors": admitted["errors"],
                    "api_cpu_ms_per_job": admitted["api_cpu_ms_per_job"],
                    "usage_whole_ms": whole["median_ms"],
                    "usage_span_ms": part["median_ms"],
                    "usage_span_cut_ms": part_cut["median_ms"],
                    "admin_report_ms": report["median_ms"],
                    "usage_max_ms": max(
                        whole["max_ms"], part["max_ms"], part_cut["max_ms"], report["max_ms"]
                    ),
                    "usage_records_mb": await _relation_mb(p, "usage_records"),
                    "jobs_mb": await _relation_mb(p, "jobs"),
                }
                log.info("ledger: %s", row)
                rows.append(row)
        sup.kill_all()
        p.completed = True
    x = "ledger_records"
    largest = rows[-1] if rows else {}
    return {
        "rows": rows,
        "curves": {
            name: curve(rows, x, name)
            for name in (
                "admission_p99_ms",
                "api_cpu_ms_per_job",
                "usage_whole_ms",
                "usage_span_ms",
                "usage_span_cut_ms",
                "admin_report_ms",
            )
        },
        "usage_within_1s_at_largest": bool(largest) and largest["usage_max_ms"] <= 1000,
    }


# --- a tenant's backlog, under budgets -----------------------------------------------------

# Queued copies of one admitted job as lines `lo` to `hi` - 1 of a batch, written an hour
# ago (outside the rate's minute); triggers fire as for any insert.
_FILL_BACKLOG = """
INSERT INTO jobs ({columns}) SELECT {picked}
FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint) - 1) AS g, jobs t
WHERE t.id = :template
"""
BACKLOG_PREFIX = "job_backlog_"
BUDGETS = {
    "requests_per_minute": 10**6,
    "token_budget": 10**15,
    "spend_budget": "1000000000",
    "budget_period": "total",
}


async def _backlog_batch(p: ScratchPlatform, tenant_id: str) -> str:
    """A batch in progress whose lines are the backlog: it holds no reservation of its own
    (every line is a job), and nothing runs that would expire or finalise it."""
    batch_id = f"batch_backlog_{uuid.uuid4().hex[:8]}"
    now = datetime.now(UTC)
    async with p.database().transaction() as s:
        s.add(
            Batch(
                id=batch_id,
                tenant_id=tenant_id,
                endpoint="/v1/chat/completions",
                input_file_id="file_backlog",
                completion_window="24h",
                status="in_progress",
                created_at=now,
                in_progress_at=now,
                expires_at=now + timedelta(days=1),
            )
        )
    return batch_id


async def _fill_backlog(
    p: ScratchPlatform, batch_id: str, template_job: str, lo: int, hi: int
) -> None:
    db = p.database()
    async with db.transaction() as s:
        cols = await _columns(s, "jobs")
        shown = {
            "id": f"'{BACKLOG_PREFIX}' || g",
            "status": "'queued'",  # the template itself ends with the first size's retirement
            "started_at": "NULL",
            "finished_at": "NULL",
            "tier": "'batch'",
            "batch_id": f"'{batch_id}'",
            "batch_line": "g",
            "idempotency_key": "NULL",
            "created_at": "now() - interval '1 hour'",
        }
        picked = ", ".join(shown.get(c, f"t.{c}") for c in cols)
        await s.execute(
            text(_FILL_BACKLOG.format(columns=", ".join(cols), picked=picked)),
            {"lo": lo, "hi": hi, "template": template_job},
        )
    await _vacuum(p, "jobs")


async def _held_tokens(p: ScratchPlatform, tenant_id: str) -> int:
    """What the tenant's unfinished work holds, as a budget's check reads it."""
    async with p.database().session() as s:
        tokens, _cost = await quotas.held_reservations(s, tenant_id, "*", datetime.now(UTC))
    return tokens


async def _backlog(base: Settings, cfg: CurvesConfig) -> dict[str, Any]:
    tag = f"curves_{uuid.uuid4().hex[:8]}"
    rows: list[dict[str, Any]] = []
    async with ScratchPlatform(base, "curves", "simulated", REDIS_PREFIX, tag, cfg.keep_logs) as p:
        api, sup = await start_api(p)
        adm = AdmissionConfig(clients=cfg.clients, n=cfg.admission_n, tenants=1)
        (key,) = await make_tenants(p.url, p.admin_key, adm)
        assert api.proc is not None
        host, port, model = p.settings.api_host, p.settings.api_port, p.settings.served_model_name
        tenant_auth = {"Authorization": f"Bearer {key}"}
        admin_auth = {"Authorization": f"Bearer {p.admin_key}"}
        async with httpx.AsyncClient(base_url=p.url, timeout=120) as client:
            tenant_id = await _tenant_of(client, tenant_auth)
            price = {"model": model, "tier": "standard", "input_per_million": "0.5",
                     "output_per_million": "2"}  # fmt: skip
            (await client.put("/admin/prices", json=price, headers=admin_auth)).raise_for_status()
            quota = await client.put(
                f"/admin/tenants/{tenant_id}/quota", json=BUDGETS, headers=admin_auth
            )
            quota.raise_for_status()
            template = await _template_job(client, tenant_auth)
            batch_id = await _backlog_batch(p, tenant_id)
            filled = 0
            for size in cfg.backlog_sizes:
                started = time.monotonic()
                await _fill_backlog(p, batch_id, template, filled, size)
                filled = size
                log.info("backlog %d: filled in %.0f s", size, time.monotonic() - started)
                admitted = await phase("jobs", host, port, [key], adm, [api.proc.pid], model)
                await _retire(p, tenant_id, keeping=BACKLOG_PREFIX)
                usage = await client.get(f"/admin/tenants/{tenant_id}/quota", headers=admin_auth)
                usage.raise_for_status()
                (held,) = usage.json()["data"]
                row = {
                    "queued_jobs": size,
                    "queued_seen": held["usage"]["queued"],
                    "held_tokens": await _held_tokens(p, tenant_id),
                    "admission_p50_ms": admitted["p50_ms"],
                    "admission_p99_ms": admitted["p99_ms"],
                    "admission_errors": admitted["errors"],
                    "jobs_per_s": admitted["jobs_per_s"],
                    "api_cpu_ms_per_job": admitted["api_cpu_ms_per_job"],
                }
                log.info("backlog: %s", row)
                rows.append(row)
        sup.kill_all()
        p.completed = True
    return {
        "rows": rows,
        "curves": {
            name: curve(rows, "queued_jobs", name)
            for name in ("admission_p99_ms", "api_cpu_ms_per_job")
        },
    }


# --- the dispatcher -----------------------------------------------------------------------


async def _used_memory(r: aioredis.Redis) -> int:
    return int((await r.info("memory"))["used_memory"])


async def _fill_queue(r: aioredis.Redis, names: RedisNames, jobs: int, tenants: int) -> None:
    """`jobs` batch-tier jobs round-robin over `tenants` tenants, through the API's enqueuer."""
    enqueuer = Enqueuer(r, names)
    now = time.time()
    for lo in range(0, jobs, ENQUEUE_AT_ONCE):
        await asyncio.gather(
            *(
                enqueuer.enqueue(
                    JobMessage(f"job_q{n}", f"tenant_{n % tenants}", Tier.BATCH, now, 80)
                )
                for n in range(lo, min(jobs, lo + ENQUEUE_AT_ONCE))
            )
        )
    await enqueuer.aclose()


async def _hand_out(d: Dispatcher, r: aioredis.Redis, jobs: int | None) -> None:
    """Take entries out of the read-ahead as hand-offs do (acknowledged and deleted): `jobs`
    of them, one shard after another as a fair policy takes them (a round's dispatch), or
    with None half the read-ahead and one more of every shard (every shard then needs a
    top-up: the most a read round can have to do)."""
    take = d.settings.dispatch_read_ahead // 2 + 1
    left = jobs
    async with r.pipeline(transaction=False) as pipe:
        while left is None or left > 0:
            took = 0
            for shards in d.buffers.values():
                for entries in list(shards.values()):
                    for key in list(entries)[: 1 if jobs else take]:
                        if left is not None and left <= 0:
                            break
                        gone = entries[key]
                        d._drop(gone.job)
                        pipe.xack(gone.stream, DISPATCH_GROUP, gone.job.entry_id)
                        pipe.xdel(gone.stream, gone.job.entry_id)
                        took += 1
                        left = None if left is None else left - 1
            if left is None or not took:
                break
        await pipe.execute()


async def _dispatch_point(
    settings: Settings, r: aioredis.Redis, jobs: int, tenants: int
) -> dict[str, Any]:
    await r.flushdb()
    names = RedisNames(settings.redis_prefix)
    before = await _used_memory(r)
    started = time.monotonic()
    await _fill_queue(r, names, jobs, tenants)
    filled_s = time.monotonic() - started
    per_job = (await _used_memory(r) - before) / jobs
    d = Dispatcher(settings, r)
    if not await d.leadership.acquire():
        raise RuntimeError("the bench's dispatcher could not take the lease")
    started = time.perf_counter()
    await d._recover()  # every shard's consumer group, as a new leader makes them
    await d._read()  # their pending entries (none)
    await d._read()  # then their new ones
    first = time.perf_counter() - started
    buffered = sum(d._queued_jobs.values())
    # Dispatch rounds as the loop runs them: a decision (timed), its jobs handed out, the
    # read-ahead topped up. The first round after a recovery looks at every tenant (the
    # policy's indexes are built); later ones at what changed.
    slots = [WorkerSlots(f"w{i}", 8, 8) for i in range(4)]
    times = []
    first_decision = 0.0
    for call in range(DECISIONS + 1):
        started = time.perf_counter()
        decided = d.decide(slots, time.time() + call)
        elapsed = time.perf_counter() - started
        if call:
            times.append(elapsed)
        else:
            first_decision = elapsed
        for a in decided:
            d._drop(a.job)  # (their entries stay pending in Redis, unacknowledged)
        await d._read()
    times.sort()
    # As a new leader: the read-ahead rebuilt from the pending entries, for the read rounds.
    await d._recover()
    await d._read()
    rounds: dict[int | None, tuple[list[float], list[int]]] = {}
    for handed in (HANDED_PER_ROUND, None):
        reads, topped_up = rounds.setdefault(handed, ([], []))
        for _ in range(READ_ROUNDS):
            await _hand_out(d, r, handed)
            held = sum(d._buffered.values())
            started = time.perf_counter()
            await d._read()
            reads.append(time.perf_counter() - started)
            topped_up.append(sum(d._buffered.values()) - held)
    await d.leadership.release()
    row = {
        "queued_jobs": jobs,
        "tenants": tenants,
        "buffered": buffered,
        "redis_bytes_per_job": round(per_job, 1),
        "first_read_ms": _ms(first),
        # A round after HANDED_PER_ROUND jobs went out, and one after every shard needed a
        # top-up; each with the entries it read.
        "read_round_ms": _ms(statistics.median(rounds[HANDED_PER_ROUND][0])),
        "read_round_entries": int(statistics.median(rounds[HANDED_PER_ROUND][1])),
        "read_round_all_ms": _ms(statistics.median(rounds[None][0])),
        "read_round_all_entries": int(statistics.median(rounds[None][1])),
        "decision_p99_ms": round(times[int(0.99 * (len(times) - 1))] * 1000, 3),
        "first_decision_ms": round(first_decision * 1000, 3),
        "fill_s": round(filled_s, 1),
    }
    log.info("dispatch: %s", row)
    return row


async def _dispatch(base: Settings, cfg: CurvesConfig) -> dict[str, Any]:
    tag = f"curves_{uuid.uuid4().hex[:8]}"
    async with ScratchPlatform(base, "curves", "simulated", REDIS_PREFIX, tag, cfg.keep_logs) as p:
        r = aioredis.Redis.from_url(p.settings.redis_url or "", decode_responses=True)
        # A lease that outlasts the longest read (every consumer group created first).
        settings = p.settings.model_copy(update={"dispatch_lease_s": 3600.0})
        try:
            by_tenants = [
                await _dispatch_point(settings, r, max(cfg.tenants_queue, n), n)
                for n in cfg.tenant_counts
            ]
            by_length = [
                await _dispatch_point(settings, r, n, cfg.queue_tenants) for n in cfg.queue_lengths
            ]
        finally:
            await r.aclose()
        p.completed = True
    figures = (
        "read_round_ms",
        "read_round_all_ms",
        "decision_p99_ms",
        "first_decision_ms",
        "redis_bytes_per_job",
        "first_read_ms",
    )
    recovery = "once per recovery: every shard is read and every tenant looked at"
    nature = {
        "by_tenants": {
            "first_read_ms": recovery,
            "first_decision_ms": recovery,
            "redis_bytes_per_job": "each tenant with queued work has a stream of its own",
        },
        "by_queue_length": {
            "read_round_all_ms": (
                "it reads what every shard gave up, at most tenants x half a read-ahead, "
                "whatever the queue's length"
            ),
        },
    }
    return {
        "by_tenants": {
            "rows": by_tenants,
            "curves": {
                name: curve(by_tenants, "tenants", name, nature["by_tenants"].get(name))
                for name in figures
            },
        },
        "by_queue_length": {
            "rows": by_length,
            "curves": {
                name: curve(by_length, "queued_jobs", name, nature["by_queue_length"].get(name))
                for name in figures
            },
        },
    }


# --- open streams -------------------------------------------------------------------------


async def _follow(
    client: httpx.AsyncClient, job_id: str, opened: asyncio.Event, count: list[int], want: int
) -> None:
    """Follow one job's events until cancelled; `opened` is set once `want` streams are
    open, or at once when this one is refused (its status is then the bench's error)."""
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
        if resp.status_code != 200:
            opened.set()
            raise RuntimeError(f"a stream was refused: {resp.status_code}")
        count[0] += 1
        if count[0] >= want:
            opened.set()
        async for _ in resp.aiter_bytes():
            pass


async def _streams(base: Settings, cfg: CurvesConfig) -> dict[str, Any]:
    tag = f"curves_{uuid.uuid4().hex[:8]}"
    async with ScratchPlatform(base, "curves", "simulated", REDIS_PREFIX, tag, cfg.keep_logs) as p:
        api, sup = await start_api(p)
        (key,) = await make_tenants(p.url, p.admin_key, AdmissionConfig(tenants=1))
        assert api.proc is not None
        proc = psutil.Process(api.proc.pid)
        r = aioredis.Redis.from_url(p.settings.redis_url or "", decode_responses=True)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(
            base_url=p.url, headers=headers, timeout=60, limits=limits
        ) as client:
            ids = []
            for i in range(cfg.streams):
                resp = await client.post(
                    "/v1/jobs", json={"prompt": f"queued {i}", "max_tokens": 8}
                )
                resp.raise_for_status()
                ids.append(resp.json()["id"])
            # One stream opened and closed first: what the first follower sets up once.
            opened, count = asyncio.Event(), [0]
            warm = asyncio.create_task(_follow(client, ids[0], opened, count, 1))
            await asyncio.wait_for(opened.wait(), 30)
            warm.cancel()
            await asyncio.gather(warm, return_exceptions=True)
            await asyncio.sleep(1.0)
            # Memory at half the streams and at all of them: the difference is what the
            # second half costs, past what the first streams set up or freed once.
            half = cfg.streams // 2
            tasks: list[asyncio.Task[None]] = []
            marks = []
            try:
                for batch in (ids[:half], ids[half:]):
                    opened, count = asyncio.Event(), [0]
                    tasks += [
                        asyncio.create_task(_follow(client, j, opened, count, len(batch)))
                        for j in batch
                    ]
                    await asyncio.wait_for(opened.wait(), 120)
                    for t in tasks:  # a refused stream ends its task with the reason
                        if t.done() and not t.cancelled() and t.exception() is not None:
                            raise RuntimeError(str(t.exception()))
                    await asyncio.sleep(2.0)
                    marks.append((proc.memory_info().rss, await _used_memory(r)))
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        await r.aclose()
        sup.kill_all()
        p.completed = True
    (rss0, mem0), (rss1, mem1) = marks
    added = cfg.streams - half
    return {
        "streams": cfg.streams,
        "api_bytes_per_stream": round((rss1 - rss0) / added),
        "redis_bytes_per_stream": round((mem1 - mem0) / added),
    }


async def run_curves(base: Settings, cfg: CurvesConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    parts: dict[str, Callable[[Settings, CurvesConfig], Awaitable[dict[str, Any]]]] = {
        "ledger": _ledger,
        "backlog": _backlog,
        "dispatch": _dispatch,
        "streams": _streams,
    }
    for name in cfg.parts:
        log.info("curves: %s", name)
        out[name] = await parts[name](base, cfg)
    out["config"] = dataclasses.asdict(cfg)
    return out
