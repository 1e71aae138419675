"""The app factory: pools in the lifespan, services on app.state, one router per feature."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from tierq import __version__
from tierq.api import docs, errors, health
from tierq.api.admin.router import router as admin_router
from tierq.api.auth import KeyCache
from tierq.api.batches.router import router as batches_router
from tierq.api.console.router import router as console_router
from tierq.api.deps import AppParts
from tierq.api.files.router import router as files_router
from tierq.api.gate import TenantGate
from tierq.api.jobs.router import router as jobs_router
from tierq.api.limits import BodySizeLimit, HostileInput
from tierq.api.openai.router import router as openai_router
from tierq.api.openai.serving import OpenAIServing
from tierq.api.refresh import keep_fresh
from tierq.api.request_spans import RequestSpans
from tierq.api.streams import Streams
from tierq.api.usage import router as usage_router
from tierq.api.webhooks.router import router as webhooks_router
from tierq.core import fleet, metrics, token_count
from tierq.core.aio import cancel_and_wait
from tierq.core.queue import Enqueuer, EventLog
from tierq.core.redis_conn import connect
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings, get_settings
from tierq.models.db import Database
from tierq.models.store import SqlJobStore

log = logging.getLogger(__name__)


def build_app(settings: Settings | None = None, *, freeze_gc: bool = False) -> FastAPI:
    settings = settings or get_settings()
    if settings.admin_api_key is not None and settings.admin_key_is_placeholder:
        if not settings.embedded:
            raise RuntimeError(
                "ADMIN_API_KEY is a placeholder (or shorter than 16 characters); set a real "
                "secret, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        log.warning("ADMIN_API_KEY is a placeholder: accepted on the embedded default only")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.bound_tenant_labels(settings.tenant_metrics_max)
        # The served model's tokenizer, loaded now rather than by the first request.
        await asyncio.to_thread(token_count.for_settings, settings)
        app.state.db = Database.for_settings(settings)
        app.state.jobs = SqlJobStore(app.state.db)
        app.state.admission_gate = TenantGate(settings.admission_concurrency_per_tenant)
        app.state.redis = await connect(settings, role="api")
        # What the fleet serves, before the first request is admitted (tierq.core.fleet).
        await fleet.refresh(app.state.redis, app.state.names, settings)
        app.state.events = EventLog.for_settings(app.state.redis, app.state.names, settings)
        app.state.streams = Streams(
            app.state.redis, app.state.names, app.state.db, settings, [app.state.key_cache.forget]
        )
        await app.state.streams.start()
        refreshing = asyncio.create_task(
            keep_fresh(app.state.redis, app.state.names, settings), name="api-refresh"
        )
        app.state.parts = AppParts(
            settings,
            app.state.db,
            app.state.jobs,
            app.state.redis,
            app.state.names,
            app.state.events,
            app.state.streams,
            app.state.admission_gate,
            Enqueuer(app.state.redis, app.state.names),
        )
        app.state.openai = OpenAIServing(app.state.parts)
        if freeze_gc:
            # What startup made lives as long as the process: out of the collector's
            # sight, so that its full collections stay short (they set the admission's
            # p99, as `tierq bench admission` shows). Only where the app is the process
            # (`serve_app`): tests build many apps in one process.
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            try:
                try:
                    await app.state.openai.aclose()  # bounded: CANCELS_STOP_S
                finally:
                    await app.state.parts.enqueuer.aclose()  # bounded: its calls' deadline
            finally:
                await cancel_and_wait([refreshing], 5.0)
                await app.state.streams.stop()
                await app.state.redis.aclose()
                await app.state.jobs.close()
                await app.state.db.close()

    # /docs and /redoc are tierq/api/docs.py's: every asset served here, nothing from a CDN.
    app = FastAPI(
        title="tierq", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.settings = settings
    app.state.names = RedisNames(settings.redis_prefix)
    app.state.key_cache = KeyCache(
        settings.auth_cache_ttl_s, settings.auth_lookup_concurrency, settings.auth_lookup_queue
    )
    errors.install(app)
    # Inside the size limit: what it buffers is bounded.
    app.add_middleware(HostileInput, max_bytes=settings.max_body_bytes)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        # uploads: the file plus a little for the multipart framing and the purpose field
        large={"/v1/files": settings.max_upload_bytes + 64 * 1024},
    )
    app.add_middleware(RequestSpans)  # outermost: a request's span covers all it does
    app.include_router(health.router)
    app.include_router(jobs_router)
    app.include_router(openai_router)
    app.include_router(files_router)
    app.include_router(batches_router)
    app.include_router(webhooks_router)
    app.include_router(usage_router)
    app.include_router(admin_router)
    app.include_router(console_router)  # the operator console (/console)
    app.include_router(docs.router)
    return app


def serve_app() -> FastAPI:
    """The factory `tierq api` gives uvicorn (each of its processes calls it): the app from
    the environment's settings, the process's heap frozen once it started."""
    return build_app(freeze_gc=True)
