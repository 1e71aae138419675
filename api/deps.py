"""Typed dependencies: route functions take these and nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from api.errors import APIError
from models import tenants
from models.db import Database
from models.records import TenantRecord
from tierq.queue import EventLog
from tierq.redis_names import RedisNames
from tierq.settings import Settings


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


async def get_session(db: Annotated[Database, Depends(get_db)]) -> AsyncIterator[AsyncSession]:
    async with db.session() as s:
        yield s


def get_redis(request: Request) -> aioredis.Redis:
    r: aioredis.Redis = request.app.state.redis
    return r


def get_names(request: Request) -> RedisNames:
    names: RedisNames = request.app.state.names
    return names


def get_events(request: Request) -> EventLog:
    events: EventLog = request.app.state.events
    return events


SettingsDep = Annotated[Settings, Depends(get_settings)]
DbDep = Annotated[Database, Depends(get_db)]
SessionDep = Annotated[AsyncSession, Depends(get_session)]
RedisDep = Annotated[aioredis.Redis, Depends(get_redis)]
NamesDep = Annotated[RedisNames, Depends(get_names)]
EventsDep = Annotated[EventLog, Depends(get_events)]


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            "missing_api_key",
        )
    return token.strip()


async def get_tenant(request: Request, db: DbDep) -> TenantRecord:
    """The tenant whose active key the request carries; 401 for a missing or wrong key."""
    secret = _bearer(request)
    async with db.session() as s:
        tenant = await tenants.tenant_for_key(s, secret)
    if tenant is None:
        raise APIError(401, "Incorrect API key provided.", "invalid_api_key")
    return tenant


TenantDep = Annotated[TenantRecord, Depends(get_tenant)]
