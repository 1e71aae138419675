"""tierq_desired_workers from a running dispatcher: the waiting work raises it, and it
falls to 0 once everything ran (real Redis and PostgreSQL, the simulated engine)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import Platform
from tests.helpers import client, wait_for

pytestmark = pytest.mark.integration


async def _exported(platform: Platform) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(
        "tierq_desired_workers", {"model": platform.settings.served_model_name}
    )
    assert value is not None
    return value


async def _until(platform: Platform, want: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while platform.dispatcher.desired_workers != want:
        assert time.monotonic() < deadline, platform.dispatcher.desired_workers
        await asyncio.sleep(0.1)
    assert await _exported(platform) == want


async def test_the_backlog_asks_for_workers_and_an_empty_queue_for_none(
    platform: Platform, tenant_key: str
) -> None:
    platform.start_dispatcher()  # no worker yet: everything waits
    async with client(platform.url, tenant_key) as c:
        ids = []
        for _ in range(30):
            resp = await c.post("/v1/jobs", json={"prompt": "Count", "max_tokens": 8})
            assert resp.status_code == 202, resp.text
            ids.append(resp.json()["id"])
        # 30 standard jobs waiting, nothing measured yet: a slot each, 8 slots a worker.
        await _until(platform, 4)
        await platform.start_worker("w1")
        for i in ids:
            await wait_for(c, i, timeout=60)
        await _until(platform, 0)
    assert isinstance(c, httpx.AsyncClient)
