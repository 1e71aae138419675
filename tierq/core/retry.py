"""One retry policy for every loop that waits out an outage (Redis or the database
unreachable, a failover under way, a process restarting).

`Backoff` is the wait: it doubles from `first_s` after each failure up to `most_s` and
starts over after a success. Each wait is drawn between half and all of its delay
("equal jitter"): the API processes, workers and dispatchers of a fleet that lost Redis
together then do not all reconnect in the same instant when it returns, and none waits
longer than the cap. `retrying` runs one operation under it. Both leave the decision of
what counts as an outage to the caller (`tierq.core.redis_conn.is_unavailable`,
`models.db.is_unavailable`), and neither ever swallows the caller's own cancel.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tierq.core.aio import raise_if_cancelled

T = TypeVar("T")

log = logging.getLogger(__name__)


class Backoff:
    """The waits between tries: `first_s`, doubling, never more than `most_s`; with equal
    jitter unless `jitter` is False."""

    def __init__(self, first_s: float = 0.1, most_s: float = 2.0, *, jitter: bool = True) -> None:
        if first_s <= 0 or most_s <= 0:
            raise ValueError(f"a backoff's waits are positive, not {first_s} and {most_s}")
        self.first_s = first_s
        self.most_s = most_s
        self.jitter = jitter
        self.failures = 0

    def delay_s(self, failures: int) -> float:
        """The delay (before jitter) after `failures` failures in a row (1: `first_s`)."""
        if failures <= 0:
            return 0.0
        # Capped before it is raised to a power that would overflow a float.
        doublings = min(failures - 1, 64)
        return min(self.most_s, self.first_s * 2.0**doublings)

    def next_s(self) -> float:
        """Count a failure; the wait before the next try."""
        self.failures += 1
        delay = self.delay_s(self.failures)
        return random.uniform(delay / 2, delay) if self.jitter else delay

    async def wait(self) -> float:
        """Count a failure and wait before the next try; returns the wait."""
        delay = self.next_s()
        await asyncio.sleep(delay)
        return delay

    def reset(self) -> None:
        """A try succeeded: the next failure waits `first_s` again."""
        self.failures = 0

    @property
    def waited_s(self) -> float:
        """The most the last failure's wait could have been (0 before any failure)."""
        return self.delay_s(self.failures)


async def retrying(
    op: Callable[[], Awaitable[T]],
    *,
    transient: Callable[[BaseException], bool],
    backoff: Backoff,
    attempts: int | None = None,
    give_up: Callable[[], bool] | None = None,
    what: str | None = None,
) -> T:
    """Run `op` until it returns, trying again after a transient error (`transient`)
    with `backoff`. Other errors propagate at once, and so does a transient one after
    `attempts` tries or when `give_up()` says so (asked after each failure has been
    counted, so it may read `backoff.waited_s`, the wait it would take). A cancel of
    the running task always propagates, even one a library reported as an error. With
    `what`, each retry is logged as a warning under that name."""
    tries = 0
    while True:
        tries += 1
        try:
            return await op()
        except Exception as exc:
            raise_if_cancelled(exc)
            if not transient(exc):
                raise
            if attempts is not None and tries >= attempts:
                raise
            delay = backoff.next_s()
            if give_up is not None and give_up():
                raise
            if what is not None:
                log.warning("%s: %s (%s); retrying in %.2f s", what, type(exc).__name__, exc, delay)
            await asyncio.sleep(delay)
