"""Requests with wrong keys cost the others nothing: on the real API and PostgreSQL.

A secret that cannot be a key gets 401 without a lookup; a wrong key retried is looked up
once; a flood of distinct well-formed keys holds at most AUTH_LOOKUP_CONCURRENCY of the
pool's connections at once, and a tenant with a good key is answered meanwhile. The
repository function is wrapped only to count the lookups that reach the database.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import pytest

from tests.conftest import Platform
from tests.helpers import client
from tierq.models import tenants

pytestmark = pytest.mark.integration


class Counted:
    """owner_of_key, counting calls and the most in flight at once (each really queries)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls = 0
        self.in_flight = 0
        self.most = 0

    async def __call__(self, s: Any, secret: str) -> Any:
        self.calls += 1
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0.01)  # a lookup that takes a moment, as under load
            return await self.real(s, secret)
        finally:
            self.in_flight -= 1


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> Counted:
    counted = Counted(tenants.owner_of_key)
    monkeypatch.setattr(tenants, "owner_of_key", counted)
    return counted


def random_key() -> str:
    return tenants.KEY_PREFIX + secrets.token_urlsafe(32)


async def test_a_secret_that_cannot_be_a_key_is_refused_without_a_lookup(
    platform: Platform, lookups: Counted
) -> None:
    for junk in ("nope", "tq-short", "x" * 46, "tq-" + "!" * 43, random_key() + "x"):
        async with client(platform.url, junk) as c:
            resp = await c.get("/v1/jobs")
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert lookups.calls == 0


async def test_a_wrong_key_retried_is_looked_up_once(platform: Platform, lookups: Counted) -> None:
    async with client(platform.url, random_key()) as c:
        codes = [(await c.get("/v1/jobs")).status_code for _ in range(50)]
    assert set(codes) == {401}
    assert lookups.calls == 1


async def test_a_flood_of_wrong_keys_holds_few_connections_and_a_good_key_is_served(
    platform: Platform, tenant_key: str, lookups: Counted
) -> None:
    async with client(platform.url, tenant_key) as good:
        assert (await good.get("/v1/jobs")).status_code == 200  # its owner is cached now
        lookups.calls = 0

        async def attack(n: int) -> list[int]:
            codes = []
            async with client(platform.url, None) as c:
                for _ in range(n):
                    resp = await c.get(
                        "/v1/jobs", headers={"Authorization": f"Bearer {random_key()}"}
                    )
                    codes.append(resp.status_code)
            return codes

        flood = asyncio.gather(*(attack(10) for _ in range(40)))
        latencies = []
        while not flood.done():
            started = time.perf_counter()
            assert (await good.get("/v1/jobs")).status_code == 200
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.01)
        codes = [code for batch in await flood for code in batch]
    limit = platform.settings.auth_lookup_concurrency
    print(
        f"{lookups.calls} lookups, at most {lookups.most} at once; good key p100 "
        f"{max(latencies) * 1000:.0f} ms over {len(latencies)} requests"
    )
    assert set(codes) <= {401, 503} and codes.count(401) > 0
    assert lookups.most <= limit
    assert latencies and max(latencies) < 5.0  # one event loop serves the flood and this
