"""One beat across hosts. Every Celery beat of a deployment (compose's, each host's `tierq
run`, a worker's `-B`) runs this scheduler, and only the one holding the beat lease in
Redis sends the periodic tasks; the others stand by, asking for the lease every third of
BEAT_LEASE_S, and take it once it lapses (its holder killed, frozen or cut off) or is let
go (a beat stopped on purpose). A flushed Redis loses the lease with everything else: its
holder takes it again at its next tick unless a standby was first, and either way one
beat goes on sending — the reconciler above all, which is what recovers from the flush.

The lease fences nothing: a holder frozen past its lease may send one more round of ticks
beside its successor. That is harmless (every periodic task is idempotent and takes its
own lock); what the lease prevents is every host's beat sending every task, always.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import uuid
from pathlib import Path
from typing import Any

import redis
from celery.beat import PersistentScheduler

from tierq.core import scripts
from tierq.core.redis_conn import sync_client
from tierq.core.redis_names import RedisNames
from tierq.core.settings import get_settings

log = logging.getLogger(__name__)


def _holder(schedule: Path) -> str:
    """This beat's name in the lease: random, kept beside its schedule file, so a beat
    restarted with its schedule (a supervisor's restart after SIGKILL) takes its lease back
    at once instead of waiting for it to lapse, while two beats — other hosts, containers
    with one host name and one schedule path — never share one."""
    kept = schedule.with_name(schedule.name + ".holder")
    with contextlib.suppress(OSError):
        name = kept.read_text().strip()
        if name:
            return name
    name = f"{socket.gethostname()}:{uuid.uuid4().hex}"
    with contextlib.suppress(OSError):
        kept.write_text(name)
    return name


class LeasedScheduler(PersistentScheduler):
    """Celery's file-backed scheduler, ticking only while it holds the beat lease."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = get_settings()
        self.lease_s = settings.beat_lease_s
        self.lease_key = RedisNames(settings.redis_prefix).beat_lease
        self.holding: bool | None = None  # unknown until the first tick
        self._redis = sync_client(settings, socket_timeout_s=self.lease_s / 3)
        self._take = self._redis.register_script(scripts.source("beat_hold"))
        self._let_go = self._redis.register_script(scripts.source("release_if_holder"))
        super().__init__(*args, **kwargs)
        self.holder = _holder(Path(self.schedule_filename))

    def tick(self, *args: Any, **kwargs: Any) -> float:
        held = self._hold()
        if held != self.holding:
            if held:
                log.info("beat: %s holds the beat lease and schedules", self.holder)
            else:
                log.info("beat: %s stands by (another beat holds the lease)", self.holder)
            self.holding = held
        if not held:
            return self.lease_s / 3
        # Back before the lease runs out, whatever the next task's time.
        return min(float(super().tick(*args, **kwargs)), self.lease_s / 3)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.holding:  # a planned stop: a standby takes over at its next tick
                try:
                    self._let_go(keys=[self.lease_key], args=[self.holder])
                except redis.RedisError as exc:
                    log.warning("beat: could not let the lease go (it lapses): %s", exc)
                self.holding = False
            self._redis.close()

    def _hold(self) -> bool:
        try:
            ms = int(self.lease_s * 1000)
            return bool(self._take(keys=[self.lease_key], args=[self.holder, ms]))
        except redis.RedisError as exc:
            # Redis is the broker too: no task could be sent meanwhile anyway.
            log.warning("beat: cannot reach Redis for the beat lease: %s", exc)
            return False
