"""`GET /admin/metrics`: the per-tenant Prometheus series of this API process.

They name tenants and their volumes, so they are not on the open `/metrics`; the admin
router this is included in takes the ADMIN_API_KEY.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tierq import metrics

router = APIRouter()


@router.get("/metrics", response_class=PlainTextResponse)
async def tenant_metrics() -> Response:
    return Response(generate_latest(metrics.TENANT_REGISTRY), media_type=CONTENT_TYPE_LATEST)
