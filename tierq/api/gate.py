"""The per-tenant admission gate of one API process, shared by every router that admits
jobs (native and OpenAI's)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class _Waiter:
    rank: int
    seq: int
    granted: asyncio.Future[None]

    def __lt__(self, other: _Waiter) -> bool:
        return (self.rank, self.seq) < (other.rank, other.seq)


@dataclass
class _Tenant:
    running: int = 0  # admissions inside the gate
    live: int = 0  # waiters still waiting (cancelled ones stay in the heap until popped)
    users: int = 0  # running and waiting: the tenant's state goes when it is 0
    waiting: list[_Waiter] = field(default_factory=list)  # a heap, best rank first


class TenantGate:
    """At most `limit` admissions of one tenant at a time in this process; the others
    wait here, holding no database connection. Admissions of a tenant with quotas run one
    at a time anyway (its row lock): without the gate a burst of them would each hold a
    pooled connection while waiting for that lock, and other tenants would find none.

    The waiting ones go in by `rank` (lower first: the tier's engine priority), then in
    arrival order: a chat of a tenant that has just sent a backlog of a thousand batch jobs
    waits for the few admissions under way, not behind the whole backlog."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._tenants: dict[str, _Tenant] = {}
        self._seq = itertools.count()

    @contextlib.asynccontextmanager
    async def enter(self, tenant_id: str, rank: int = 0) -> AsyncIterator[None]:
        tenant = self._tenants.setdefault(tenant_id, _Tenant())
        tenant.users += 1
        try:
            await self._acquire(tenant, rank)
            try:
                yield
            finally:
                self._release(tenant)
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
        waiter = _Waiter(rank, next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(tenant.waiting, waiter)
        tenant.live += 1
        try:
            await waiter.granted
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release(tenant)  # let in, then cancelled before it ran: pass it on
            else:
                tenant.live -= 1
                waiter.granted.cancel()  # skipped when popped
            raise

    def _release(self, tenant: _Tenant) -> None:
        tenant.running -= 1
        while tenant.waiting:
            waiter = heapq.heappop(tenant.waiting)
            if waiter.granted.done():
                continue  # cancelled while waiting
            tenant.live -= 1
            tenant.running += 1
            waiter.granted.set_result(None)
            return
