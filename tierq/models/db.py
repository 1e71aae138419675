"""The database of a process: `Database`, the SQLAlchemy engine and its sessions
(`session()` to read, `transaction()` to write), which every repository function of this
package uses; and the two kinds of connection the job store (tierq/models/store) opens
privately for its hot paths, defined here beside it: on PostgreSQL a few raw asyncpg
connections (`RawPool`: admission's single statements and a stream's first read, no session,
no ORM), on an SQLite file one connection on a thread of its own (`LocalWriter`: admission
and the worker's writes, group-committed).

Behind a pooler in transaction mode (PgBouncer's `pool_mode = transaction`, set
DATABASE_TRANSACTION_POOLING), consecutive transactions of one client connection may run on
different server connections: nothing may outlive a transaction on the server. tierq's
statements keep that (advisory locks and settings are transaction-scoped), and so does the
driver once told: asyncpg caches no statements (its unnamed statement instead), and the
ORM's statements are prepared under names never used twice, so two client connections
sharing a server connection never collide on `__asyncpg_stmt_1__`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from tierq.core.settings import Settings


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


def _statement_name() -> str:
    return f"__tierq_{uuid.uuid4().hex}__"


# asyncpg's options behind a pooler in transaction mode (the module's docstring).
TRANSACTION_POOLING_ARGS: dict[str, Any] = {
    "statement_cache_size": 0,  # asyncpg's own cache
    "prepared_statement_cache_size": 0,  # SQLAlchemy's dialect's
    "prepared_statement_name_func": _statement_name,
}


def make_engine(url: str, *, transaction_pooling: bool = False, **kwargs: Any) -> AsyncEngine:
    if url.startswith("sqlite"):
        for pool_option in ("pool_size", "max_overflow", "pool_timeout"):
            kwargs.pop(pool_option, None)  # one writer at a time: SQLAlchemy's defaults
        # Several processes share the embedded SQLite file: WAL lets readers run beside the
        # one writer, and busy_timeout makes a writer wait for the lock instead of failing.
        engine = create_async_engine(url, connect_args={"timeout": 30}, **kwargs)
        sqlite_pragmas(engine.sync_engine)
        return engine
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    kwargs.setdefault("pool_pre_ping", True)
    if transaction_pooling:
        kwargs["connect_args"] = {**kwargs.get("connect_args", {}), **TRANSACTION_POOLING_ARGS}
    return create_async_engine(url, **kwargs)


# An execution option: the transaction only reads (on SQLite, a deferred BEGIN).
READ_ONLY = "tierq_read_only"


def sqlite_pragmas(engine: Engine) -> None:
    """Every connection to the embedded SQLite file, through aiosqlite or the standard
    library's driver (tierq/models/admission_sqlite.py), set up alike."""

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()
        # Let SQLAlchemy, not the driver, begin transactions (see _begin).
        dbapi_conn.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        # A transaction that may write takes the write lock up front: two deferred ones
        # that both read, then both write, deadlock in SQLite (one fails at once with
        # "database is locked"); immediate ones queue on busy_timeout instead. One that
        # only reads (Database.session) takes none: in WAL mode it reads a snapshot beside
        # the writer, where an immediate one would queue behind every write and hold the
        # lock from every writer while it reads.
        if conn.get_execution_options().get(READ_ONLY):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


T = TypeVar("T")


class LocalWriter:
    """A synchronous connection to an SQLite file, used on one thread of its own: a hot
    path's whole transaction is one hop there and back (tierq/models/admission_sqlite.py), where
    aiosqlite makes each statement one.

    Writes that arrive while a transaction runs share the next one (group commit): one
    `BEGIN IMMEDIATE` and one COMMIT — one fsync of the WAL — for all of them, each in a
    savepoint of its own so that one that raises is rolled back alone, and each caller
    answered only once that COMMIT returned. Under load the fsync, not the statements, is
    what a commit costs."""

    def __init__(self, url: str) -> None:
        # The async URL's file, through the standard library's driver.
        self.engine: Engine = create_engine(
            url.replace("+aiosqlite", "", 1), connect_args={"timeout": 30}, pool_size=1
        )
        sqlite_pragmas(self.engine)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tierq-sqlite-writer")
        self._pending: list[_Write] = []
        self._lock = threading.Lock()
        self._scheduled = False
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(connection, *args)` on the writer's thread, inside a transaction; its
        value once that transaction committed. A write whose caller was cancelled before
        its turn is not run."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                raise Unavailable("the database writer is closed")
            self._pending.append(_Write(fn, args, done, loop))
            schedule, self._scheduled = not self._scheduled, True
        if schedule:
            try:
                self._thread.submit(self._drain)
            except RuntimeError as exc:  # shut down meanwhile: nothing waits forever
                with self._lock:
                    stranded, self._pending, self._scheduled = self._pending, [], False
                for write in stranded:
                    _answer(write, None, Unavailable(f"the database writer is closed: {exc}"))
        return await done

    def _drain(self) -> None:
        with self._lock:
            group, self._pending = self._pending, []
            self._scheduled = False
        group = [write for write in group if not write.done.cancelled()]
        answers: list[tuple[_Write, Any, BaseException | None]] = []
        try:
            with self.engine.begin() as conn:
                for write in group:
                    try:
                        with conn.begin_nested():
                            answers.append((write, write.fn(conn, *write.args), None))
                    except Exception as exc:  # that write alone is rolled back...
                        if not conn.connection.dbapi_connection.in_transaction:  # type: ignore[union-attr]
                            # ...unless SQLite rolled the whole transaction back itself (a
                            # full disk, an I/O error): then no write of the group stands.
                            raise
                        answers.append((write, None, exc))
        except Exception as exc:  # BEGIN or COMMIT failed: nothing of the group is written
            answers = [(write, None, exc) for write in group]
        for write, value, error in answers:
            _answer(write, value, error)

    async def close(self) -> None:
        with self._lock:
            self._closed = True
        loop = asyncio.get_running_loop()
        with contextlib.suppress(RuntimeError):  # already shut down
            await loop.run_in_executor(self._thread, self.engine.dispose)
        self._thread.shutdown(wait=False)


@dataclass(frozen=True)
class _Write:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


def _answer(write: _Write, value: Any, error: BaseException | None) -> None:
    """Hand the caller its answer on its own event loop; one whose loop has closed hears
    nothing, and the others are still answered."""
    with contextlib.suppress(RuntimeError):
        write.loop.call_soon_threadsafe(_settle, write.done, value, error)


def _settle(done: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if done.done():  # its caller was cancelled: the write stands, nobody hears of it
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(value)


class Unavailable(ConnectionError):
    """The database could not be reached through a raw connection (`RawPool`); answered
    503 like SQLAlchemy's own connection errors (`is_unavailable`)."""


_LIBPQ_OPTIONS = frozenset(
    {
        "sslmode",
        "ssl",
        "sslrootcert",
        "sslcert",
        "sslkey",
        "sslpassword",
        "application_name",
        "options",
        "target_session_attrs",
        "connect_timeout",
        "passfile",
        "krbsrvname",
        "gsslib",
    }
)


class RawPool:
    """A few asyncpg connections (PostgreSQL only) for the hot path's single statements,
    each its own implicit transaction: no session, no ORM, no BEGIN/COMMIT round trips, no
    pre-ping. A connection is opened when first needed and dropped after any error that is
    not the statement's own (the next use opens a fresh one); `size` bound how many are
    open, and waiting longer than `timeout_s` for one raises `Unavailable` (503)."""

    def __init__(
        self, url: str, size: int, timeout_s: float, transaction_pooling: bool = False
    ) -> None:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
        # libpq's connection options only: the SQLAlchemy dialect's own (such as
        # prepared_statement_cache_size) would reach the server as settings and fail.
        query = {k: v for k, v in parsed.query.items() if k in _LIBPQ_OPTIONS}
        self.dsn = parsed.set(drivername="postgresql", query=query).render_as_string(False)
        self.timeout_s = timeout_s
        # Behind a pooler in transaction mode: no named statements (asyncpg's unnamed one).
        self.connect_args: dict[str, Any] = (
            {"statement_cache_size": 0} if transaction_pooling else {}
        )
        self._free: list[Any] = []
        self._slots = asyncio.Semaphore(size)
        self._closed = False

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        """An asyncpg connection for one or more autocommit statements."""
        import asyncpg

        if self._slots.locked():  # all in use: wait, but not forever
            try:
                # A deadline, not wait_for: no task made for each wait (under a burst every
                # admission waits here, and a task per wait is a visible share of the CPU).
                async with asyncio.timeout(self.timeout_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise Unavailable("no database connection was free in time") from None
        else:
            await self._slots.acquire()  # free: no wait, and no timer task
        try:
            conn = self._free.pop() if self._free else None
            if conn is None or conn.is_closed():
                try:
                    conn = await asyncpg.connect(
                        self.dsn, timeout=self.timeout_s, **self.connect_args
                    )
                except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
                    raise Unavailable(f"cannot connect to the database: {exc}") from exc
            try:
                yield conn
            except BaseException as exc:
                # Whatever went wrong — a lost connection, a statement cancelled with its
                # request, a server that ended the session, even the statement's own error —
                # that connection is never handed out again: a fresh one costs little, a
                # connection left mid-protocol would fail the next request.
                lost = conn.is_closed()
                await _discard(conn)
                if isinstance(exc, _unavailable()) or (
                    lost and isinstance(exc, asyncpg.PostgresError)
                ):
                    raise Unavailable(f"the database connection was lost: {exc}") from exc
                raise
            if self._closed:
                await _discard(conn)
            else:
                self._free.append(conn)
        finally:
            self._slots.release()

    async def fetchrow(self, query: str, *args: Any) -> Any:
        """One statement's first row. A pooled connection found unusable before the
        statement was sent (the server ended its session while it was idle) is replaced
        and the statement sent once more on a fresh one."""
        import asyncpg

        try:
            async with self.connection() as conn:
                return await conn.fetchrow(query, *args)
        except Unavailable as exc:
            if not isinstance(exc.__cause__, asyncpg.InternalClientError):
                raise
        async with self.connection() as conn:
            return await conn.fetchrow(query, *args)

    async def close(self) -> None:
        self._closed = True
        free, self._free = self._free, []
        for conn in free:
            await _discard(conn)


def _unavailable() -> tuple[type[BaseException], ...]:
    import asyncpg

    return (
        OSError,
        TimeoutError,
        asyncpg.InterfaceError,
        # The connection was not in a state to start the statement (a session ended by the
        # server while idle, noticed only now): nothing was sent.
        asyncpg.InternalClientError,
        # A server restart or shutdown (57P01..57P03), or a broken connection.
        asyncpg.PostgresConnectionError,
        asyncpg.exceptions.OperatorInterventionError,
    )


async def _discard(conn: Any) -> None:
    with contextlib.suppress(Exception):
        conn.terminate()


def is_sqlite_file(url: str) -> bool:
    """Whether an SQLite URL names a file that a second connection opens too (an in-memory
    database is one per connection)."""
    from sqlalchemy.engine import make_url

    name = make_url(url).database or ""
    return name not in ("", ":memory:") and "mode=memory" not in url


class Database:
    """The engine and its sessions. The job store's own connections are its own
    (tierq/models/store/sql.py): it reads their configuration here."""

    def __init__(self, url: str, *, transaction_pooling: bool = False, **kwargs: Any) -> None:
        self.url = url
        self.transaction_pooling = transaction_pooling
        self.pool_size: int = kwargs.get("pool_size", 10)
        self.pool_timeout_s: float = kwargs.get("pool_timeout", 30.0)
        self.engine = make_engine(url, transaction_pooling=transaction_pooling, **kwargs)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        # Sessions that only read: `session()` (nothing in it is ever committed).
        self._reads = async_sessionmaker(
            self.engine.execution_options(**{READ_ONLY: True}), expire_on_commit=False
        )

    @property
    def dialect(self) -> str:
        """The engine's dialect: postgresql or sqlite."""
        return str(self.engine.dialect.name)

    @classmethod
    def for_settings(cls, settings: Settings) -> Database:
        """This process's database as configured: its pool (DB_POOL_SIZE, DB_MAX_OVERFLOW,
        DB_POOL_TIMEOUT_S) and DATABASE_TRANSACTION_POOLING."""
        return cls(
            settings.resolved_database_url,
            transaction_pooling=settings.database_transaction_pooling,
            pool_size=settings.db_pool_size,
            max_overflow=settings.db_max_overflow,
            pool_timeout=settings.db_pool_timeout_s,
        )

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """A session to read in: whatever it writes is never committed (writes belong in
        `transaction()`); on SQLite it takes no write lock."""
        async with self._reads() as s:
            yield s

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        async with self.sessions() as s, s.begin():
            yield s

    async def ping(self) -> None:
        from sqlalchemy import text

        async with self.engine.connect() as conn:
            conn = await conn.execution_options(**{READ_ONLY: True})
            await conn.execute(text("SELECT 1"))

    async def close(self) -> None:
        await self.engine.dispose()
