"""A Redis that may evict keys under memory pressure (a managed Redis' `volatile-lru`
default) would drop leases, delivery fences and stream slots: every tierq process refuses
to start on it, saying what to set, and starts once it is `noeviction`. On a real
redis-server of the test's own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from benchmarks.harness import RedisServer
from benchmarks.ports import free_port
from tierq.core.redis_conn import EvictingRedis, connect
from tierq.core.settings import Settings

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


async def test_an_evicting_redis_is_refused_at_start(tmp_path: Path) -> None:
    server = RedisServer(free_port(), tmp_path / "redis.log")
    server.start()
    try:
        await server.wait_ready()
        admin = aioredis.Redis.from_url(server.url)
        # With no memory limit nothing is ever evicted, whatever the policy: taken.
        await admin.config_set("maxmemory-policy", "volatile-lru")
        settings = Settings(redis_url=server.url, _env_file=None)  # type: ignore[call-arg]
        unlimited = await connect(settings, attempts=1)
        await unlimited.aclose()
        await admin.config_set("maxmemory", "200mb")
        settings = Settings(redis_url=server.url, _env_file=None)  # type: ignore[call-arg]
        with pytest.raises(EvictingRedis, match="maxmemory-policy volatile-lru"):
            await connect(settings, attempts=1)

        # A real process: the dispatcher exits at once, and says why.
        env = {**os.environ, "REDIS_URL": server.url, "STATE_DIR": str(tmp_path)}
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "tierq", "dispatcher"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert "maxmemory-policy volatile-lru" in done.stderr and "noeviction" in done.stderr

        for policy in ("allkeys-lru", "volatile-ttl"):
            await admin.config_set("maxmemory-policy", policy)
            with pytest.raises(EvictingRedis, match=policy):
                await connect(settings, attempts=1)
        await admin.config_set("maxmemory-policy", "noeviction")
        client = await connect(settings, attempts=1)
        assert await client.ping()
        await client.aclose()
        await admin.aclose()
    finally:
        server.kill()
