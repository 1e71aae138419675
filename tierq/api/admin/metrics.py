"""`GET /admin/metrics`: the per-tenant Prometheus series of this API process (of every
API process, summed, under `tierq api --workers N`).

They name tenants and their volumes, so they are not on the open `/metrics`; the admin
router this is included in takes the ADMIN_API_KEY.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tierq.api.deps import PartsDep
from tierq.core import metrics

router = APIRouter()


@router.get("/metrics", response_class=PlainTextResponse)
async def tenant_metrics(parts: PartsDep) -> Response:
    folder = parts.settings.prometheus_multiproc_dir
    registry = metrics.exposed(tenants=True, folder=str(folder) if folder else None)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
