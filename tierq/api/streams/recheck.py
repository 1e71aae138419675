"""The periodic database look, once for every follower of the process: every RECHECK_S,
the jobs of followers that heard nothing for as long (their terminal event may have been
lost in a failover: the follower is told to finish from the buffer and the database), and
the keys of every follower (a revocation whose message was lost closes its streams). The
hub's channels that no follower holds any more are let go on the same beat."""

from __future__ import annotations

import asyncio
import logging

from tierq.api.streams.access import Access
from tierq.api.streams.hub import RECHECK, EventHub
from tierq.core.aio import cancel_and_wait, raise_if_cancelled
from tierq.core.states import TERMINAL
from tierq.models import jobs as job_repo
from tierq.models import tenants as tenant_repo
from tierq.models.db import Database

log = logging.getLogger(__name__)

# While a follower hears nothing, its job is looked at in the database this often.
RECHECK_S = 2.0
STOP_S = 5.0


class Recheck:
    def __init__(self, hub: EventHub, access: Access, db: Database) -> None:
        self.hub = hub
        self.access = access
        self.db = db
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="stream-recheck")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], STOP_S)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(RECHECK_S)
            try:
                await self.hub.unsubscribe_idle()
                await self.once()
            except Exception as exc:
                raise_if_cancelled(exc)  # a cancel the read turned into an error: stop
                log.warning("stream recheck failed: %s", exc)

    async def once(self) -> None:
        everyone = list(self.hub.everyone())
        if not everyone:
            return
        now = asyncio.get_running_loop().time()
        quiet = {f.job_id for f in everyone if now - f.heard_at >= RECHECK_S}
        keys = {f.key_id for f in everyone if f.key_id is not None}
        async with self.db.session() as s:
            status = await job_repo.statuses(s, sorted(quiet)) if quiet else {}
            dead_keys = await tenant_repo.unusable_keys(s, sorted(keys)) if keys else set()
        self.access.unusable(dead_keys)
        for follower in everyone:
            if follower.job_id in quiet and follower.key_id not in dead_keys:
                current = status.get(follower.job_id)
                if current is None or current in TERMINAL:
                    follower.push(RECHECK)
