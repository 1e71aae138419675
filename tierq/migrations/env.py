"""Alembic environment: the URL comes from the one Settings object (or the caller)."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from tierq.core.settings import get_settings
from tierq.models.db import make_engine
from tierq.models.tables import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("database_url")
    return str(url) if url else get_settings().resolved_database_url


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Once per deployment, however many hosts start at once: each upgrade waits
            # for the one before it (in its transaction; the lock goes with the commit),
            # then reads the version that one left and has nothing more to do.
            connection.execute(text("SELECT pg_advisory_xact_lock(hashtext('tierq:migrations'))"))
        context.run_migrations()


async def _run_async() -> None:
    pooling = config.attributes.get("transaction_pooling")
    if pooling is None:
        pooling = get_settings().database_transaction_pooling
    engine = make_engine(_url(), transaction_pooling=bool(pooling))
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_async())
