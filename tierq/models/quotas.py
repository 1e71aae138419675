"""Quotas and their enforcement at admission: every SQL statement about them.

Admission runs the checks inside the transaction that inserts the job (the job store's
`admit`), one admission of a tenant with quotas at a time: 100 concurrent requests against
a limit of 10 admit exactly 10, on PostgreSQL (`tierq_admit` takes the tenant's row lock)
and on SQLite (a writer holds the whole database). A batch is checked the same way when it
starts (`check`, after `lock_tenant`). The counters are the jobs and usage
tables themselves — exact, and with the database as their record.

- requests_per_minute: jobs admitted over the last 60 s (a sliding window).
- tokens_per_minute: tokens of those jobs — the reservation (prompt estimate +
  max_tokens) until a job finishes, its real prompt + completion tokens after.
- max_queued: the tenant's jobs waiting in the queue (refused beyond it).
- max_running: enforced by the dispatcher, which starts no more of the tenant's jobs at
  once (they wait; nothing is refused).
- token_budget / spend_budget per budget_period (day, month, or total): the ledger of
  the period (read from the spend counters, models.spend: O(1)) plus what unfinished
  work reserves — queued and running jobs, and the lines of batches not yet expanded.
A batch reserves its whole file when it starts, under the same lock, so N batches and
online jobs together can never pass a budget. Jobs that batches expand into count
against budgets only, not against the per-minute and queue limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, case, func, literal, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from tierq.core import clock
from tierq.core.states import JobStatus
from tierq.core.tiers import Tier
from tierq.models import spend
from tierq.models.jobs import tenant_job_counts
from tierq.models.prices import cost_of
from tierq.models.records import as_utc
from tierq.models.tables import (
    UNBILLED_CANCEL,
    Batch,
    HeldReservation,
    Job,
    Quota,
    utcnow,
)

ALL_TIERS = "*"
PERIODS = ("day", "month", "total")
LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_running",
    "max_queued",
    "token_budget",
    "spend_budget",
)
# What admission checks (max_running is the dispatcher's): a tenant whose quotas for a
# tier set none of these is admitted without them (tierq/models/admission.py).
ADMISSION_FIELDS = tuple(f for f in LIMIT_FIELDS if f != "max_running")
# Batch states in which a batch may still turn lines into jobs (so holds a reservation).
EXPANDING = ("validating", "in_progress")
# A job cancelled while it ran holds its reservation until its worker bills what it
# generated, or for this long at most.
BILLING_GRACE = timedelta(minutes=10)


@dataclass(frozen=True)
class QuotaRecord:
    tenant_id: str
    tier: str  # "*" for all tiers
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_running: int | None
    max_queued: int | None
    token_budget: int | None
    spend_budget: Decimal | None
    budget_period: str

    @classmethod
    def from_row(cls, row: Quota) -> QuotaRecord:
        return cls(
            row.tenant_id,
            row.tier,
            row.requests_per_minute,
            row.tokens_per_minute,
            row.max_running,
            row.max_queued,
            row.token_budget,
            row.spend_budget,
            row.budget_period,
        )

    @property
    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in LIMIT_FIELDS)

    def to_api(self) -> dict[str, Any]:
        return {
            "tier": None if self.tier == ALL_TIERS else self.tier,
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "max_running": self.max_running,
            "max_queued": self.max_queued,
            "token_budget": self.token_budget,
            "spend_budget": None if self.spend_budget is None else str(self.spend_budget),
            "budget_period": self.budget_period,
        }


@dataclass(frozen=True)
class Refusal:
    code: str  # rate_limit_exceeded | quota_exceeded | budget_exceeded
    message: str
    retry_after_s: int


async def set_quota(s: AsyncSession, tenant_id: str, tier: str, **limits: Any) -> QuotaRecord:
    """Replace the limits given of the tenant's quota for `tier`. A budget makes the
    tenant's jobs counted in held_reservations' sums from now on, its waiting ones too:
    the database's trigger on quotas does it (tierq/migrations/sql/
    0017_held_reservations.*.sql), whichever process sets the budget."""
    row = (
        await s.execute(select(Quota).where(Quota.tenant_id == tenant_id, Quota.tier == tier))
    ).scalar_one_or_none()
    if row is None:
        row = Quota(tenant_id=tenant_id, tier=tier)
        s.add(row)
    for name, value in limits.items():
        setattr(row, name, value)
    row.updated_at = utcnow()
    await s.flush()
    return QuotaRecord.from_row(row)


async def quotas_of(s: AsyncSession, tenant_id: str) -> list[QuotaRecord]:
    stmt = select(Quota).where(Quota.tenant_id == tenant_id).order_by(Quota.tier)
    return [QuotaRecord.from_row(r) for r in (await s.execute(stmt)).scalars()]


async def all_max_running(s: AsyncSession) -> dict[str, dict[str, int]]:
    """tenant id -> tier ("*" for all) -> max_running, for the dispatcher."""
    stmt = select(Quota.tenant_id, Quota.tier, Quota.max_running).where(
        Quota.max_running.is_not(None)
    )
    out: dict[str, dict[str, int]] = {}
    for tenant_id, tier, limit in (await s.execute(stmt)).all():
        if limit is not None:
            out.setdefault(tenant_id, {})[tier] = int(limit)
    return out


def period_bounds(period: str, now: datetime) -> tuple[datetime | None, datetime | None]:
    """[start, end) of the budget period containing `now` (None, None for "total")."""
    if period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return start, start + timedelta(days=1)
    if period == "month":
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        nxt = (start + timedelta(days=32)).replace(day=1)
        return start, nxt
    return None, None


def _scope(stmt: Any, column_tier: Any, tier: str) -> Any:
    return stmt if tier == ALL_TIERS else stmt.where(column_tier == tier)


@dataclass(frozen=True)
class Figures:
    """What a quota's limits are checked against, as read under the tenant's lock: the
    tenant's online jobs over the last 60 s (requests, tokens, the oldest admission), its
    waiting online jobs, what its unfinished work holds and what the budget period's
    ledger has spent — each in the quota's scope (a tier, or every tier)."""

    minute_requests: int = 0
    minute_tokens: int = 0
    minute_oldest: datetime | None = None
    queued: int = 0
    held_tokens: int = 0
    held_cost: Decimal = Decimal(0)
    spent_tokens: int = 0
    spent_cost: Decimal = Decimal(0)


def decide(
    quota: QuotaRecord,
    figures: Figures,
    tier: str,
    reserved_tokens: int,
    reserved_cost: Decimal,
    now: datetime,
    *,
    online: bool = True,
) -> Refusal | None:
    """The first limit of `quota` that admitting this job would break, or None. The rule
    itself, in one place: a batch's check (`check`), SQLite's and the in-memory store's
    admission judge by it, PostgreSQL's admission function (`tierq_admit`,
    tierq/migrations/sql/0017_tierq_admit.sql) compares the same figures the same way, and
    every refusal is worded here."""
    scope = f" for the {tier} tier" if quota.tier != ALL_TIERS else ""
    if online and (quota.requests_per_minute is not None or quota.tokens_per_minute is not None):
        wait = 1
        if figures.minute_oldest is not None:
            # Never past the window: admissions racing this one may be stamped after it.
            elapsed = (now - figures.minute_oldest).total_seconds()
            wait = min(60, max(1, math.ceil(60 - elapsed)))
        if (
            quota.requests_per_minute is not None
            and figures.minute_requests >= quota.requests_per_minute
        ):
            return Refusal(
                "rate_limit_exceeded",
                f"Rate limit reached{scope}: {quota.requests_per_minute} requests per minute.",
                wait,
            )
        used = figures.minute_tokens
        if quota.tokens_per_minute is not None and used + reserved_tokens > quota.tokens_per_minute:
            return Refusal(
                "rate_limit_exceeded",
                f"Rate limit reached{scope}: {quota.tokens_per_minute} tokens per minute "
                f"({used} used, {reserved_tokens} requested).",
                wait,
            )
    if online and quota.max_queued is not None and figures.queued >= quota.max_queued:
        return too_many_queued(quota.max_queued, scope)
    if quota.token_budget is not None or quota.spend_budget is not None:
        _start, end = period_bounds(quota.budget_period, now)
        wait = 3600 if end is None else max(1, math.ceil((end - now).total_seconds()))
        used_tokens, held_tokens = figures.spent_tokens, figures.held_tokens
        if quota.token_budget is not None and (
            used_tokens + held_tokens + reserved_tokens > quota.token_budget
        ):
            return Refusal(
                "budget_exceeded",
                f"Token budget{scope} of {quota.token_budget} for this {quota.budget_period} "
                f"would be exceeded ({used_tokens} used, {held_tokens} reserved, "
                f"{reserved_tokens} requested).",
                wait,
            )
        used_cost, held_cost = figures.spent_cost, figures.held_cost
        if quota.spend_budget is not None and (
            used_cost + held_cost + reserved_cost > quota.spend_budget
        ):
            return Refusal(
                "budget_exceeded",
                f"Spend budget{scope} of {quota.spend_budget} for this {quota.budget_period} "
                f"would be exceeded ({used_cost} spent, {held_cost} reserved, "
                f"{reserved_cost} requested).",
                wait,
            )
    return None


async def check(
    s: AsyncSession,
    quota: QuotaRecord,
    tier: str,
    reserved_tokens: int,
    reserved_cost: Decimal,
    *,
    online: bool = True,
    now: datetime | None = None,
) -> Refusal | None:
    """The first limit of `quota` that admitting this work would break, or None (read in
    the caller's transaction, after the tenant's lock)."""
    now = now or clock.utcnow()
    return decide(
        quota,
        await read_figures(s, quota, now, online=online),
        tier,
        reserved_tokens,
        reserved_cost,
        now,
        online=online,
    )


async def read_figures(
    s: AsyncSession, quota: QuotaRecord, now: datetime, *, online: bool
) -> Figures:
    """`figures`, in an async session's transaction."""
    return await s.run_sync(lambda ss: figures(ss.connection(), quota, now, online=online))


def figures(conn: Connection, quota: QuotaRecord, now: datetime, *, online: bool) -> Figures:
    """The figures `quota`'s limits need, and only those. Synchronous, so that SQLite's
    admission reads them on its writer's thread (tierq/models/admission_sqlite.py) and an
    async session through `run_sync` (`read_figures`): one statement of each read."""
    tenant, tier = quota.tenant_id, quota.tier
    minute: tuple[int, int, datetime | None] = (0, 0, None)
    if online and (quota.requests_per_minute is not None or quota.tokens_per_minute is not None):
        minute = _minute_window(conn, tenant, tier, now)
    queued = 0
    if online and quota.max_queued is not None:
        queued = queued_jobs(conn, tenant, tier)
    held: tuple[int, Decimal] = (0, Decimal(0))
    used: tuple[int, Decimal] = (0, Decimal(0))
    if quota.token_budget is not None or quota.spend_budget is not None:
        # Reserved work first, spend after: on PostgreSQL each statement sees its own
        # snapshot, and work moves batch -> job -> ledger; read in that order, a move that
        # commits between two reads is counted twice (erring safe), never not at all.
        held = held_in(conn, tenant, tier, now)
        used = spend.spent_in(
            conn, tenant, None if tier == ALL_TIERS else tier, quota.budget_period, now
        )
    return Figures(*minute, queued, *held, *used)


def queued_jobs(conn: Connection, tenant_id: str, tier: str, cap: int | None = None) -> int:
    """The tenant's online jobs waiting (in `tier`, or every tier: "*"); counted up to
    `cap` at most, given one (all a bound needs to know)."""
    waiting = _scope(
        select(literal(1)).where(
            Job.tenant_id == tenant_id,
            Job.status == JobStatus.QUEUED.value,
            Job.batch_id.is_(None),
        ),
        Job.tier,
        tier,
    )
    if cap is not None:
        waiting = waiting.limit(cap)
    return int(conn.execute(select(func.count()).select_from(waiting.subquery())).scalar_one())


def default_bound_applies(default_max_queued: int, quotas: list[QuotaRecord]) -> bool:
    """Whether DEFAULT_MAX_QUEUED bounds a tenant's waiting jobs: it is set, and no quota
    of every tier sets the tenant's own max_queued."""
    return default_max_queued > 0 and not any(
        q.tier == ALL_TIERS and q.max_queued is not None for q in quotas
    )


def too_many_queued(limit: int, scope: str = "") -> Refusal:
    return Refusal(
        "quota_exceeded", f"Too many queued jobs{scope}: at most {limit} may wait at once.", 1
    )


@dataclass(frozen=True)
class QuotaUsage:
    """Where a tenant stands against one quota's limits now: its online requests and tokens
    over the last 60 s, its running and queued jobs and what the budget period has spent,
    each in the quota's scope (a tier, or every tier)."""

    requests_last_minute: int
    tokens_last_minute: int
    running: int
    queued: int
    period_start: datetime | None  # None for a "total" budget period
    tokens_this_period: int
    spend_this_period: Decimal

    def to_api(self) -> dict[str, Any]:
        start = self.period_start
        return {
            "requests_last_minute": self.requests_last_minute,
            "tokens_last_minute": self.tokens_last_minute,
            "running": self.running,
            "queued": self.queued,
            "period_start": int(start.timestamp()) if start else None,
            "tokens_this_period": self.tokens_this_period,
            "spend_this_period": str(self.spend_this_period),
        }


def in_scope(counts: dict[tuple[str, str], int], tier: str, status: str) -> int:
    """Jobs of `status` among `counts` ((tier, status) -> jobs, as models.jobs'
    tenant_job_counts reads them) that a quota of `tier` ("*": every tier) covers."""
    return sum(n for (t, st), n in counts.items() if st == status and tier in (ALL_TIERS, t))


async def usage_report(
    s: AsyncSession, tenant_id: str, now: datetime
) -> list[tuple[QuotaRecord, QuotaUsage]]:
    """Every quota of the tenant (as `quotas_of` orders them) with its usage at `now`."""
    quotas = await quotas_of(s, tenant_id)
    counts = await tenant_job_counts(s, tenant_id)

    def report(conn: Connection) -> list[tuple[QuotaRecord, QuotaUsage]]:
        found = []
        for q in quotas:
            requests, tokens, _oldest = _minute_window(conn, tenant_id, q.tier, now)
            start, _end = period_bounds(q.budget_period, now)
            scope = None if q.tier == ALL_TIERS else q.tier
            period_tokens, period_cost = spend.spent_in(
                conn, tenant_id, scope, q.budget_period, now
            )
            usage = QuotaUsage(
                requests_last_minute=requests,
                tokens_last_minute=tokens,
                running=in_scope(counts, q.tier, JobStatus.RUNNING.value),
                queued=in_scope(counts, q.tier, JobStatus.QUEUED.value),
                period_start=start,
                tokens_this_period=period_tokens,
                spend_this_period=period_cost,
            )
            found.append((q, usage))
        return found

    return await s.run_sync(lambda ss: report(ss.connection()))


def _minute_window(
    conn: Connection, tenant_id: str, tier: str, now: datetime
) -> tuple[int, int, datetime | None]:
    """Requests, tokens (the reservation until a job finishes, its real count after) and
    the oldest admission of the tenant's online jobs over the last 60 s (sliding)."""
    tokens = func.coalesce(Job.prompt_tokens + Job.completion_tokens, Job.reserved_tokens)
    stmt = _scope(
        select(func.count(), func.coalesce(func.sum(tokens), 0), func.min(Job.created_at)).where(
            Job.tenant_id == tenant_id,
            Job.created_at >= now - timedelta(seconds=60),
            Job.batch_id.is_(None),
        ),
        Job.tier,
        tier,
    )
    count, used, oldest = conn.execute(stmt).one()
    return int(count), int(used), as_utc(oldest)


async def held_reservations(
    s: AsyncSession, tenant_id: str, tier: str, now: datetime
) -> tuple[int, Decimal]:
    """`held_in`, in an async session's transaction."""
    return await s.run_sync(lambda ss: held_in(ss.connection(), tenant_id, tier, now))


def held_in(conn: Connection, tenant_id: str, tier: str, now: datetime) -> tuple[int, Decimal]:
    """What the tenant's unfinished work holds against its budget: for every batch still
    expanding, the reservation of its lines not yet jobs; the reservation of each queued
    or running job (online or a batch's); and of each job cancelled while it ran whose
    usage the worker has not recorded yet, for BILLING_GRACE after the cancel (a worker
    bills nothing for a job that generated nothing, or that died with it)."""
    tokens, cost = 0, Decimal(0)
    if tier in (ALL_TIERS, Tier.BATCH.value):  # read first: see `figures`
        held = select(Batch.reserved_tokens, Batch.reserved_cost).where(
            Batch.tenant_id == tenant_id, Batch.status.in_(EXPANDING)
        )
        for batch_tokens, batch_cost in conn.execute(held).all():
            tokens += int(batch_tokens)
            cost += batch_cost
    # Queued and running jobs, from their running sums (kept by triggers on jobs): a few
    # rows per tier and pair of prices, however long the backlog. The sums are exact
    # (integers), and a job's most cost is linear in them (`reservation_cost`).
    kept = _scope(
        select(
            HeldReservation.input_price,
            HeldReservation.output_price,
            func.sum(HeldReservation.reserved_tokens),
            func.sum(HeldReservation.prompt_tokens),
            func.sum(HeldReservation.output_tokens),
        )
        .where(HeldReservation.tenant_id == tenant_id)
        .group_by(HeldReservation.input_price, HeldReservation.output_price),
        HeldReservation.tier,
        tier,
    )
    # Jobs cancelled while they ran, within the grace (ix_jobs_unbilled_cancel).
    bound = _output_bound(Job.params)
    prompt = case((Job.reserved_tokens > bound, Job.reserved_tokens - bound), else_=0)
    cancelled = (
        select(
            Job.input_price,
            Job.output_price,
            func.sum(Job.reserved_tokens),
            func.sum(prompt),
            func.sum(bound),
        )
        .where(
            Job.tenant_id == tenant_id,
            text(UNBILLED_CANCEL),
            Job.finished_at > now - BILLING_GRACE,
        )
        .group_by(Job.input_price, Job.output_price)
    )
    rows = [*conn.execute(kept).all(), *conn.execute(_scope(cancelled, Job.tier, tier)).all()]
    for price_in, price_out, reserved, prompt_tokens, output_tokens in rows:
        # A price is a Decimal from jobs, its string ("" for none) from the sums.
        tokens += int(reserved)
        cost += cost_of(
            int(prompt_tokens),
            int(output_tokens),
            Decimal(price_in) if price_in else Decimal(0),
            Decimal(price_out) if price_out else Decimal(0),
        )
    return tokens, cost


def _output_bound(params: Any) -> Any:
    """`messages.output_bound` in SQL: max_tokens (0 without) for each of n choices (1 when
    n is absent or 0), read from a job's params."""
    choices = params["n"].as_integer()
    return func.coalesce(params["max_tokens"].as_integer(), 0) * case(
        (func.coalesce(choices, 0) == 0, 1), else_=choices
    )


def reservation_cost(
    reserved_tokens: int, max_tokens: int, price_in: Decimal | None, price_out: Decimal | None
) -> Decimal:
    """The most a job can cost: its estimated prompt at the input price, max_tokens at the
    output price."""
    prompt = max(0, reserved_tokens - max_tokens)
    return cost_of(prompt, max_tokens, price_in or Decimal(0), price_out or Decimal(0))
