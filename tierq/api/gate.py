"""The per-tenant admission gate of one API process, shared by every router that admits
jobs (native and OpenAI's)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class TenantGate:
    """At most `limit` admissions of one tenant at a time in this process; the others
    wait here, holding no database connection. Admissions of a tenant with quotas run one
    at a time anyway (its row lock): without the gate a burst of them would each hold a
    pooled connection while waiting for that lock, and other tenants would find none."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._gates: dict[str, tuple[asyncio.Semaphore, int]] = {}

    @contextlib.asynccontextmanager
    async def enter(self, tenant_id: str) -> AsyncIterator[None]:
        gate, users = self._gates.get(tenant_id, (asyncio.Semaphore(self.limit), 0))
        self._gates[tenant_id] = (gate, users + 1)
        try:
            async with gate:
                yield
        finally:
            gate, users = self._gates[tenant_id]
            if users == 1:
                del self._gates[tenant_id]  # no state kept for idle tenants
            else:
                self._gates[tenant_id] = (gate, users - 1)
