"""Shared fixtures.

Unit tests need nothing. Integration tests use the real PostgreSQL and Redis of this
machine: one database created for the test run (migrated with Alembic) and a Redis key
prefix per test (its keys deleted afterwards). End-to-end tests start real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis
import uvicorn
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from benchmarks.ports import free_port
from tierq import migrations
from tierq.api.app import build_app
from tierq.core.settings import Settings
from tierq.core.token_count import for_settings
from tierq.dispatcher.loop import Dispatcher
from tierq.models.db import Database
from tierq.models.store import SqlJobStore
from tierq.models.tables import Base
from tierq.services.bootstrap import ensure_tenant_key
from tierq.workers.engine.base import Engine
from tierq.workers.engine.simulated_engine import CostModel, SimulatedEngine
from tierq.workers.engine.vllm_scheduler import Tiering
from tierq.workers.worker import Worker

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

PG_ADMIN_URL = os.environ.get(
    "TIERQ_TEST_PG_ADMIN_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
)
REDIS_TEST_URL = os.environ.get("TIERQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ADMIN_KEY = "test-admin-" + uuid.uuid4().hex


async def pg_admin_sql(sql: str) -> None:
    engine = create_async_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            await conn.execute(text(sql))
    finally:
        await engine.dispose()


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for this test run, migrated to head."""
    name = f"tierq_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    asyncio.run(pg_admin_sql(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    migrations.upgrade(url)
    yield url
    asyncio.run(pg_admin_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def settings(pg_database: str, tmp_path: object, request: pytest.FixtureRequest) -> Settings:
    """The test's settings; a test changes some with `@pytest.mark.with_settings(name=value)`."""
    marker = request.node.get_closest_marker("with_settings")
    return base_settings(pg_database, tmp_path).model_copy(
        update=marker.kwargs if marker is not None else {}
    )


def base_settings(pg_database: str, tmp_path: object) -> Settings:
    return Settings(
        database_url=pg_database,
        redis_url=REDIS_TEST_URL,
        redis_prefix=f"tierq-test-{uuid.uuid4().hex[:10]}",
        engine="simulated",
        heartbeat_interval_s=0.2,
        worker_dead_after_s=1.5,
        dispatch_idle_wait_s=0.05,
        drain_timeout_s=5.0,
        reconcile_grace_s=0.0,
        max_num_seqs=8,
        interactive_reserve=4,
        admin_api_key=ADMIN_KEY,
        state_dir=tmp_path,  # type: ignore[arg-type]
        _env_file=None,  # type: ignore[call-arg]
    )


@pytest.fixture
async def redis_client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    yield r
    keys = [k async for k in r.scan_iter(match=f"{settings.redis_prefix}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


@pytest.fixture
async def db(settings: Settings) -> AsyncIterator[Database]:
    """The run's database, emptied first: each test starts from no tenants and no jobs."""
    database = Database.for_settings(settings)
    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    async with database.transaction() as s:
        await s.execute(text(f"TRUNCATE {tables} CASCADE"))
    yield database
    await database.close()


class Platform:
    """The API (real uvicorn on a free port), a dispatcher and workers, in this event loop."""

    def __init__(self, settings: Settings, db: Database, r: aioredis.Redis) -> None:
        self.settings = settings
        self.db = db
        self.jobs = SqlJobStore(db)  # the tests' own; each worker has its own, as a process
        self.r = r
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tasks: list[asyncio.Task[None]] = []
        self.workers: dict[str, tuple[Worker, asyncio.Task[None], SimulatedEngine]] = {}
        self.stores: list[SqlJobStore] = [self.jobs]
        self.dispatcher = Dispatcher(settings, r)
        self.server: uvicorn.Server | None = None

    async def start_api(self) -> None:
        config = uvicorn.Config(
            build_app(self.settings),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_keep_alive=int(self.settings.api_keepalive_s),
        )
        self.server = uvicorn.Server(config)
        self.tasks.append(asyncio.create_task(self.server.serve()))
        while not self.server.started:
            await asyncio.sleep(0.02)

    def start_dispatcher(self) -> None:
        self.tasks.append(asyncio.create_task(self.dispatcher.run()))

    async def start_worker(
        self,
        worker_id: str,
        cost: CostModel | None = None,
        wrap: Callable[[Engine], Engine] | None = None,
    ) -> Worker:
        """A worker on the simulated engine; `wrap` puts a wrapper (faults) around it."""
        engine = SimulatedEngine(
            cost or CostModel(slots=self.settings.max_num_seqs).scaled(20),
            priority_steps=self.settings.engine_priority_steps,
            counter=for_settings(self.settings),
            tiering=Tiering.from_settings(self.settings),
        )
        await engine.start()
        hosted: Engine = engine if wrap is None else wrap(engine)
        store = SqlJobStore(self.db)
        self.stores.append(store)
        worker = Worker(self.settings, store, self.r, hosted, worker_id=worker_id)
        task = asyncio.create_task(worker.run())
        self.workers[worker_id] = (worker, task, engine)
        return worker

    async def kill_worker(self, worker_id: str) -> None:
        """As SIGKILL would: no drain, no cleanup, entries left pending in the inbox."""
        worker, task, engine = self.workers.pop(worker_id)
        runs = [run.task for run in worker._runs.values()]
        for job_task in runs:
            job_task.cancel()
        task.cancel()
        await asyncio.gather(task, *runs, return_exceptions=True)
        await engine.shutdown()

    async def stop(self) -> None:
        for worker, task, engine in self.workers.values():
            worker.request_stop()
            worker.request_stop()
            # Its drain and hand-back may each take DRAIN_TIMEOUT_S (5 s here).
            await _within(30, task, f"worker {worker.worker_id} to stop")
            await engine.shutdown()
        self.dispatcher.request_stop()
        if self.server is not None:
            self.server.should_exit = True
        try:
            await _within(
                10, asyncio.gather(*self.tasks, return_exceptions=True), "the platform to stop"
            )
        finally:
            for store in self.stores:
                await store.close()


async def _within(seconds: float, awaitable: Awaitable[Any], what: str) -> None:
    """Wait; past the time, print where every task of the loop is, then fail: a stop
    that hangs says where it hangs."""
    future = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait([future], timeout=seconds)
    if done:
        with contextlib.suppress(Exception):
            future.result()
        return
    for task in asyncio.all_tasks():
        print(f"--- {task.get_name()}: {task.get_coro()}", file=sys.stderr)
        task.print_stack(limit=8, file=sys.stderr)
    raise TimeoutError(f"waited {seconds} s for {what}")


@pytest.fixture
async def platform(
    settings: Settings, db: Database, redis_client: aioredis.Redis
) -> AsyncIterator[Platform]:
    p = Platform(settings, db, redis_client)
    await p.start_api()
    yield p
    await p.stop()


@pytest.fixture
async def running(platform: Platform) -> Platform:
    """The platform with a dispatcher and one worker on the simulated engine."""
    platform.start_dispatcher()
    await platform.start_worker("w1")
    return platform


@pytest.fixture
async def tenant_key(settings: Settings, db: Database) -> str:
    return await ensure_tenant_key(settings, f"tenant-{uuid.uuid4().hex[:8]}", None)


@pytest.fixture
async def other_tenant_key(settings: Settings, db: Database) -> str:
    return await ensure_tenant_key(settings, f"other-{uuid.uuid4().hex[:8]}", None)


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[WebDriver]:
    """A headless Chromium cut off from every host but 127.0.0.1 (tests/browser.py)."""
    from tests.browser import chrome

    driver = await asyncio.to_thread(chrome, tmp_path)
    yield driver
    await asyncio.to_thread(driver.quit)
