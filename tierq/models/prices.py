"""Prices per model and tier: every SQL statement about them. A change is a new row
effective from now; jobs keep the price they were admitted under (copied onto the job)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Protocol

from sqlalchemy import ColumnElement, Select, select
from sqlalchemy.ext.asyncio import AsyncSession

from tierq.core.tiers import Tier
from tierq.models.records import as_utc, unix
from tierq.models.tables import Price, utcnow

# Prices are per million tokens.
MILLION = Decimal(1_000_000)


def cost_of(
    prompt_tokens: int, completion_tokens: int, price_in: Decimal, price_out: Decimal
) -> Decimal:
    """Exact: prices are per million tokens, and Decimal keeps every digit."""
    return (Decimal(prompt_tokens) * price_in + Decimal(completion_tokens) * price_out) / MILLION


@dataclass(frozen=True)
class PriceRecord:
    model: str
    tier: str
    input_per_million: Decimal
    output_per_million: Decimal
    effective_at: datetime | None
    derived: bool = False  # the batch tier's price from the standard one and the discount

    def to_api(self) -> dict[str, Any]:
        return {
            "object": "price",
            "model": self.model,
            "tier": self.tier,
            "input_per_million": str(self.input_per_million),
            "output_per_million": str(self.output_per_million),
            "effective_at": unix(self.effective_at),
            "derived_from_standard": self.derived,
        }


FREE = (Decimal(0), Decimal(0))


async def set_price(
    s: AsyncSession, model: str, tier: str, input_per_million: Decimal, output_per_million: Decimal
) -> PriceRecord:
    row = Price(
        model=model,
        tier=tier,
        input_per_million=input_per_million,
        output_per_million=output_per_million,
        effective_at=utcnow(),
    )
    s.add(row)
    await s.flush()
    return PriceRecord(model, tier, input_per_million, output_per_million, as_utc(row.effective_at))


def latest_query(
    model: str | ColumnElement[str], tier: str | ColumnElement[str], as_of: datetime | None = None
) -> Select[Price]:
    """The tier's newest price (as of `as_of`, if given): one row or none. The model and the
    tier may be bound parameters (a statement built once: tierq/models/admission_sqlite.py)."""
    stmt = select(Price).where(Price.model == model, Price.tier == tier)
    if as_of is not None:
        stmt = stmt.where(Price.effective_at <= as_of)
    return stmt.order_by(Price.effective_at.desc(), Price.id.desc()).limit(1)


class PriceRow(Protocol):
    """A row of `prices`: the ORM's `Price`, or a row of `latest_query` read through Core."""

    @property
    def model(self) -> str: ...
    @property
    def tier(self) -> str: ...
    @property
    def input_per_million(self) -> Decimal: ...
    @property
    def output_per_million(self) -> Decimal: ...
    @property
    def effective_at(self) -> datetime: ...


def in_force(
    model: str,
    tier: Tier,
    own: PriceRow | None,
    standard: PriceRow | None,
    batch_discount: Decimal,
) -> PriceRecord | None:
    """The price in force from the tier's newest row (`own`) and, for the batch tier
    without one, the standard tier's (`standard`), less `batch_discount` (a fraction)."""
    if own is not None:
        return PriceRecord(
            own.model,
            own.tier,
            own.input_per_million,
            own.output_per_million,
            as_utc(own.effective_at),
        )
    if tier == Tier.BATCH and standard is not None:
        keep = Decimal(1) - batch_discount
        return PriceRecord(
            model,
            tier.value,
            standard.input_per_million * keep,
            standard.output_per_million * keep,
            as_utc(standard.effective_at),
            derived=True,
        )
    return None


async def current_price(
    s: AsyncSession,
    model: str,
    tier: Tier,
    batch_discount: Decimal,
    as_of: datetime | None = None,
) -> PriceRecord | None:
    """The price in force (at `as_of`, default now): `in_force`."""
    own = (await s.execute(latest_query(model, tier.value, as_of))).scalar_one_or_none()
    standard = None
    if own is None and tier == Tier.BATCH:
        query = latest_query(model, Tier.STANDARD.value, as_of)
        standard = (await s.execute(query)).scalar_one_or_none()
    return in_force(model, tier, own, standard, batch_discount)


async def current_prices(s: AsyncSession) -> list[PriceRecord]:
    rows = list((await s.execute(select(Price).order_by(Price.effective_at, Price.id))).scalars())
    latest: dict[tuple[str, str], Price] = {}
    for row in rows:
        latest[(row.model, row.tier)] = row
    return [
        PriceRecord(
            r.model, r.tier, r.input_per_million, r.output_per_million, as_utc(r.effective_at)
        )
        for r in sorted(latest.values(), key=lambda r: (r.model, r.tier))
    ]
