"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import DbDep, NamesDep, RedisDep, SettingsDep
from tierq.queue import live_workers

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(db: DbDep, r: RedisDep, names: NamesDep, settings: SettingsDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        await db.ping()
        checks["database"] = "ok"
    except Exception as exc:  # any failure means not ready; say which
        checks["database"] = f"error: {type(exc).__name__}"
    workers = 0
    try:
        await r.ping()
        checks["redis"] = "ok"
        alive, _ = await live_workers(r, names, settings.worker_dead_after_s)
        workers = len([w for w in alive if not w.draining])
        checks["workers"] = "ok" if workers else "error: no live worker heartbeat"
    except Exception as exc:
        checks["redis"] = f"error: {type(exc).__name__}"
        checks["workers"] = "unknown"
    ready = all(v == "ok" for v in checks.values())
    body = {"status": "ready" if ready else "not_ready", "checks": checks, "workers": workers}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
