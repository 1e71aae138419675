"""Sending webhook deliveries: Celery's side of services/webhooks.py.

`deliver_due` sends every delivery that is due, a few at once: each attempt is claimed in
the database first (models/webhooks.py), signed with the endpoint's secret(s) at the
moment it is sent (`webhook-timestamp` is the attempt's, `webhook-id` the event's on every
attempt), and its outcome recorded. A failure is tried again after an exponential backoff
with jitter; after WEBHOOK_MAX_ATTEMPTS failures the delivery is `failed`, readable in the
admin API and console, and the operator can send it again.

At least once: a sender killed between the receiver's 2xx and the record sends it again
once its claim lapses, with the same `webhook-id` for the receiver to deduplicate on.
"""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import timedelta

from models import webhooks as repo
from models.db import Database
from models.webhooks import DeliveryRecord
from services import webhooks
from tierq import clock, metrics
from tierq.settings import Settings

log = logging.getLogger(__name__)

BATCH = 100  # deliveries read per pass
AT_ONCE = 8  # attempts in flight at once
CLAIM_FACTOR = 2  # a claim lapses after this many times the bound of an attempt


def backoff_s(attempt: int, settings: Settings) -> float:
    """The wait after failed attempt number `attempt` (1, 2, ...): doubling from the base,
    at most the max, then ±20 % so that a receiver's outage is not answered in lockstep."""
    wait = min(settings.webhook_retry_max_s, settings.webhook_retry_base_s * 2 ** (attempt - 1))
    return wait * random.uniform(0.8, 1.2)


async def deliver_due(settings: Settings, db: Database) -> int:
    """Send what is due now (and what falls due while doing so); the attempts made."""
    made = 0
    gate = asyncio.Semaphore(AT_ONCE)
    while True:
        async with db.session() as s:
            due = await repo.due_deliveries(s, clock.utcnow(), BATCH)
        if not due:
            return made

        async def one(delivery: DeliveryRecord) -> bool:
            async with gate:
                return await attempt(settings, db, delivery)

        results = await asyncio.gather(*(one(d) for d in due))
        made += sum(results)
        if not any(results):
            return made  # every one was taken by another sender


async def attempt(settings: Settings, db: Database, delivery: DeliveryRecord) -> bool:
    """One attempt at a delivery, if this sender claims it; whether it did."""
    now = clock.utcnow()
    busy = now + timedelta(seconds=settings.webhook_timeout_s * CLAIM_FACTOR)
    async with db.transaction() as s:
        number = await repo.claim(s, delivery, now, busy)
        endpoint = await repo.get_endpoint(s, delivery.endpoint_id, deleted=True)
    if number is None:
        return False
    if endpoint is None or endpoint.deleted_at is not None:
        async with db.transaction() as s:
            await repo.settle(
                s,
                delivery.id,
                number,
                status=repo.FAILED,
                status_code=None,
                error="the endpoint was deleted",
                next_attempt_at=None,
            )
        return True
    body = delivery.payload.encode()
    headers = webhooks.signed_headers(
        delivery.id, body, endpoint.signing_secrets(now), int(clock.now())
    )
    outcome = await webhooks.send(endpoint.url, body, headers, settings)
    if outcome.delivered:
        status, next_at, label = repo.DELIVERED, None, "delivered"
    elif number >= settings.webhook_max_attempts:
        status, next_at, label = repo.FAILED, None, "failed"
    else:
        wait = backoff_s(number, settings)
        status, next_at, label = repo.PENDING, clock.utcnow() + timedelta(seconds=wait), "retry"
    async with db.transaction() as s:
        kept = await repo.settle(
            s,
            delivery.id,
            number,
            status=status,
            status_code=outcome.status_code,
            error=outcome.error,
            next_attempt_at=next_at,
        )
    metrics.WEBHOOK_ATTEMPTS.labels(label).inc()
    if not outcome.delivered:
        log.warning(
            "webhook %s (%s) to %s, attempt %d: %s%s",
            delivery.id,
            delivery.event_type,
            endpoint.id,
            number,
            outcome.error,
            "" if kept else " (a later attempt had taken it over)",
        )
    return True
