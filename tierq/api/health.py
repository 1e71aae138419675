"""Liveness, readiness and Prometheus metrics (the series without a tenant label; the
per-tenant ones are behind the admin key, tierq/api/admin/metrics.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tierq.api.deps import PartsDep
from tierq.api.errors import documented
from tierq.core import metrics as series
from tierq.core.queue import live_workers

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={
        **documented(400),
        503: {"description": "Not ready: the body says which check failed."},
    },
)
async def readyz(
    parts: PartsDep,
    min_workers: Annotated[int, Query(ge=0, le=100_000)] = 0,
) -> JSONResponse:
    """Whether this API replica can admit work: its database and Redis answer. What the
    fleet behind it holds — live workers, engines that died — is reported in `workers`
    and `dead_engines` and is no reason to take a replica out of its load balancer (with
    every GPU down, or workers scaled to zero, jobs are still accepted and wait in their
    tiers). `?min_workers=N` also asks for N live workers whose engines run: what
    `tierq run` waits for before it says the platform is up."""
    checks: dict[str, str] = {}
    body_extra: dict[str, list[str]] = {}
    try:
        await parts.db.ping()
        checks["database"] = "ok"
    except Exception as exc:  # any failure means not ready; say which
        checks["database"] = f"error: {type(exc).__name__}"
    workers = 0
    fleet = "unknown"
    try:
        await parts.redis.ping()
        checks["redis"] = "ok"
        alive, _ = await live_workers(parts.redis, parts.names, parts.settings.worker_dead_after_s)
        dead_engines = sorted(w.worker_id for w in alive if not w.engine_ok)
        workers = len([w for w in alive if not w.draining and w.engine_ok])
        if workers:
            fleet = "ok"
        elif dead_engines:
            fleet = f"engine dead on {', '.join(dead_engines)}"
        else:
            fleet = "no live worker heartbeat"
        if dead_engines:
            body_extra["dead_engines"] = dead_engines
    except Exception as exc:
        checks["redis"] = f"error: {type(exc).__name__}"
    if min_workers:
        checks["workers"] = (
            "ok" if workers >= min_workers else f"error: {workers} of {min_workers}: {fleet}"
        )
    ready = all(v == "ok" for v in checks.values())
    body = {
        "status": "ready" if ready else "not_ready",
        "checks": checks,
        "workers": workers,
        "fleet": fleet,
        **body_extra,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(parts: PartsDep) -> Response:
    """This process's series, or every API process's summed (`tierq api --workers N`)."""
    folder = parts.settings.prometheus_multiproc_dir
    registry = series.exposed(tenants=False, folder=str(folder) if folder else None)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
