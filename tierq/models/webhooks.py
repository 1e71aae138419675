"""Webhook endpoints and their deliveries: every SQL statement about them.

A delivery is written in the transaction that ends its batch (`record_batch_event`), so an
event is recorded exactly when its batch's change commits, and once. Senders take a due
delivery by a conditional UPDATE that counts the attempt and pushes its next time past the
attempt's length (`claim`): two Celery workers never send one attempt twice, and a sender
killed mid-attempt leaves the delivery due again once that time passes. An outcome is
written only by the attempt that claimed it (`settle` checks the attempt's number).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tierq.core.ids import new_id
from tierq.core.states import BatchStatus
from tierq.models.pages import after_anchor
from tierq.models.records import BatchRecord, as_utc, unix
from tierq.models.tables import WebhookDelivery, WebhookEndpoint, utcnow

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
STATUSES = (PENDING, DELIVERED, FAILED)
# The event a batch's final status is reported as.
BATCH_EVENTS = {
    BatchStatus.COMPLETED: "batch.completed",
    BatchStatus.FAILED: "batch.failed",
    BatchStatus.EXPIRED: "batch.expired",
    BatchStatus.CANCELLED: "batch.cancelled",
}


def secret_hint(secret: str) -> str:
    return f"whsec_...{secret[-4:]}"


def event_body(event_id: str, event_type: str, object_id: str, created_at: int) -> str:
    """OpenAI's event object, as `client.webhooks.unwrap` parses it: the body every attempt
    of a delivery sends, byte for byte."""
    return json.dumps(
        {
            "id": event_id,
            "object": "event",
            "created_at": created_at,
            "type": event_type,
            "data": {"id": object_id},
        },
        separators=(",", ":"),
    )


@dataclass(frozen=True)
class EndpointRecord:
    id: str
    tenant_id: str
    name: str
    url: str
    event_types: tuple[str, ...]
    secret: str
    previous_secret: str | None
    previous_secret_until: datetime | None
    created_by: str
    created_at: datetime
    updated_at: datetime
    deleted_at: datetime | None

    @classmethod
    def from_row(cls, row: WebhookEndpoint) -> EndpointRecord:
        return cls(
            id=row.id,
            tenant_id=row.tenant_id,
            name=row.name,
            url=row.url,
            event_types=tuple(row.event_types or ()),
            secret=row.secret,
            previous_secret=row.previous_secret,
            previous_secret_until=as_utc(row.previous_secret_until),
            created_by=row.created_by,
            created_at=as_utc(row.created_at) or row.created_at,
            updated_at=as_utc(row.updated_at) or row.updated_at,
            deleted_at=as_utc(row.deleted_at),
        )

    def signing_secrets(self, now: datetime) -> list[str]:
        """The secrets a delivery is signed with now: the current one, and the one rotated
        out while it is still honoured."""
        keep = self.previous_secret_until
        if self.previous_secret and keep is not None and now < keep:
            return [self.secret, self.previous_secret]
        return [self.secret]

    def to_api(self, *, with_secret: bool = False) -> dict[str, Any]:
        """OpenAI's webhook_endpoint object (the secret only when made or rotated)."""
        body: dict[str, Any] = {
            "id": self.id,
            "object": "webhook_endpoint",
            "name": self.name,
            "url": self.url,
            "event_types": list(self.event_types),
            "signing_secret_hint": secret_hint(self.secret),
            "created_at": unix(self.created_at),
            "updated_at": unix(self.updated_at),
        }
        if with_secret:
            body["signing_secret"] = self.secret
        return body


@dataclass(frozen=True)
class DeliveryRecord:
    id: str
    endpoint_id: str
    tenant_id: str
    event_type: str
    object_id: str
    payload: str
    status: str
    attempts: int
    attempts_before: int
    next_attempt_at: datetime | None
    last_attempt_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None

    @classmethod
    def from_row(cls, row: WebhookDelivery) -> DeliveryRecord:
        return cls(
            id=row.id,
            endpoint_id=row.endpoint_id,
            tenant_id=row.tenant_id,
            event_type=row.event_type,
            object_id=row.object_id,
            payload=row.payload,
            status=row.status,
            attempts=row.attempts,
            attempts_before=row.attempts_before or 0,
            next_attempt_at=as_utc(row.next_attempt_at),
            last_attempt_at=as_utc(row.last_attempt_at),
            last_status_code=row.last_status_code,
            last_error=row.last_error,
            created_at=as_utc(row.created_at) or row.created_at,
            delivered_at=as_utc(row.delivered_at),
        )

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "webhook_delivery",
            "webhook_endpoint_id": self.endpoint_id,
            "tenant_id": self.tenant_id,
            "event_type": self.event_type,
            "data": {"id": self.object_id},
            "status": self.status,
            "attempts": self.attempts,
            "next_attempt_at": unix(self.next_attempt_at) if self.status == PENDING else None,
            "last_attempt_at": unix(self.last_attempt_at),
            "last_status_code": self.last_status_code,
            "last_error": self.last_error,
            "created_at": unix(self.created_at),
            "delivered_at": unix(self.delivered_at),
        }


# --- endpoints ---------------------------------------------------------------------------


def _live() -> Any:
    return WebhookEndpoint.deleted_at.is_(None)


async def create_endpoint(
    s: AsyncSession,
    tenant_id: str,
    name: str,
    url: str,
    event_types: list[str],
    secret: str,
    created_by: str,
) -> EndpointRecord:
    now = utcnow()
    row = WebhookEndpoint(
        id=new_id("we"),
        tenant_id=tenant_id,
        name=name,
        url=url,
        event_types=list(event_types),
        secret=secret,
        created_by=created_by,
        created_at=now,
        updated_at=now,
    )
    s.add(row)
    await s.flush()
    return EndpointRecord.from_row(row)


async def count_endpoints(s: AsyncSession, tenant_id: str) -> int:
    stmt = select(func.count()).where(WebhookEndpoint.tenant_id == tenant_id, _live())
    return int((await s.execute(stmt)).scalar_one())


async def get_endpoint(
    s: AsyncSession, endpoint_id: str, tenant_id: str | None = None, *, deleted: bool = False
) -> EndpointRecord | None:
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id)
    if tenant_id is not None:
        stmt = stmt.where(WebhookEndpoint.tenant_id == tenant_id)
    if not deleted:
        stmt = stmt.where(_live())
    row = (await s.execute(stmt)).scalar_one_or_none()
    return None if row is None else EndpointRecord.from_row(row)


async def list_endpoints(
    s: AsyncSession, tenant_id: str, *, after: str | None = None, limit: int = 20
) -> tuple[list[EndpointRecord], bool]:
    """Newest first; `after` is the id of the last endpoint of the previous page."""
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id, _live())
    anchor = None
    if after is not None:
        found = await get_endpoint(s, after, tenant_id)
        if found is None:
            return [], False
        anchor = (found.created_at, found.id)
    stmt = after_anchor(stmt, WebhookEndpoint.created_at, WebhookEndpoint.id, anchor, limit)
    rows = list((await s.execute(stmt)).scalars())
    return [EndpointRecord.from_row(r) for r in rows[:limit]], len(rows) > limit


async def update_endpoint(
    s: AsyncSession, endpoint_id: str, tenant_id: str, **values: Any
) -> EndpointRecord | None:
    """Set the given fields of a live endpoint (updated_at moves when one changed)."""
    current = await get_endpoint(s, endpoint_id, tenant_id)
    if current is None:
        return None
    changed = {k: v for k, v in values.items() if v is not None and getattr(current, k) != v}
    if not changed:
        return current
    stmt = (
        update(WebhookEndpoint)
        .where(WebhookEndpoint.id == endpoint_id, _live())
        .values(**changed, updated_at=utcnow())
        .returning(WebhookEndpoint)
        .execution_options(synchronize_session=False)
    )
    row = (await s.execute(stmt)).scalar_one_or_none()
    return None if row is None else EndpointRecord.from_row(row)


async def rotate_secret(
    s: AsyncSession, endpoint_id: str, tenant_id: str, secret: str, keep_old_for: timedelta | None
) -> EndpointRecord | None:
    """A new secret; the old one signs beside it for `keep_old_for`, or is dropped now."""
    current = await get_endpoint(s, endpoint_id, tenant_id)
    if current is None:
        return None
    now = utcnow()
    stmt = (
        update(WebhookEndpoint)
        .where(WebhookEndpoint.id == endpoint_id, _live())
        .values(
            secret=secret,
            previous_secret=current.secret if keep_old_for else None,
            previous_secret_until=now + keep_old_for if keep_old_for else None,
            updated_at=now,
        )
        .returning(WebhookEndpoint)
        .execution_options(synchronize_session=False)
    )
    row = (await s.execute(stmt)).scalar_one_or_none()
    return None if row is None else EndpointRecord.from_row(row)


async def delete_endpoint(s: AsyncSession, endpoint_id: str, tenant_id: str) -> bool:
    """Delete a live endpoint; what it still had to send fails as such (kept, readable)."""
    now = utcnow()
    stmt = (
        update(WebhookEndpoint)
        .where(
            WebhookEndpoint.id == endpoint_id,
            WebhookEndpoint.tenant_id == tenant_id,
            _live(),
        )
        .values(deleted_at=now, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if not (await s.execute(stmt)).rowcount:  # type: ignore[attr-defined]
        return False
    await s.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.endpoint_id == endpoint_id, WebhookDelivery.status == PENDING)
        .values(status=FAILED, last_error="the endpoint was deleted", next_attempt_at=None)
        .execution_options(synchronize_session=False)
    )
    return True


# --- deliveries --------------------------------------------------------------------------


async def record_batch_event(s: AsyncSession, batch: BatchRecord) -> int:
    """A delivery of the batch's final event to each of its tenant's endpoints that takes
    it, in the caller's transaction (the one that moved the batch). Returns how many."""
    event_type = BATCH_EVENTS.get(batch.status)
    if event_type is None:
        return 0
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == batch.tenant_id, _live())
    endpoints = [EndpointRecord.from_row(r) for r in (await s.execute(stmt)).scalars()]
    now = utcnow()
    at = {
        BatchStatus.COMPLETED: batch.completed_at,
        BatchStatus.FAILED: batch.failed_at,
        BatchStatus.EXPIRED: batch.expired_at,
        BatchStatus.CANCELLED: batch.cancelled_at,
    }[batch.status]
    made = 0
    for endpoint in endpoints:
        if event_type not in endpoint.event_types:
            continue
        event_id = new_id("evt")
        s.add(
            WebhookDelivery(
                id=event_id,
                endpoint_id=endpoint.id,
                tenant_id=batch.tenant_id,
                event_type=event_type,
                object_id=batch.id,
                payload=event_body(event_id, event_type, batch.id, unix(at or now) or 0),
                status=PENDING,
                attempts=0,
                attempts_before=0,
                next_attempt_at=now,
                created_at=now,
            )
        )
        made += 1
    if made:
        await s.flush()
    return made


async def due_deliveries(s: AsyncSession, now: datetime, limit: int) -> list[DeliveryRecord]:
    """Pending deliveries whose next attempt is due, the longest waiting first."""
    stmt = (
        select(WebhookDelivery)
        .where(WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
    )
    return [DeliveryRecord.from_row(r) for r in (await s.execute(stmt)).scalars()]


async def claim(
    s: AsyncSession, delivery: DeliveryRecord, now: datetime, busy_until: datetime
) -> int | None:
    """Take the delivery's next attempt if no one took it since it was read: the attempt's
    number, else None. Until `busy_until` it is not due again (a sender killed mid-attempt
    leaves it due after that)."""
    attempt = delivery.attempts + 1
    stmt = (
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == delivery.id,
            WebhookDelivery.status == PENDING,
            WebhookDelivery.attempts == delivery.attempts,
            WebhookDelivery.next_attempt_at <= now,
        )
        .values(attempts=attempt, last_attempt_at=now, next_attempt_at=busy_until)
        .execution_options(synchronize_session=False)
    )
    return attempt if (await s.execute(stmt)).rowcount else None  # type: ignore[attr-defined]


async def settle(
    s: AsyncSession,
    delivery_id: str,
    attempt: int,
    *,
    status: str,
    status_code: int | None,
    error: str | None,
    next_attempt_at: datetime | None,
) -> bool:
    """Write what attempt number `attempt` came to, if it is still the latest one."""
    values: dict[str, Any] = {
        "status": status,
        "last_status_code": status_code,
        "last_error": error[:500] if error else None,
        "next_attempt_at": next_attempt_at,
    }
    if status == DELIVERED:
        values["delivered_at"] = utcnow()
    stmt = (
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == delivery_id,
            WebhookDelivery.status == PENDING,
            WebhookDelivery.attempts == attempt,
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return bool((await s.execute(stmt)).rowcount)  # type: ignore[attr-defined]


async def get_delivery(
    s: AsyncSession, delivery_id: str, tenant_id: str | None = None
) -> DeliveryRecord | None:
    stmt = select(WebhookDelivery).where(WebhookDelivery.id == delivery_id)
    if tenant_id is not None:
        stmt = stmt.where(WebhookDelivery.tenant_id == tenant_id)
    row = (await s.execute(stmt)).scalar_one_or_none()
    return None if row is None else DeliveryRecord.from_row(row)


async def list_deliveries(
    s: AsyncSession,
    *,
    tenant_id: str | None = None,
    endpoint_id: str | None = None,
    status: str | None = None,
    after: str | None = None,
    limit: int = 20,
) -> tuple[list[DeliveryRecord], bool]:
    """Newest first, filtered; `after` is the id of the last delivery of the previous page."""
    stmt = select(WebhookDelivery)
    if tenant_id is not None:
        stmt = stmt.where(WebhookDelivery.tenant_id == tenant_id)
    if endpoint_id is not None:
        stmt = stmt.where(WebhookDelivery.endpoint_id == endpoint_id)
    if status is not None:
        stmt = stmt.where(WebhookDelivery.status == status)
    anchor = None
    if after is not None:
        found = await get_delivery(s, after, tenant_id)
        if found is None:
            return [], False
        anchor = (found.created_at, found.id)
    stmt = after_anchor(stmt, WebhookDelivery.created_at, WebhookDelivery.id, anchor, limit)
    rows = list((await s.execute(stmt)).scalars())
    return [DeliveryRecord.from_row(r) for r in rows[:limit]], len(rows) > limit


async def redeliver(s: AsyncSession, delivery_id: str) -> DeliveryRecord | None:
    """Send a failed delivery again, with WEBHOOK_MAX_ATTEMPTS more attempts (its endpoint
    must be live); attempt numbers go on from where they were."""
    live = select(WebhookEndpoint.id).where(_live())
    stmt = (
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == delivery_id,
            WebhookDelivery.status == FAILED,
            WebhookDelivery.endpoint_id.in_(live),
        )
        .values(
            status=PENDING,
            attempts_before=WebhookDelivery.attempts,
            next_attempt_at=utcnow(),
            last_error=None,
        )
        .returning(WebhookDelivery)
        .execution_options(synchronize_session=False)
    )
    row = (await s.execute(stmt)).scalar_one_or_none()
    return None if row is None else DeliveryRecord.from_row(row)


async def undelivered(s: AsyncSession, limit: int) -> list[DeliveryRecord]:
    """The latest deliveries not (yet) taken: failed ones and ones still being tried (each
    status read down its index, newest first)."""
    found: list[DeliveryRecord] = []
    for status in (PENDING, FAILED):
        stmt = (
            select(WebhookDelivery)
            .where(WebhookDelivery.status == status)
            .order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id.desc())
            .limit(limit)
        )
        found += [DeliveryRecord.from_row(r) for r in (await s.execute(stmt)).scalars()]
    found.sort(key=lambda d: (d.created_at, d.id), reverse=True)
    return found[:limit]


async def delivery_counts(s: AsyncSession, since: datetime) -> dict[str, int]:
    """Deliveries made since `since`, by status, every tenant's (the console's summary)."""
    stmt = (
        select(WebhookDelivery.status, func.count())
        .where(WebhookDelivery.created_at >= since)
        .group_by(WebhookDelivery.status)
    )
    counts = {status: 0 for status in STATUSES}
    for status, n in (await s.execute(stmt)).all():
        counts[str(status)] = int(n)
    return counts
