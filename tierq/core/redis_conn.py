"""Redis connections: created with a ping and a bounded retry, from the one Settings object."""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.sentinel import Sentinel as SyncSentinel
from redis.sentinel import SentinelConnectionPool as SyncSentinelPool

from tierq.core import clock
from tierq.core.redis_url import SentinelTarget
from tierq.core.retry import Backoff, retrying
from tierq.core.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")
SENTINEL_TIMEOUT_S = 2.0  # asking a sentinel for the primary
# The sentinels' own connections only: the data connections' timeouts stay as a plain
# REDIS_URL's (a large XRANGE or a tokenizer's HSET may take longer than this).
_ASKING_SENTINELS = {
    "socket_timeout": SENTINEL_TIMEOUT_S,
    "socket_connect_timeout": SENTINEL_TIMEOUT_S,
    "decode_responses": True,
}


async def connect(
    settings: Settings, *, attempts: int = 30, delay_s: float = 0.5, role: str = "tierq"
) -> aioredis.Redis:
    """An asyncio Redis client that answered PING (retrying while the server comes up).

    Its connections are named `<prefix>:<role>` (CLIENT LIST shows who holds what)."""
    url = settings.resolved_redis_url

    async def answered() -> tuple[aioredis.Redis, str | None]:
        client = _client(settings, role)
        try:
            await client.ping()
            policy = await _eviction_policy(client)
            await clock.sync(client)  # this host's clock against the deployment's
        except BaseException:
            await client.aclose()
            raise
        return client, policy

    try:
        client, policy = await retrying(
            answered,
            transient=lambda exc: isinstance(exc, redis.ConnectionError | OSError),
            backoff=Backoff(delay_s, delay_s, jitter=False),
            attempts=attempts,
        )
    except (redis.ConnectionError, OSError) as exc:
        raise RuntimeError(f"Redis at {url} did not answer PING: {exc}") from exc
    if policy not in (None, "noeviction"):
        await client.aclose()
        raise EvictingRedis(
            f"Redis at {url} runs with maxmemory-policy {policy}, which may evict "
            "tierq's keys (leases, delivery fences, stream slots, the streams that hold "
            "accepted jobs); set it to noeviction (`CONFIG SET maxmemory-policy "
            "noeviction`, or the service's parameter group) and give Redis the memory "
            "its queues need"
        )
    return client


class EvictingRedis(RuntimeError):
    """Redis may evict keys under memory pressure: tierq refuses to run on it."""


async def _eviction_policy(client: aioredis.Redis) -> str | None:
    """The server's maxmemory-policy when it can evict, from INFO (which managed services
    that rename or forbid CONFIG still answer): None when it does not say, and when no
    `maxmemory` is set (Redis then never evicts, whatever the policy)."""
    try:
        info = await client.info("memory")
    except redis.ResponseError as exc:  # INFO forbidden: nothing to check with
        log.warning("cannot read Redis' eviction policy (%s); it must be noeviction", exc)
        return None
    policy = info.get("maxmemory_policy")
    if policy is None:
        log.warning("Redis does not report its eviction policy; it must be noeviction")
        return None
    if str(policy) != "noeviction" and int(info.get("maxmemory", 0) or 0) == 0:
        log.warning(
            "Redis' maxmemory-policy is %s with no maxmemory (nothing is evicted today); "
            "set it to noeviction before giving Redis a memory limit",
            policy,
        )
        return None
    return str(policy)


# Errors that mean Redis could not be reached (a restart, a killed connection): retried.
REDIS_UNAVAILABLE: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError)


# Replies of a Redis that is up but cannot serve writes for now (a replica after a
# failover, a failed snapshot, a busy script): waited out like an unreachable one.
# Error replies that pass: a replica not yet promoted or a primary demoted (READONLY,
# MASTERDOWN), a server loading or busy, and NOSCRIPT: after a failover, a pipeline
# retried on the new primary (which never loaded its scripts) is refused once; run
# again, it loads them. redis-py strips the code from the message of the replies it has
# a class for (READONLY, NOSCRIPT...): it is in `status_code`.
_TRANSIENT_CODES = frozenset(
    {"READONLY", "MISCONF", "BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "NOSCRIPT"}
)


def is_unavailable(error: BaseException) -> bool:
    if isinstance(error, REDIS_UNAVAILABLE):
        return True
    if isinstance(error, redis.ResponseError):
        code = getattr(error, "status_code", None) or str(error).split(" ", 1)[0]
        return code in _TRANSIENT_CODES
    # The network's own errors (refused, reset, timed out); not any OSError.
    return isinstance(error, ConnectionError | TimeoutError | socket.gaierror)


async def with_retries(op: Callable[[], Awaitable[T]], attempts: int = 4) -> T:
    """Run a Redis operation again (on a fresh connection) while Redis is unreachable, a
    few times with a short backoff (0.05, 0.1, 0.2 s: a request waits on it, and a killed
    connection or a failover is usually over at once)."""
    return await retrying(
        op, transient=is_unavailable, backoff=Backoff(0.05, 0.4, jitter=False), attempts=attempts
    )


async def redis_now(r: aioredis.Redis) -> float:
    """Redis' clock (seconds): liveness is judged by one clock, not by each host's."""
    sec, usec = await r.time()
    return float(sec) + float(usec) / 1e6


def _client(settings: Settings, role: str) -> aioredis.Redis:
    """An asyncio client of REDIS_URL (not yet connected). Its pool is bounded: a burst
    waits for a free connection instead of opening one per caller (or failing with "Too
    many connections"). Under Sentinel, the pool asks the sentinels for the primary when
    it connects, and again when the one it had is gone or is a replica now."""
    options: dict[str, Any] = {
        "max_connections": settings.redis_max_connections,
        "timeout": settings.redis_pool_timeout_s,
        "decode_responses": True,
        "health_check_interval": 30,
        "client_name": f"{settings.redis_prefix}:{role}",
    }
    target = SentinelTarget.parse(settings.resolved_redis_url)
    if target is None:
        pool = aioredis.BlockingConnectionPool.from_url(settings.resolved_redis_url, **options)
        return aioredis.Redis.from_pool(pool)
    sentinel = AsyncSentinel(list(target.sentinels), sentinel_kwargs=_ASKING_SENTINELS)
    return sentinel.master_for(
        target.primary,
        redis_class=aioredis.Redis,
        connection_pool_class=_BlockingSentinelPool,
        db=target.db,
        password=target.password,
        **options,
    )


class _BlockingSentinelPool(AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool (it finds the primary) with the blocking pool's bound."""


class _BlockingSyncSentinelPool(SyncSentinelPool, redis.BlockingConnectionPool):
    """The same for a synchronous client."""


def sync_client(settings: Settings, socket_timeout_s: float | None = None) -> redis.Redis:
    """A synchronous client of REDIS_URL (Sentinel too), not yet connected."""
    target = SentinelTarget.parse(settings.resolved_redis_url)
    if target is None:
        return redis.Redis.from_url(
            settings.resolved_redis_url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
        )
    sentinel = SyncSentinel(list(target.sentinels), sentinel_kwargs=_ASKING_SENTINELS)
    return sentinel.master_for(
        target.primary,
        connection_pool_class=_BlockingSyncSentinelPool,
        db=target.db,
        password=target.password,
        decode_responses=True,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
    )


def connect_sync(settings: Settings) -> redis.Redis:
    client = sync_client(settings)
    client.ping()
    return client
