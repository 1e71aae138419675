"""Sending webhook deliveries: Celery's side of tierq/services/webhooks.py.

`deliver_due` sends every delivery that is due, a few at once: each attempt is claimed in
the database first (tierq/models/webhooks.py), signed with the endpoint's secret(s) at the
moment it is sent (`webhook-timestamp` is the attempt's, `webhook-id` the event's on every
attempt), and its outcome recorded. A failure is tried again after an exponential backoff
with jitter; after WEBHOOK_MAX_ATTEMPTS failures the delivery is `failed`, readable in the
admin API and console, and the operator can send it again.

At least once: a sender killed between the receiver's 2xx and the record sends it again
once its claim lapses, with the same `webhook-id` for the receiver to deduplicate on.

Receivers are other people's servers, and some are slow: one pass at a time runs in the
whole deployment (a lock in Redis), with at most AT_ONCE attempts in flight and at most
PER_ENDPOINT of them to one endpoint, and it claims nothing new after PASS_S — so however
many endpoints time out, webhooks hold one Celery process for a bounded time, and batches,
billing and the reconciler keep the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from datetime import timedelta

import redis.asyncio as aioredis
from redis.exceptions import LockError

from tierq.core import clock, metrics
from tierq.core.redis_names import RedisNames
from tierq.core.retry import Backoff
from tierq.core.settings import Settings
from tierq.models import webhooks as repo
from tierq.models.db import Database
from tierq.models.webhooks import DeliveryRecord
from tierq.services import webhooks

log = logging.getLogger(__name__)

BATCH = 100  # deliveries read per round
AT_ONCE = 8  # attempts in flight at once
PER_ENDPOINT = 2  # of those, to one endpoint
PASS_S = 30.0  # a pass claims nothing new after this long
CLAIM_FACTOR = 2  # a claim lapses after this many times the bound of an attempt


def backoff_s(attempt: int, settings: Settings) -> float:
    """The wait after failed attempt number `attempt` (1, 2, ...): doubling from the base,
    at most the max, then ±20 % so that a receiver's outage is not answered in lockstep."""
    doubling = Backoff(settings.webhook_retry_base_s, settings.webhook_retry_max_s, jitter=False)
    return doubling.delay_s(attempt) * random.uniform(0.8, 1.2)


async def deliver_due(settings: Settings, db: Database, r: aioredis.Redis) -> int:
    """Send what is due now (and what falls due during the pass); the attempts made. Returns
    at once when another Celery process is sending."""
    held = PASS_S + settings.webhook_timeout_s * CLAIM_FACTOR
    lock = r.lock(RedisNames(settings.redis_prefix).webhook_lock, timeout=held, blocking=False)
    if not await lock.acquire():
        return 0
    try:
        return await _pass(settings, db)
    finally:
        with contextlib.suppress(LockError):  # it lapsed (a pass past its bound)
            await lock.release()


async def _pass(settings: Settings, db: Database) -> int:
    made = 0
    gate = asyncio.Semaphore(AT_ONCE)
    deadline = time.monotonic() + PASS_S
    while time.monotonic() < deadline:
        async with db.session() as s:
            due = await repo.due_deliveries(s, clock.utcnow(), BATCH)
        # At most PER_ENDPOINT of one endpoint's in this round: a receiver that hangs takes
        # two slots, not all of them; the rest of its deliveries wait for the next round.
        taken: Counter[str] = Counter()
        round_ = []
        for delivery in due:
            if taken[delivery.endpoint_id] < PER_ENDPOINT:
                taken[delivery.endpoint_id] += 1
                round_.append(delivery)
        if not round_:
            return made

        async def one(delivery: DeliveryRecord) -> bool:
            async with gate:
                return await attempt(settings, db, delivery)

        results = await asyncio.gather(*(one(d) for d in round_), return_exceptions=True)
        for delivery, result in zip(round_, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                log.error("webhook delivery %s: %s", delivery.id, result, exc_info=result)
        claimed = [r for r in results if r is True]
        made += len(claimed)
        if not claimed:
            return made  # every one was taken by another sender, or failed to be claimed
    return made


async def attempt(settings: Settings, db: Database, delivery: DeliveryRecord) -> bool:
    """One attempt at a delivery, if this sender claims it; whether it did."""
    async with db.transaction() as s:
        now = clock.utcnow()  # the claim's time starts once a connection is held
        busy = now + timedelta(seconds=settings.webhook_timeout_s * CLAIM_FACTOR)
        number = await repo.claim(s, delivery, now, busy)
        endpoint = await repo.get_endpoint(s, delivery.endpoint_id, deleted=True)
    if number is None:
        return False
    why_not = None
    if endpoint is None or endpoint.deleted_at is not None:
        why_not = "the endpoint was deleted"
    elif number - delivery.attempts_before > settings.webhook_max_attempts:
        why_not = "out of attempts (earlier ones were claimed and never finished)"
    if endpoint is None or why_not is not None:
        async with db.transaction() as s:
            await repo.settle(
                s,
                delivery.id,
                number,
                status=repo.FAILED,
                status_code=None,
                error=why_not,
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
    elif number - delivery.attempts_before >= settings.webhook_max_attempts:
        status, next_at, label = repo.FAILED, None, "failed"
    else:
        wait = backoff_s(number - delivery.attempts_before, settings)
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
