"""ORM tables. Alembic's migrations create exactly these (a test compares them)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    event,
    false,
    text,
)
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from tierq.core import clock
from tierq.core.tiers import DEFAULT_TIER, TIER_ORDER


def utcnow() -> datetime:
    """Now, on the deployment's one clock (tierq.core.clock): every time stored is comparable."""
    return clock.utcnow()


class Money(TypeDecorator[Decimal]):
    """An exact decimal amount, stored as its string: no float ever touches money, on
    PostgreSQL or SQLite alike (models.billing sums it exactly on both)."""

    impl = String(40)
    cache_ok = True

    def process_bind_param(self, value: Decimal | None, dialect: Dialect) -> str | None:
        if value is None:
            return None
        if not isinstance(value, Decimal):
            raise TypeError(f"money must be a Decimal, not {type(value).__name__}")
        return str(value)

    def process_result_value(self, value: str | None, dialect: Dialect) -> Decimal | None:
        return None if value is None else Decimal(value)


class MoneySum(Money):
    """A sum of amounts: exact like Money, its string as long as its digits need."""

    impl = Text  # type: ignore[assignment]  # a wider string than Money's
    cache_ok = True


# A partial index's predicate, which a query repeats word for word (SQLite uses a partial
# index only for a query whose WHERE has its terms as written).
UNBILLED_CANCEL = "status = 'cancelled' AND started_at IS NOT NULL AND prompt_tokens IS NULL"


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    status: Mapped[str] = mapped_column(String(20), default="active")
    # The tiers the tenant may use, and the one used when a request names none.
    allowed_tiers: Mapped[list[Any]] = mapped_column(
        JSON, default=lambda: [t.value for t in TIER_ORDER]
    )
    default_tier: Mapped[str] = mapped_column(String(20), default=DEFAULT_TIER.value)
    weight: Mapped[float] = mapped_column(Float, default=1.0)  # its share within a tier
    # Its jobs are counted in held_reservations' sums (it has, or had, a budget): set
    # under its row lock, which admission holds while it reads it (models.quotas).
    counts_held: Mapped[bool] = mapped_column(Boolean, server_default=false())
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    # sha256 of the secret: keys are 256-bit random, so a fast hash is as safe as a slow one
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency"),
        Index("ix_jobs_tenant_created", "tenant_id", "created_at"),
        Index("ix_jobs_status_created", "status", "created_at"),
        # One job per line of a batch: expanding a batch twice cannot run a line twice.
        UniqueConstraint("batch_id", "batch_line", name="uq_jobs_batch_line"),
        Index("ix_jobs_batch_status", "batch_id", "status"),
        # A tenant's unfinished jobs, without scanning its history.
        Index("ix_jobs_tenant_status", "tenant_id", "status"),
        # Jobs cancelled while they ran, their usage not recorded yet: they hold their
        # reservation for a grace (models.quotas `held_in`), and only they are read.
        Index(
            "ix_jobs_unbilled_cancel",
            "tenant_id",
            "finished_at",
            postgresql_where=text(UNBILLED_CANCEL),
            sqlite_where=text(UNBILLED_CANCEL),
        ),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    tier: Mapped[str] = mapped_column(String(20))
    model: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20))
    messages: Mapped[list[Any] | None] = mapped_column(JSON)
    prompt: Mapped[str | None] = mapped_column(Text)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    result_text: Mapped[str | None] = mapped_column(Text)
    # With `logprobs` asked for: each generated token's, in OpenAI's chat shape
    # ({"token", "logprob", "bytes", "top_logprobs"}); the API renders each endpoint's.
    result_logprobs: Mapped[list[Any] | None] = mapped_column(JSON)
    # With `n` > 1: the choices after the first, [{"index", "text", "finish_reason",
    # "logprobs"}] in order (the first is result_text, finish_reason, result_logprobs).
    result_choices: Mapped[list[Any] | None] = mapped_column(JSON)
    finish_reason: Mapped[str | None] = mapped_column(String(40))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    error_code: Mapped[str | None] = mapped_column(String(60))
    error_message: Mapped[str | None] = mapped_column(Text)
    deliveries: Mapped[int] = mapped_column(Integer, default=0)
    # Deliveries that ended in a preemption (room made for interactive work): they do not
    # count towards MAX_DELIVERIES, whichever process enqueues the job next.
    preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The failed deliveries held against the job, in thousandths of one (tierq/models/jobs.py
    # `charge_for`): it is dead-lettered at MAX_DELIVERIES x 1000.
    fault_charge: Mapped[int] = mapped_column(Integer, server_default="0")
    # What the runs so far generated, kept when one stopped unfinished (preempted, handed
    # back): the next delivery resumes after it. Cleared when the job ends.
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    worker_id: Mapped[str | None] = mapped_column(String(200))
    # Set for the jobs a batch expands into: the batch, the input line (0-based), its custom_id.
    batch_id: Mapped[str | None] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE", name="fk_jobs_batch_id_batches")
    )
    # Admission: the tokens reserved against the tenant's quotas (prompt estimate plus
    # max_tokens; the real count replaces it once the job finishes) and the prices per
    # million tokens in force when it was admitted (the job keeps them).
    reserved_tokens: Mapped[int] = mapped_column(Integer, default=0)
    input_price: Mapped[Decimal | None] = mapped_column(Money)
    output_price: Mapped[Decimal | None] = mapped_column(Money)
    batch_line: Mapped[int | None] = mapped_column(Integer)
    # Whether held_reservations' sums count the job: every job of a tenant that
    # `counts_held`, and every job a batch expands into.
    held_counted: Mapped[bool] = mapped_column(Boolean, server_default=false())
    custom_id: Mapped[str | None] = mapped_column(String(512))


class JobTransition(Base):
    """The state history of every job: one row per status change."""

    __tablename__ = "job_transitions"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(String(20))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    detail: Mapped[str | None] = mapped_column(Text)


class UsageRecord(Base):
    """Tokens served for one finished job, written once (the job id is the key)."""

    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_tenant_created", "tenant_id", "created_at"),
        # Every tenant's records of a report's partial first and last days (admin reports).
        Index("ix_usage_created", "created_at"),
    )

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    tier: Mapped[str] = mapped_column(String(20))
    model: Mapped[str] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    input_price: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))  # per million
    output_price: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    cost: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class _LedgerSums:
    """What the ledger's day and hour sums share: per tenant, period (each table's own
    key: its `day` or `hour`), tier and model, the requests, tokens and cost summed. The
    sort orders keep the primary key's columns in the migrations' order."""

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True, sort_order=-4
    )
    tier: Mapped[str] = mapped_column(String(20), primary_key=True, sort_order=-2)
    model: Mapped[str] = mapped_column(String(200), primary_key=True, sort_order=-1)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost: Mapped[Decimal] = mapped_column(MoneySum, default=Decimal(0))


class UsageDay(_LedgerSums, Base):
    """The ledger summed per tenant, UTC day, tier and model, kept as usage records are
    written (in their transaction): a report's whole days and a month's invoice are read
    from here — a few rows a day however many records the day holds (models.billing)."""

    __tablename__ = "usage_days"
    __table_args__ = (Index("ix_usage_days_day", "day"),)  # every tenant's days: invoices

    day: Mapped[str] = mapped_column(String(10), primary_key=True, sort_order=-3)  # YYYY-MM-DD


class UsageHour(_LedgerSums, Base):
    """The ledger summed per tenant, UTC hour, tier and model, kept with the day sums (in
    the records' transaction): a report whose range starts or ends inside a day reads that
    day's whole hours from here and only the records of the hour its bound cuts."""

    __tablename__ = "usage_hours"

    hour: Mapped[str] = mapped_column(String(13), primary_key=True, sort_order=-3)  # YYYY-MM-DDTHH


class SpendCounter(Base):
    """What a tenant's ledger holds for one tier over one period — `day:YYYY-MM-DD`,
    `month:YYYY-MM` or `total` — kept as usage records are written (in their
    transaction), so admission reads a budget's spend in one small query, never by
    summing the ledger."""

    __tablename__ = "spend_counters"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    tier: Mapped[str] = mapped_column(String(20), primary_key=True)
    period_key: Mapped[str] = mapped_column(String(20), primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))


class HeldReservation(Base):
    """What a tenant's queued and running jobs of one tier and pair of prices hold against
    its budgets: their count, reserved tokens, the prompt part of those and their output
    bound (max_tokens for each of n choices), of the jobs marked `held_counted`. Kept by
    triggers on jobs, in the transaction that writes a job
    (tierq/migrations/sql/0017_held_reservations.*.sql), so a budget's check reads a few
    rows however long the tenant's backlog. A price is its string, "" for none. On
    PostgreSQL a key's sums are spread over up to 16 slots, each connection writing its own
    (one row would queue every writer of a tenant behind the others' commits); its sums
    are those of every slot, and one slot's may be below zero."""

    __tablename__ = "held_reservations"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    tier: Mapped[str] = mapped_column(String(20), primary_key=True)
    input_price: Mapped[str] = mapped_column(String(40), primary_key=True)
    output_price: Mapped[str] = mapped_column(String(40), primary_key=True)
    slot: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    jobs: Mapped[int] = mapped_column(BigInteger)
    reserved_tokens: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)


class File(Base):
    """An uploaded or generated file; its bytes live on the files volume, not in the database."""

    __tablename__ = "files"
    __table_args__ = (
        Index("ix_files_tenant_created", "tenant_id", "created_at"),
        Index("ix_files_expires_at", "expires_at"),  # the removal task's scan
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(40))
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Past this the file is gone from the API at once; Celery removes its row and bytes.
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Batch(Base):
    """An OpenAI-style batch: its status, timestamps, counts and the expansion cursor."""

    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_created", "tenant_id", "created_at"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(40))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(10))
    status: Mapped[str] = mapped_column(String(20))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    errors: Mapped[list[Any] | None] = mapped_column(JSON)
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    request_total: Mapped[int] = mapped_column(Integer, default=0)
    request_completed: Mapped[int] = mapped_column(Integer, default=0)
    request_failed: Mapped[int] = mapped_column(Integer, default=0)
    # Expansion cursor: the next input line to turn into a job, and its byte offset.
    next_line: Mapped[int] = mapped_column(Integer, default=0)
    next_offset: Mapped[int] = mapped_column(BigInteger, default=0)
    # What the lines not yet expanded reserve against the tenant's budgets: set for the
    # whole file when the batch starts, lowered as lines become jobs (which then hold
    # their own reservations), zero once the batch stops expanding.
    reserved_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    reserved_cost: Mapped[Decimal] = mapped_column(Money, default=Decimal(0), server_default="0")
    # The fencing token of the Celery worker advancing the batch (models.batches.fence).
    lease_fence: Mapped[int] = mapped_column(BigInteger, server_default="0")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Quota(Base):
    """A tenant's limits, for all its tiers (tier "*") or for one. None means no limit."""

    __tablename__ = "quotas"
    __table_args__ = (UniqueConstraint("tenant_id", "tier", name="uq_quotas_tenant_tier"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    tier: Mapped[str] = mapped_column(String(20), default="*")
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_running: Mapped[int | None] = mapped_column(Integer)
    max_queued: Mapped[int | None] = mapped_column(Integer)
    token_budget: Mapped[int | None] = mapped_column(BigInteger)
    spend_budget: Mapped[Decimal | None] = mapped_column(Money)
    budget_period: Mapped[str] = mapped_column(String(10), default="month")
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Price(Base):
    """Prices per million tokens of a model in a tier, from `effective_at` on (history kept)."""

    __tablename__ = "prices"
    __table_args__ = (Index("ix_prices_model_tier_effective", "model", "tier", "effective_at"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    model: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(20))
    input_per_million: Mapped[Decimal] = mapped_column(Money)
    output_per_million: Mapped[Decimal] = mapped_column(Money)
    effective_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Invoice(Base):
    """A tenant's usage over one calendar month, rolled up from the ledger (reproducibly)."""

    __tablename__ = "invoices"
    __table_args__ = (UniqueConstraint("tenant_id", "period", name="uq_invoices_tenant_period"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    period: Mapped[str] = mapped_column(String(7))  # YYYY-MM
    requests: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    cost: Mapped[Decimal] = mapped_column(Money)
    lines: Mapped[list[Any]] = mapped_column(JSON)  # per tier and model
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookEndpoint(Base):
    """A URL a tenant's events are sent to, signed with its secret (Standard Webhooks).
    A deleted endpoint keeps its row (`deleted_at`), so its deliveries stay readable."""

    __tablename__ = "webhook_endpoints"
    __table_args__ = (Index("ix_webhook_endpoints_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(String(2048))
    event_types: Mapped[list[Any]] = mapped_column(JSON)
    secret: Mapped[str] = mapped_column(String(100))  # whsec_ and base64 of its bytes
    # After a rotation that keeps the old secret for a while: deliveries carry both
    # signatures until `previous_secret_until`.
    previous_secret: Mapped[str | None] = mapped_column(String(100))
    previous_secret_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_by: Mapped[str] = mapped_column(String(20))  # "tenant" or "operator"
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class WebhookDelivery(Base):
    """One event for one endpoint, sent until it is answered 2xx or out of attempts. Its
    id is the event's (`webhook-id`), the same on every attempt: receivers deduplicate
    on it. Written in the transaction of the change it reports (an outbox)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint(
            "endpoint_id", "event_type", "object_id", name="uq_webhook_deliveries_event"
        ),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_status_created", "status", "created_at"),
        Index("ix_webhook_deliveries_tenant_created", "tenant_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    event_type: Mapped[str] = mapped_column(String(60))
    object_id: Mapped[str] = mapped_column(String(40))  # the batch's id
    payload: Mapped[str] = mapped_column(Text)  # the body sent, byte for byte
    status: Mapped[str] = mapped_column(String(20))  # pending, delivered, failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Attempts made before the operator last sent it again: it gets WEBHOOK_MAX_ATTEMPTS
    # more from there, and attempt numbers never repeat (an outcome is kept by number).
    attempts_before: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


# --- triggers ---------------------------------------------------------------------------

SQL_DIR = Path(__file__).resolve().parent.parent / "migrations" / "sql"
HELD_TRIGGERS = "0017_held_reservations"


def sql_statements(path: Path) -> list[str]:
    """A .sql file's statements, one each (a driver's prepared statement takes one): a
    statement ends with a line that ends with `;`, outside a `$fn$` function body and,
    in an SQLite trigger, at its `END;`."""
    out: list[str] = []
    lines: list[str] = []
    for line in path.read_text().splitlines():
        if not lines and (not line.strip() or line.lstrip().startswith("--")):
            continue
        lines.append(line)
        body = "\n".join(lines)
        in_function = body.count("$fn$") % 2 == 1
        in_trigger = (
            lines[0].startswith("CREATE TRIGGER")
            and any(ln.strip() == "BEGIN" for ln in lines)
            and line.strip() != "END;"
        )
        if line.rstrip().endswith(";") and not in_function and not in_trigger:
            out.append(body)
            lines = []
    return out


def held_trigger_statements(dialect: str) -> list[str]:
    """The triggers that keep held_reservations, for `dialect` (postgresql or sqlite)."""
    return sql_statements(SQL_DIR / f"{HELD_TRIGGERS}.{dialect}.sql")


@event.listens_for(Base.metadata, "after_create")
def _create_triggers(target: Any, connection: Connection, **_: Any) -> None:
    """A schema made without the migrations (`create_all`, in tests) gets the triggers
    migration 0017 creates, so its held_reservations are kept as a migrated one's."""
    if connection.dialect.name in ("postgresql", "sqlite"):
        for statement in held_trigger_statements(connection.dialect.name):
            connection.execute(text(statement))
