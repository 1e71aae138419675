"""The database handle: one async engine and session factory per process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import event, exc
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)


def is_unavailable(error: BaseException) -> bool:
    """Whether an error means the database could not be reached (a restart, a dropped
    connection, an exhausted pool): worth retrying, unlike an error in the statement."""
    if isinstance(error, exc.DBAPIError) and error.connection_invalidated:
        return True
    if isinstance(error, exc.OperationalError) and "sqlite" in type(error.orig).__module__:
        # SQLite's OperationalError also means "no such table": only a lock or an
        # unreadable file is worth waiting for.
        message = str(error.orig).lower()
        return any(k in message for k in ("locked", "unable to open", "disk i/o", "busy"))
    # The network's own errors (refused, reset, timed out); not any OSError.
    return isinstance(
        error,
        exc.OperationalError
        | exc.InterfaceError
        | exc.TimeoutError
        | ConnectionError
        | TimeoutError,
    )


def make_engine(url: str, **kwargs: Any) -> AsyncEngine:
    if url.startswith("sqlite"):
        for pool_option in ("pool_size", "max_overflow", "pool_timeout"):
            kwargs.pop(pool_option, None)  # one writer at a time: SQLAlchemy's defaults
        # Several processes share the embedded SQLite file: WAL lets readers run beside the
        # one writer, and busy_timeout makes a writer wait for the lock instead of failing.
        engine = create_async_engine(url, connect_args={"timeout": 30}, **kwargs)

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()
            # Let SQLAlchemy, not the driver, begin transactions (see _begin).
            dbapi_conn.isolation_level = None

        @event.listens_for(engine.sync_engine, "begin")
        def _begin(conn: Any) -> None:
            # Take the write lock up front: two deferred transactions that both read, then
            # both write, deadlock in SQLite (one fails at once with "database is locked");
            # immediate ones queue on busy_timeout instead.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(url, **kwargs)


class Database:
    def __init__(self, url: str, **kwargs: Any) -> None:
        self.url = url
        self.engine = make_engine(url, **kwargs)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        async with self.sessions() as s:
            yield s

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        async with self.sessions() as s, s.begin():
            yield s

    async def ping(self) -> None:
        from sqlalchemy import text

        async with self.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    async def close(self) -> None:
        await self.engine.dispose()
