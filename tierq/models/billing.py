"""The usage ledger and invoices: every SQL statement about them.

The ledger is `usage_records`, one row per finished job (its primary key is the job id,
so a job delivered twice is recorded once), with the tokens the engine reported, the
prices the job was admitted under and the cost, all exact Decimals.

Reports and invoices are sums the database takes (COUNT and SUM ... GROUP BY): a range
of a million records answers in one small result, and the event loop only awaits it.
Money is a decimal string (models.tables.Money), summed exactly on both backends:
PostgreSQL casts it to `numeric`; SQLite has no exact decimal type, so each amount is
split in SQL into its exponent and its digits in 9-digit integer chunks, the chunks are
summed per group and exponent, and Python puts the few sums back together in Decimal.
Either way a total is the Decimal that adding the records one by one (from Decimal(0))
would give — the same digits, the same trailing zeros — only never rounded to 28 digits.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Context, Decimal, localcontext
from typing import Any

from sqlalchemy import (
    Date,
    Integer,
    Numeric,
    Select,
    String,
    case,
    cast,
    delete,
    func,
    insert,
    literal_column,
    select,
    text,
    type_coerce,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement, Label

from tierq.core.ids import new_id
from tierq.models.db import Database
from tierq.models.records import unix
from tierq.models.tables import Invoice, UsageDay, UsageHour, UsageRecord, utcnow
from tierq.models.usage_days import hour_of

GROUPS = ("day", "tier", "model")

# Adding a few group sums never rounds: they are exact however many digits they take.
_EXACT = Context(prec=200)
# SQLite: a Money string (at most 40 characters) holds at most 39 digits, summed as
# 9-digit chunks: a chunk's sum stays far inside 64 bits for billions of records.
_CHUNK = 9
_CHUNKS = -(-40 // _CHUNK)


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: Decimal = Decimal(0)

    def add(self, other: Totals) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        with localcontext(_EXACT):
            self.cost += other.cost

    def to_api(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "cost": str(self.cost),
        }


def total(parts: Iterable[Totals]) -> Totals:
    t = Totals()
    for part in parts:
        t.add(part)
    return t


@dataclass(frozen=True)
class Usage:
    """A report: totals per group (sorted by its key, as `data` rows) and overall."""

    group_by: tuple[str, ...]
    groups: dict[tuple[str, ...], Totals]

    def data(self) -> list[dict[str, Any]]:
        return [
            {**dict(zip(self.group_by, key, strict=True)), **t.to_api()}
            for key, t in sorted(self.groups.items())
        ]

    def total(self) -> Totals:
        return total(self.groups.values())


# --- the sums, in SQL ----------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """What is summed: the records themselves (`usage_records`, one request each), or
    their day or hour sums (`usage_days`, `usage_hours`, models.usage_days), which hold
    the same columns."""

    table: type[UsageRecord] | type[UsageDay] | type[UsageHour]
    requests: ColumnElement[Any]  # a row's requests

    def key(self, name: str, dialect: str) -> ColumnElement[Any]:
        if name == "day":
            if self.table is UsageDay:
                return UsageDay.day.expression
            if self.table is UsageHour:  # YYYY-MM-DD of YYYY-MM-DDTHH
                return func.substr(UsageHour.hour, _literal(1), _literal(10))
            if dialect == "sqlite":  # the UTC date (SQLite holds UTC datetimes as text)
                return func.substr(
                    type_coerce(UsageRecord.created_at, String), _literal(1), _literal(10)
                )
            return cast(func.timezone(literal_column("'UTC'"), UsageRecord.created_at), Date)
        if name == "hour":  # the records' UTC hour, as the hour sums hold it
            if self.table is UsageHour:
                return UsageHour.hour.expression
            if self.table is not UsageRecord:
                raise ValueError("the day sums hold no hour")
            if dialect == "sqlite":  # 'YYYY-MM-DD HH:MM:SS...' of a UTC datetime
                return func.replace(
                    func.substr(
                        type_coerce(UsageRecord.created_at, String), _literal(1), _literal(13)
                    ),
                    _literal(" "),
                    _literal("T"),
                )
            return func.to_char(
                func.timezone(literal_column("'UTC'"), UsageRecord.created_at),
                literal_column("'YYYY-MM-DD\"T\"HH24'"),
            )
        column = {"tenant": "tenant_id", "tier": "tier", "model": "model"}[name]
        return getattr(self.table, column).expression

    def within(
        self, tenant_id: str | None, start: datetime | date | None, end: datetime | date | None
    ) -> list[ColumnElement[bool]]:
        """The rows of one tenant (or all) in [start, end): instants for the records, days
        for the day sums, hours (whole: instants on the hour) for the hour sums."""
        where: list[ColumnElement[bool]] = []
        if tenant_id is not None:
            where.append(self.table.tenant_id == tenant_id)
        if self.table is UsageDay:
            if start is not None:
                where.append(UsageDay.day >= start.isoformat())
            if end is not None:
                where.append(UsageDay.day < end.isoformat())
            return where
        if self.table is UsageHour:
            if isinstance(start, datetime):
                where.append(UsageHour.hour >= hour_of(start))
            if isinstance(end, datetime):
                where.append(UsageHour.hour < hour_of(end))
            return where
        if start is not None:
            where.append(UsageRecord.created_at >= start)
        if end is not None:
            where.append(UsageRecord.created_at < end)
        return where


_RECORDS = _Source(UsageRecord, literal_column("1"))
_DAYS = _Source(UsageDay, UsageDay.requests.expression)
_HOURS = _Source(UsageHour, UsageHour.requests.expression)


def _key_value(name: str, value: Any) -> str:
    if name == "day":  # YYYY-MM-DD, four-digit years (as the day sums hold it)
        day = date.fromisoformat(value) if isinstance(value, str) else value
        return str(day.isoformat())
    if name == "hour":  # YYYY-MM-DDTHH, four-digit years (as the hour sums hold it)
        day, _, hour = str(value).partition("T")
        return f"{date.fromisoformat(day).isoformat()}T{int(hour):02d}"
    return str(value)


def _literal(value: int | str) -> ColumnElement[Any]:
    """A constant written into the statement: the same expression in the select list and
    the GROUP BY is then the same text, and no parameter is bound per use."""
    return literal_column(repr(value) if isinstance(value, str) else str(value))


class _PostgresSums:
    """SUM of the amounts as `numeric`: exact, and its scale is the largest one summed."""

    @staticmethod
    def statement(
        source: _Source, keys: list[Label[Any]], where: list[ColumnElement[bool]]
    ) -> Select[Any]:
        table = source.table
        return (
            select(
                *keys,
                func.sum(source.requests),
                func.sum(table.prompt_tokens),
                func.sum(table.completion_tokens),
                func.sum(cast(type_coerce(table.cost, String), Numeric)),
            )
            .where(*where)
            .group_by(*keys)
        )

    @staticmethod
    def cost(parts: Sequence[Any]) -> Decimal:
        with localcontext(_EXACT):
            return Decimal(0) + (parts[0] if parts[0] is not None else Decimal(0))


class _SqliteSums:
    """An amount as `str(Decimal)` writes it — `[-]digits[.digits][E[+|-]digits]` — is
    sign x digits x 10**exponent. The rows are first counted per key and amount (a
    ledger holds far fewer distinct amounts than records, and this is the cheap part),
    then each distinct amount is taken apart once: grouped by exponent, its digits
    summed as 9-digit integer chunks, times its count."""

    @staticmethod
    def statement(
        source: _Source, keys: list[Label[Any]], where: list[ColumnElement[bool]]
    ) -> Select[Any]:
        table = source.table
        amount = type_coerce(table.cost, String).label("amount")
        per_amount = (
            select(
                *keys,
                amount,
                func.count().label("n"),
                func.sum(source.requests).label("requests"),
                func.sum(table.prompt_tokens).label("prompt_tokens"),
                func.sum(table.completion_tokens).label("completion_tokens"),
            )
            .where(*where)
            .group_by(*keys, amount)
            .subquery()
        )
        text = per_amount.c.amount
        e_at = func.instr(text, _literal("E"))
        mantissa = case(
            (e_at > _literal(0), func.substr(text, _literal(1), e_at - _literal(1))), else_=text
        )
        power = case(
            (e_at > _literal(0), cast(func.substr(text, e_at + _literal(1)), Integer)),
            else_=_literal(0),
        )
        point = func.instr(mantissa, _literal("."))
        scale = case((point > _literal(0), func.length(mantissa) - point), else_=_literal(0))
        digits = func.replace(
            func.replace(mantissa, _literal("-"), _literal("")), _literal("."), _literal("")
        )
        signed = per_amount.c.n * case(
            (func.substr(text, _literal(1), _literal(1)) == _literal("-"), _literal(-1)),
            else_=_literal(1),
        )
        exponent = power - scale
        outer_keys = [per_amount.c[k.name] for k in keys]
        # substr() from the right: chunk k holds the digits k*9+1 .. k*9+9 from the end
        # ('' past the start of a short number, and CAST('' AS INTEGER) is 0).
        chunks = [
            func.sum(
                signed
                * cast(func.substr(digits, _literal(-_CHUNK * (k + 1)), _literal(_CHUNK)), Integer)
            )
            for k in range(_CHUNKS)
        ]
        return select(
            *outer_keys,
            func.sum(per_amount.c.requests),
            func.sum(per_amount.c.prompt_tokens),
            func.sum(per_amount.c.completion_tokens),
            exponent,
            *chunks,
        ).group_by(*outer_keys, exponent)

    @staticmethod
    def cost(parts: Sequence[Any]) -> Decimal:
        exponent, *chunks = parts
        with localcontext(_EXACT):
            # Decimal(0).scaleb(e) is 0 with exponent e: the sum keeps every trailing zero.
            return Decimal(0) + sum(
                (Decimal(int(c or 0)).scaleb(_CHUNK * k + exponent) for k, c in enumerate(chunks)),
                Decimal(0),
            )


async def _sum_into(
    out: dict[tuple[str, ...], Totals],
    s: AsyncSession,
    source: _Source,
    by: tuple[str, ...],
    where: list[ColumnElement[bool]],
) -> None:
    dialect = s.get_bind().dialect.name
    keys = [source.key(name, dialect).label(f"key_{i}") for i, name in enumerate(by)]
    n = len(by)
    if dialect == "sqlite" and source is not _RECORDS:
        # A day's (an hour's) sum may hold more digits than the chunks take (its string
        # has no length): the few rows are added here, in Decimal.
        table = source.table
        stmt = select(
            *keys, source.requests, table.prompt_tokens, table.completion_tokens, table.cost
        ).where(*where)
        for row in (await s.execute(stmt)).all():
            key = tuple(_key_value(name, v) for name, v in zip(by, row[:n], strict=True))
            out[key].add(Totals(int(row[n]), int(row[n + 1]), int(row[n + 2]), row[n + 3]))
        return
    sums = _SqliteSums if dialect == "sqlite" else _PostgresSums
    for row in (await s.execute(sums.statement(source, keys, where))).all():
        key = tuple(_key_value(name, v) for name, v in zip(by, row[:n], strict=True))
        requests, prompt_tokens, completion_tokens = row[n : n + 3]
        # A key of several rows (on SQLite, one per exponent; a day's sums and the
        # records of a part of a day) adds up exactly.
        out[key].add(
            Totals(
                int(requests),
                int(prompt_tokens or 0),
                int(completion_tokens or 0),
                sums.cost(row[n + 3 :]),
            )
        )


def _whole_days(start: datetime | None, end: datetime | None) -> tuple[date | None, date | None]:
    """The UTC days [first, last) that lie wholly inside [start, end) (None: unbounded)."""
    first = last = None
    if start is not None:
        start = start.astimezone(UTC)
        if start != _midnight(start.date()) and start.date() == date.max:
            # Past the calendar's last midnight: no whole day (the records are summed).
            return date.max, date.max
        first = start.date() + timedelta(days=start != _midnight(start.date()))
    if end is not None:
        last = end.astimezone(UTC).date()
    return first, last


def _midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def _whole_hours(start: datetime, end: datetime) -> tuple[datetime, datetime] | None:
    """The UTC hours [first, last) that lie wholly inside [start, end), or None."""
    start, end = start.astimezone(UTC), end.astimezone(UTC)
    first = start.replace(minute=0, second=0, microsecond=0)
    if first != start:
        try:
            first += timedelta(hours=1)
        except OverflowError:  # inside the calendar's last hour: no whole hour follows
            return None
    last = end.replace(minute=0, second=0, microsecond=0)
    return (first, last) if first < last else None


async def _part_of_days(
    out: dict[tuple[str, ...], Totals],
    s: AsyncSession,
    by: tuple[str, ...],
    tenant_id: str | None,
    start: datetime,
    end: datetime,
) -> None:
    """[start, end), no whole day: its whole hours from their sums, the records of the
    parts of an hour at either end."""
    hours = _whole_hours(start, end)
    if hours is None:
        await _sum_into(out, s, _RECORDS, by, _RECORDS.within(tenant_id, start, end))
        return
    first, last = hours
    await _sum_into(out, s, _HOURS, by, _HOURS.within(tenant_id, first, last))
    if start < first:
        await _sum_into(out, s, _RECORDS, by, _RECORDS.within(tenant_id, start, first))
    if last < end:
        await _sum_into(out, s, _RECORDS, by, _RECORDS.within(tenant_id, last, end))


async def _sums(
    s: AsyncSession,
    by: tuple[str, ...],
    tenant_id: str | None,
    start: datetime | None,
    end: datetime | None,
) -> dict[tuple[str, ...], Totals]:
    """Totals of the records in [start, end) (of one tenant, or all), per key of `by`:
    the whole UTC days inside the range from their day sums, the whole hours of the parts
    of a day at either end from their hour sums, and the parts of an hour at either end
    from the records. The sums are written with their records, in one transaction, so
    they always agree; a report costs a few rows per day and per edge hour plus at most
    two partial hours of records, however long the ledger (none where its bounds fall on
    the hour)."""
    out: dict[tuple[str, ...], Totals] = defaultdict(Totals)
    first, last = _whole_days(start, end)
    if first is not None and last is not None and first >= last:  # inside one or two days
        if start is None or end is None:  # inside the calendar's last day: its records
            await _sum_into(out, s, _RECORDS, by, _RECORDS.within(tenant_id, start, end))
        else:
            await _part_of_days(out, s, by, tenant_id, start, end)
        return dict(out)
    await _sum_into(out, s, _DAYS, by, _DAYS.within(tenant_id, first, last))
    if start is not None and first is not None and start < _midnight(first):
        await _part_of_days(out, s, by, tenant_id, start, _midnight(first))
    if end is not None and last is not None and _midnight(last) < end:
        await _part_of_days(out, s, by, tenant_id, _midnight(last), end)
    return dict(out)


async def rebuild_days(s: AsyncSession, tenant_id: str | None) -> int:
    """Recompute the day and hour sums (of one tenant, or all) from the records, after
    records were loaded around the application (an import, a repair); returns the day rows
    written. On PostgreSQL the tables are locked first (days, then hours: a job's ending
    order): job endings wait until it commits, and every record committed before the lock
    is summed, every one after adds itself."""
    if s.get_bind().dialect.name == "postgresql":
        # Not waiting long behind an open ending: every ending queues behind the request.
        await s.execute(text("SET LOCAL lock_timeout = '10s'"))
        await s.execute(text("LOCK TABLE usage_days IN EXCLUSIVE MODE"))
        await s.execute(text("LOCK TABLE usage_hours IN EXCLUSIVE MODE"))
    written = 0
    for table, period in ((UsageDay, "day"), (UsageHour, "hour")):
        gone = delete(table)
        if tenant_id is not None:
            gone = gone.where(table.tenant_id == tenant_id)
        await s.execute(gone)
        sums: dict[tuple[str, ...], Totals] = defaultdict(Totals)
        by = ("tenant", period, "tier", "model")
        await _sum_into(sums, s, _RECORDS, by, _RECORDS.within(tenant_id, None, None))
        rows = [
            {
                "tenant_id": tenant,
                period: when,
                "tier": tier,
                "model": model,
                "requests": t.requests,
                "prompt_tokens": t.prompt_tokens,
                "completion_tokens": t.completion_tokens,
                "cost": t.cost,
            }
            for (tenant, when, tier, model), t in sums.items()
        ]
        for at in range(0, len(rows), 1000):
            await s.execute(insert(table), rows[at : at + 1000])
        if table is UsageDay:
            written = len(rows)
    return written


async def usage(
    s: AsyncSession,
    tenant_id: str,
    start: datetime | None,
    end: datetime | None,
    group_by: tuple[str, ...],
) -> Usage:
    """A tenant's usage over [start, end), per `group_by` (some of GROUPS)."""
    if not set(group_by) <= set(GROUPS):
        raise ValueError(f"group_by takes some of {GROUPS}, not {group_by}")
    return Usage(group_by, await _sums(s, group_by, tenant_id, start, end))


# --- invoices ------------------------------------------------------------------------


def month_bounds(period: str) -> tuple[datetime, datetime]:
    year, month = (int(x) for x in period.split("-"))
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
    return start, end


@dataclass(frozen=True)
class MonthUsage:
    """Every tenant's usage over one month, per tier and model: what its invoice holds."""

    period: str
    lines: dict[str, Usage] = field(default_factory=dict)  # by tenant id


async def month_usage(s: AsyncSession, period: str) -> MonthUsage:
    """One aggregate over the month's records, grouped by tenant, tier and model (it
    reads only, so it may run in a read session, outside the invoices' transaction)."""
    start, end = month_bounds(period)
    per_tenant: dict[str, dict[tuple[str, ...], Totals]] = defaultdict(dict)
    for (tenant_id, tier, model), t in (
        await _sums(s, ("tenant", "tier", "model"), None, start, end)
    ).items():
        per_tenant[tenant_id][(tier, model)] = t
    return MonthUsage(
        period,
        {tenant_id: Usage(("tier", "model"), groups) for tenant_id, groups in per_tenant.items()},
    )


async def write_invoices(s: AsyncSession, month: MonthUsage) -> list[str]:
    """Write (or rewrite) each tenant's invoice for the month from its usage; writing
    the same usage twice changes nothing. Returns the tenant ids invoiced."""
    period = month.period
    existing = {
        inv.tenant_id: inv
        for inv in (await s.execute(select(Invoice).where(Invoice.period == period))).scalars()
    }
    for tenant_id, used in month.lines.items():
        t = used.total()
        lines = used.data()
        inv = existing.get(tenant_id)
        if inv is None:
            inv = Invoice(id=new_id("inv"), tenant_id=tenant_id, period=period)
            s.add(inv)
        elif (
            inv.requests == t.requests
            and inv.prompt_tokens == t.prompt_tokens
            and inv.completion_tokens == t.completion_tokens
            and inv.cost == t.cost
            and inv.lines == lines
        ):
            continue  # unchanged: not even its updated_at moves
        inv.requests = t.requests
        inv.prompt_tokens = t.prompt_tokens
        inv.completion_tokens = t.completion_tokens
        inv.cost = t.cost
        inv.lines = lines
        inv.updated_at = utcnow()
    await s.flush()
    return sorted(month.lines)


async def roll_up(s: AsyncSession, period: str) -> list[str]:
    """Write (or rewrite) every tenant's invoice for the month from the ledger, in one
    session; running it twice changes nothing. Returns the tenant ids invoiced."""
    return await write_invoices(s, await month_usage(s, period))


async def roll_up_month(db: Database, period: str) -> list[str]:
    """`roll_up` as beat and the admin API run it, however many at once. On PostgreSQL
    under a transaction-scoped advisory lock per month, the sums read inside it: two
    roll-ups of one month (beat's and an operator's) take turns, so the older sums are
    never written last. On SQLite the sums are read before the writing transaction (it
    holds the file's one write lock, which every job's ending waits for); its one process
    of each kind makes overlapping roll-ups rare, and the next one corrects them."""
    if db.dialect != "postgresql":
        async with db.session() as s:
            usage = await month_usage(s, period)
        async with db.transaction() as s:
            return await write_invoices(s, usage)
    async with db.transaction() as s:
        await s.execute(
            text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": f"invoices:{period}"}
        )
        return await roll_up(s, period)


def invoice_to_api(inv: Invoice) -> dict[str, Any]:
    return {
        "id": inv.id,
        "object": "invoice",
        "tenant_id": inv.tenant_id,
        "period": inv.period,
        "requests": inv.requests,
        "prompt_tokens": inv.prompt_tokens,
        "completion_tokens": inv.completion_tokens,
        "cost": str(inv.cost),
        "lines": inv.lines,
        "updated_at": unix(inv.updated_at),
    }


async def invoices(
    s: AsyncSession, tenant_id: str | None, period: str | None
) -> list[dict[str, Any]]:
    stmt = select(Invoice)
    if tenant_id is not None:
        stmt = stmt.where(Invoice.tenant_id == tenant_id)
    if period is not None:
        stmt = stmt.where(Invoice.period == period)
    stmt = stmt.order_by(Invoice.period, Invoice.tenant_id)
    return [invoice_to_api(inv) for inv in (await s.execute(stmt)).scalars()]
