"""models.billing's sums on SQLite, which has no exact decimal type: amounts are split into
exponent and 9-digit chunks in SQL and put back together in Decimal. Records are written as
a job's ending writes them (with their day's and hour's sums, models.usage_days), and a
report over any range is its whole days' sums, the whole hours' sums of the partial days at
its ends and the records of the partial hours. Whatever the amounts (scales from 0 to 30
places, exponent notation, many digits, negative corrections) and the bounds (none, on
midnight, on the hour, inside an hour, inside one day), the report's cost is the
Decimal that adding the range's records one by one gives — the same digits and the same
trailing zeros — and the counts and tokens are the records'."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Context, Decimal, localcontext

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from tierq.models import billing, usage_days
from tierq.models.tables import Base, UsageRecord

DAY0 = datetime(2026, 11, 30, 22, tzinfo=UTC)
AMOUNTS = st.one_of(
    st.decimals(min_value=0, max_value=10**6, places=6),
    st.decimals(min_value=-100, max_value=100, places=30),
    st.integers(min_value=0, max_value=10**30).map(Decimal),
    # exponent notation, as str(Decimal) writes tiny and scaled amounts
    st.tuples(st.integers(0, 999_999_999_999), st.integers(-40, 10)).map(
        lambda p: Decimal(p[0]).scaleb(p[1])
    ),
).filter(lambda d: d.is_finite() and len(str(d)) <= 40)
RECORD = st.tuples(
    AMOUNTS,
    st.sampled_from(["batch", "standard", "interactive"]),
    st.sampled_from(["m1", "m2"]),
    st.integers(0, 47 * 60),  # minutes after DAY0: three UTC days
    st.integers(0, 5000),
    st.integers(0, 5000),
)
# A bound, in minutes after DAY0 (None: unbounded): on a record, on midnight, on the hour,
# anywhere.
BOUND = st.one_of(
    st.none(),
    st.integers(-60, 49 * 60),
    st.sampled_from([120, 120 + 24 * 60]),
    st.integers(-1, 49).map(lambda h: h * 60),
)


def _exact_sum(amounts: list[Decimal]) -> Decimal:
    with localcontext(Context(prec=200)):
        total = Decimal(0)
        for a in amounts:
            total += a
        return total


async def _report(
    records: list[tuple[Decimal, str, str, int, int, int]],
    group_by: tuple[str, ...],
    start: datetime | None,
    end: datetime | None,
) -> billing.Usage:
    rows = [
        UsageRecord(
            job_id=f"job_{i}",
            tenant_id="ten_a" if i % 5 else "ten_b",  # another tenant's, left out
            tier=tier,
            model=model,
            prompt_tokens=p,
            completion_tokens=c,
            cost=cost,
            created_at=DAY0 + timedelta(minutes=minute),
        )
        for i, (cost, tier, model, minute, p, c) in enumerate(records)
    ]
    return await _written_then_reported(rows, group_by, start, end)


@contextlib.asynccontextmanager
async def _ledger(rows: list[UsageRecord]) -> AsyncIterator[AsyncSession]:
    """A session of a new SQLite ledger, the records written as a job's ending writes them
    (with their day's and hour's sums) and committed."""
    engine = create_async_engine("sqlite+aiosqlite://")
    try:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        sessions = async_sessionmaker(engine, class_=AsyncSession, expire_on_commit=False)
        async with sessions() as s:
            for record in rows:
                s.add(record)
                await s.run_sync(lambda sync, r=record: usage_days.add(sync, r))  # type: ignore[misc]
            await s.commit()
            yield s
    finally:
        await engine.dispose()


async def _written_then_reported(
    rows: list[UsageRecord],
    group_by: tuple[str, ...],
    start: datetime | None,
    end: datetime | None,
) -> billing.Usage:
    """`ten_a`'s report after the records are written as a job's ending writes them."""
    async with _ledger(rows) as s:
        return await billing.usage(s, "ten_a", start, end, group_by)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(  # one day's sum of more digits than a record's amount can hold
    [
        (Decimal(1), "batch", "m1", 62, 1, 1),  # the first record is the other tenant's
        (Decimal(10**30 + 7), "batch", "m1", 60, 1, 1),
        (Decimal("1E-30"), "batch", "m1", 61, 1, 1),
    ],
    ("day",),
    None,
    None,
)
@given(
    st.lists(RECORD, max_size=40),
    st.sampled_from([("day",), ("tier", "model"), ("model", "day")]),
    BOUND,
    BOUND,
)
def test_sqlite_sums_are_the_records_added_one_by_one(
    records: list[tuple[Decimal, str, str, int, int, int]],
    group_by: tuple[str, ...],
    start_minute: int | None,
    end_minute: int | None,
) -> None:
    start, end = (
        None if m is None else DAY0 + timedelta(minutes=m) for m in (start_minute, end_minute)
    )
    used = asyncio.run(_report(records, group_by, start, end))
    mine = [
        r
        for i, r in enumerate(records)
        if i % 5
        and (start is None or DAY0 + timedelta(minutes=r[3]) >= start)
        and (end is None or DAY0 + timedelta(minutes=r[3]) < end)
    ]
    groups: dict[tuple[str, ...], list[tuple[Decimal, str, str, int, int, int]]] = defaultdict(list)
    for r in mine:
        key = {
            "day": (DAY0 + timedelta(minutes=r[3])).strftime("%Y-%m-%d"),
            "tier": r[1],
            "model": r[2],
        }
        groups[tuple(key[g] for g in group_by)].append(r)
    assert set(used.groups) == set(groups)
    for key, rows in groups.items():
        got = used.groups[key]
        expected = _exact_sum([r[0] for r in rows])
        assert (str(got.cost), got.requests) == (str(expected), len(rows)), key
        assert got.prompt_tokens == sum(r[4] for r in rows)
        assert got.completion_tokens == sum(r[5] for r in rows)


def test_bounds_at_the_calendars_ends() -> None:
    """A range starting inside the calendar's last day (no midnight follows it) or ending
    inside its first one is summed from the records: no date past the calendar is made."""

    async def report(at: datetime, start: datetime | None, end: datetime | None) -> int:
        record = UsageRecord(
            job_id="job_edge",
            tenant_id="ten_a",
            tier="batch",
            model="m1",
            prompt_tokens=1,
            completion_tokens=1,
            cost=Decimal("0.5"),
            created_at=at,
        )
        return (await _written_then_reported([record], ("day",), start, end)).total().requests

    last_day = datetime(9999, 12, 31, 12, 30, tzinfo=UTC)
    noon = datetime(9999, 12, 31, 12, tzinfo=UTC)
    assert asyncio.run(report(last_day, noon, None)) == 1
    assert asyncio.run(report(last_day, noon, datetime(9999, 12, 31, 13, tzinfo=UTC))) == 1
    first_day = datetime(1, 1, 1, 3, tzinfo=UTC)
    assert asyncio.run(report(first_day, None, datetime(1, 1, 1, 5, tzinfo=UTC))) == 1
    assert asyncio.run(report(first_day, datetime(1, 1, 1, 4, tzinfo=UTC), None)) == 0
    last_hour = datetime(9999, 12, 31, 23, 45, tzinfo=UTC)
    half_past = datetime(9999, 12, 31, 23, 30, tzinfo=UTC)
    assert asyncio.run(report(last_hour, half_past, None)) == 1  # no hour follows it


def test_a_bound_on_the_hour_reads_that_days_hours_from_their_sums() -> None:
    """A range from mid-day to mid-day on the hour reads no record: the records of its edge
    days' whole hours are taken from the hour sums (here, shown by deleting the records
    behind the sums' back), and a rebuild makes the sums the records again."""
    from sqlalchemy import delete

    async def run() -> tuple[int, int, int]:
        rows = [  # one record every half hour over a day
            UsageRecord(
                job_id=f"job_{i}",
                tenant_id="ten_a",
                tier="batch",
                model="m1",
                prompt_tokens=1,
                completion_tokens=1,
                cost=Decimal("0.25"),
                created_at=datetime(2026, 12, 1, tzinfo=UTC) + timedelta(minutes=30 * i),
            )
            for i in range(48)
        ]
        async with _ledger(rows) as s:
            start = datetime(2026, 12, 1, 6, tzinfo=UTC)
            end = datetime(2026, 12, 1, 18, tzinfo=UTC)
            before = (await billing.usage(s, "ten_a", start, end, ())).total().requests
            await s.execute(delete(UsageRecord))
            await s.commit()
            kept = (await billing.usage(s, "ten_a", start, end, ())).total().requests
            await billing.rebuild_days(s, "ten_a")
            await s.commit()
            rebuilt = (await billing.usage(s, "ten_a", start, end, ())).total().requests
            return before, kept, rebuilt

    assert asyncio.run(run()) == (24, 24, 0)
