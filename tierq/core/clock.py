"""One clock for the times that hosts compare: Redis'. Every process of a deployment reaches
the same Redis, and liveness is judged on its clock already (tierq.core.redis_conn.redis_now).

A job's admission time is written by an API host and compared by the dispatcher (urgency,
first come first served), the worker (queue wait, time to first token) and the reconciler
(its grace); a quota's window, a batch's expiry and the ledger's days likewise. A host
whose clock is off by a minute would make its jobs look a minute younger or older to every
other host. So each process measures its wall clock's offset from Redis `TIME` — when it
connects, then at least every SYNC_EVERY_S from its loops (a failover to a primary on
another clock is followed within that) — keeping the reading with the shortest round
trip of a few (half of it is the error bound), and `now()` is its own wall clock plus
that offset. Until a first reading, and in the embedded default where every
process runs on one host, the offset is 0.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from tierq.core.aio import raise_if_cancelled

SYNC_EVERY_S = 15.0
READINGS = 3  # TIME round trips per measurement: the shortest one is kept
PRECISE_ENOUGH_S = 0.01  # a round trip this short is always taken
KEEP_PRECISE_S = 300.0  # a more precise reading is kept over a sloppier one this long

_offset = 0.0  # Redis' clock less this host's (seconds)
_measured_at: float | None = None  # time.monotonic() of the last measurement
_round_trip = 0.0  # of the reading held
_tried_at: float | None = None  # time.monotonic() of the last measurement, taken or not


def now() -> float:
    """Seconds since the epoch, on the deployment's one clock."""
    return time.time() + _offset


def utcnow() -> datetime:
    return datetime.fromtimestamp(now(), UTC)


def offset() -> float:
    """What this process adds to its wall clock (Redis' less its own)."""
    return _offset


def _take(readings: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(offset, round trip) from (sent, Redis' time, received) readings: of the fastest."""
    sent, server, received = min(readings, key=lambda r: r[2] - r[0])
    return server - (sent + received) / 2, received - sent


def _keep(reading: tuple[float, float]) -> float:
    """Take a new reading unless it is much less precise than the one held (a slow round
    trip, half of which is its error), and that one is still recent."""
    global _offset, _measured_at, _round_trip, _tried_at
    value, round_trip = reading
    _tried_at = time.monotonic()
    recent = _measured_at is not None and time.monotonic() - _measured_at < KEEP_PRECISE_S
    if recent and round_trip > max(2 * _round_trip, PRECISE_ENOUGH_S):
        return _offset
    _offset, _measured_at, _round_trip = value, time.monotonic(), round_trip
    return value


async def sync(r: Any) -> float:
    """Measure the offset now (an asyncio Redis client); it."""
    readings = []
    for _ in range(READINGS):
        sent = time.time()
        sec, usec = await r.time()
        readings.append((sent, float(sec) + float(usec) / 1e6, time.time()))
    return _keep(_take(readings))


async def refresh(r: Any) -> None:
    """Measure again if the last reading is SYNC_EVERY_S old (or none was taken). A Redis
    that does not answer keeps the last offset: the caller's own call will say why."""
    if _tried_at is not None and time.monotonic() - _tried_at < SYNC_EVERY_S:
        return
    try:
        await sync(r)
    except Exception as exc:  # a lost connection, a timeout: try again next time
        raise_if_cancelled(exc)
