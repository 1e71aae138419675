"""A tenant's usage and the invoices: `/admin/tenants/{id}/usage`, `/admin/invoices`
(JSON or CSV), `/admin/invoices.csv` and `/admin/invoices/rollup`."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from tierq.api.admin.reports import invoices_to_csv
from tierq.api.admin.schemas import InvoiceRollup
from tierq.api.admin.tenants import tenant_or_404
from tierq.api.deps import PartsDep
from tierq.api.errors import APIError
from tierq.api.schemas import UsageReport, answered
from tierq.api.usage import GroupBy, Since, Until, usage_report
from tierq.core import clock
from tierq.models import billing as billing_repo

router = APIRouter()

# A month as invoices name it: YYYY-MM in ASCII digits, whose end is a date too (so not
# 9999-12), and no other spelling of the same month ("2024-1", Arabic-Indic digits).
PERIOD_PATTERN = r"^(?!0000)(?!9999-12)[0-9]{4}-(0[1-9]|1[0-2])$"
Period = Annotated[str | None, Query(json_schema_extra={"pattern": PERIOD_PATTERN})]
CSV_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/csv": {"schema": {"type": "string"}}}}
}


def _period(value: str | None) -> str | None:
    if value is None:
        return None
    if re.fullmatch(PERIOD_PATTERN, value) is None:
        raise APIError(400, "'period' is a month: YYYY-MM.", "invalid_request", param="period")
    return value


def _csv(rows: list[dict[str, Any]]) -> Response:
    return Response(
        invoices_to_csv(rows),
        media_type="text/csv",
        headers={"Content-Disposition": 'attachment; filename="invoices.csv"'},
    )


@router.get(
    "/tenants/{tenant_id}/usage",
    response_model=None,
    responses=answered(UsageReport, 404),
)
async def tenant_usage(
    tenant_id: str,
    parts: PartsDep,
    start: Since = None,
    end: Until = None,
    group_by: GroupBy = None,
) -> dict[str, Any]:
    await tenant_or_404(parts.db, tenant_id)
    return await usage_report(parts.db, tenant_id, start, end, group_by)


@router.get("/invoices", response_model=None, responses=CSV_RESPONSE)
async def list_invoices(
    parts: PartsDep,
    tenant: str | None = None,
    period: Period = None,
    format: Annotated[str, Query(json_schema_extra={"enum": ["json", "csv"]})] = "json",
) -> dict[str, Any] | Response:
    async with parts.db.session() as s:
        rows = await billing_repo.invoices(s, tenant, _period(period))
    if format == "csv":
        return _csv(rows)
    if format != "json":
        raise APIError(400, "'format' is json or csv.", "invalid_request", param="format")
    return {"object": "list", "data": rows}


@router.get("/invoices.csv", response_model=None, responses=CSV_RESPONSE)
async def invoices_csv(
    parts: PartsDep, tenant: str | None = None, period: Period = None
) -> Response:
    async with parts.db.session() as s:
        rows = await billing_repo.invoices(s, tenant, _period(period))
    return _csv(rows)


@router.post("/invoices/rollup", response_model=None, responses=answered(InvoiceRollup))
async def roll_up_invoices(parts: PartsDep, period: Period = None) -> dict[str, Any]:
    """Roll the month's ledger up into invoices now (beat does it periodically)."""
    month = _period(period) or clock.utcnow().strftime("%Y-%m")
    tenants = await billing_repo.roll_up_month(parts.db, month)
    async with parts.db.session() as s:
        rows = await billing_repo.invoices(s, None, month)
    return {"object": "list", "period": month, "tenants": tenants, "data": rows}
