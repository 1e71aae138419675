"""The per-tenant admission gate of one API process, shared by every router that admits
jobs (native and OpenAI's)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

# One turn in this many goes to the tenant's longest-waiting admission whatever its tier:
# a steady stream of a tenant's chats slows its batch submissions, and never stops them.
OLDEST_EVERY = 8


@dataclass
class _Tenant:
    running: int = 0  # admissions inside the gate
    live: int = 0  # waiters still waiting
    users: int = 0  # running and waiting: the tenant's state goes when it is 0
    turns: int = 0  # waiters let in, for OLDEST_EVERY
    # The same waiters (each a future, done once let in or gone) in two heaps: best tier
    # first, then oldest; and oldest first. A done one stays until popped or rebuilt away.
    by_rank: list[tuple[int, int, asyncio.Future[None]]] = field(default_factory=list)
    by_age: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)


class TenantGate:
    """At most `limit` admissions of one tenant at a time in this process; the others
    wait here, holding no database connection. Admissions of a tenant with quotas run one
    at a time anyway (its row lock): without the gate a burst of them would each hold a
    pooled connection while waiting for that lock, and other tenants would find none.

    The waiting ones go in by `rank` (lower first: the tier's engine priority), then in
    arrival order: a chat of a tenant that has just sent a backlog of a thousand batch jobs
    waits for the few admissions under way, not behind the whole backlog. One turn in
    OLDEST_EVERY goes to the longest-waiting admission, so no tier waits for ever."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._tenants: dict[str, _Tenant] = {}
        self._seq = itertools.count()

    @contextlib.asynccontextmanager
    async def enter(self, tenant_id: str, rank: int) -> AsyncIterator[None]:
        tenant = self._tenants.setdefault(tenant_id, _Tenant())
        tenant.users += 1
        try:
            await self._acquire(tenant, rank)
            try:
                yield
            finally:
                tenant.running -= 1
                self._grant(tenant)
        finally:
            tenant.users -= 1
            if tenant.users == 0:
                del self._tenants[tenant_id]  # no state kept for idle tenants

    def waiting(self, tenant_id: str) -> int:
        """Admissions of the tenant waiting at the gate."""
        tenant = self._tenants.get(tenant_id)
        return tenant.live if tenant is not None else 0

    async def _acquire(self, tenant: _Tenant, rank: int) -> None:
        if tenant.running < self.limit and not tenant.live:
            tenant.running += 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        seq = next(self._seq)
        heapq.heappush(tenant.by_rank, (rank, seq, granted))
        heapq.heappush(tenant.by_age, (seq, granted))
        tenant.live += 1
        try:
            await granted
        except BaseException:
            if granted.done() and not granted.cancelled():
                tenant.running -= 1  # let in, then cancelled before it ran: pass it on
            else:
                tenant.live -= 1
                granted.cancel()
            # A slot freed while this one was going (it was skipped as gone, or it leaves
            # one it was given) goes to the next.
            self._grant(tenant)
            raise

    def _grant(self, tenant: _Tenant) -> None:
        """Let waiters in while slots are free. The entries of waiters let in or gone stay
        in the heap they were not popped from: once they outnumber the live ones, both
        heaps are rebuilt without them (each rebuild follows as many such entries as it
        costs)."""
        while tenant.running < self.limit and tenant.live:
            tenant.turns += 1
            heap: list[Any] = tenant.by_age if tenant.turns % OLDEST_EVERY == 0 else tenant.by_rank
            granted = _pop_waiting(heap)
            if granted is None:  # the rest are gone, their own cleanup still to run
                break
            tenant.live -= 1
            tenant.running += 1
            granted.set_result(None)
        if len(tenant.by_rank) + len(tenant.by_age) > 4 * tenant.live + 32:
            tenant.by_rank = [entry for entry in tenant.by_rank if not entry[-1].done()]
            tenant.by_age = [(seq, granted) for _rank, seq, granted in tenant.by_rank]
            heapq.heapify(tenant.by_rank)
            heapq.heapify(tenant.by_age)


def _pop_waiting(heap: list[Any]) -> asyncio.Future[None] | None:
    """The first waiter of the heap still waiting (each entry's last item is its future)."""
    while heap:
        granted: asyncio.Future[None] = heapq.heappop(heap)[-1]
        if not granted.done():
            return granted
    return None
