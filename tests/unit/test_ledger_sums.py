"""models.billing's sums on SQLite, which has no exact decimal type: amounts are split into
exponent and 9-digit chunks in SQL and put back together in Decimal. Whatever the amounts
(scales from 0 to 30 places, exponent notation, many digits, negative corrections), the
report's cost is the Decimal that adding the records one by one gives — the same digits
and the same trailing zeros — and the counts and tokens are the records'."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Context, Decimal, localcontext

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from models import billing
from models.tables import Base, UsageRecord

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
    st.integers(0, 47),  # hours after DAY0: three UTC days
    st.integers(0, 5000),
    st.integers(0, 5000),
)


def _exact_sum(amounts: list[Decimal]) -> Decimal:
    with localcontext(Context(prec=200)):
        total = Decimal(0)
        for a in amounts:
            total += a
        return total


async def _report(
    records: list[tuple[Decimal, str, str, int, int, int]], group_by: tuple[str, ...]
) -> billing.Usage:
    engine = create_async_engine("sqlite+aiosqlite://")
    try:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        sessions = async_sessionmaker(engine, class_=AsyncSession, expire_on_commit=False)
        async with sessions() as s:
            for i, (cost, tier, model, hour, p, c) in enumerate(records):
                s.add(
                    UsageRecord(
                        job_id=f"job_{i}",
                        tenant_id="ten_a" if i % 5 else "ten_b",  # another tenant's, left out
                        tier=tier,
                        model=model,
                        prompt_tokens=p,
                        completion_tokens=c,
                        cost=cost,
                        created_at=DAY0 + timedelta(hours=hour),
                    )
                )
            await s.commit()
            return await billing.usage(s, "ten_a", None, None, group_by)
    finally:
        await engine.dispose()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(RECORD, max_size=40), st.sampled_from([("day",), ("tier", "model"), ("model", "day")])
)
def test_sqlite_sums_are_the_records_added_one_by_one(
    records: list[tuple[Decimal, str, str, int, int, int]], group_by: tuple[str, ...]
) -> None:
    used = asyncio.run(_report(records, group_by))
    mine = [r for i, r in enumerate(records) if i % 5]
    groups: dict[tuple[str, ...], list[tuple[Decimal, str, str, int, int, int]]] = defaultdict(list)
    for r in mine:
        key = {
            "day": (DAY0 + timedelta(hours=r[3])).strftime("%Y-%m-%d"),
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
    total = used.total()
    assert str(total.cost) == str(_exact_sum([r[0] for r in mine]))
    assert total.requests == len(mine)
