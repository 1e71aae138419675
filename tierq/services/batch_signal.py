"""Asking Celery to advance a batch now, from the API (created, cancelled) and from workers
(a batch job ended), instead of waiting for beat's next tick.

Requests are debounced: one advance task is outstanding per batch at a time. The task
clears the mark before it looks at the batch, so a job that ends while it runs asks for
the next one; beat's periodic tick catches anything a lost message would miss.
"""

from __future__ import annotations

import asyncio
import logging
from functools import lru_cache

import redis.asyncio as aioredis
from celery import Celery

from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings

log = logging.getLogger(__name__)

ADVANCE_TASK = "tierq.batches.advance"
POKE_TTL_MS = 10_000  # a lost task message blocks new requests this long at most


@lru_cache(maxsize=8)
def _client(broker_url: str) -> Celery:
    return Celery("tierq-client", broker=broker_url, set_as_current=False)


def _send(broker_url: str, queue: str, batch_id: str) -> None:
    _client(broker_url).send_task(ADVANCE_TASK, args=[batch_id], queue=queue, ignore_result=True)


async def poke(settings: Settings, r: aioredis.Redis, names: RedisNames, batch_id: str) -> None:
    """Request an advance of the batch (best effort: never raises)."""
    try:
        if await r.set(names.batch_poke(batch_id), "1", nx=True, px=POKE_TTL_MS):
            await asyncio.to_thread(_send, settings.celery_broker_url, names.celery_queue, batch_id)
    except Exception:  # Redis or kombu: best effort, the tick covers it
        log.warning("could not request an advance of %s; beat's tick will", batch_id)
