"""Usage from the ledger, for the admin (any tenant) and for a tenant itself (`/v1/usage`)."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import permutations
from typing import Annotated, Any

from fastapi import APIRouter, Query

from tierq.api.deps import PartsDep, TenantDep
from tierq.api.errors import APIError
from tierq.api.schemas import UsageReport, answered
from tierq.models import billing
from tierq.models.db import Database

router = APIRouter(tags=["usage"])

# What `from` and `to` take, as the OpenAPI document states it: Unix seconds (of a date
# Python can hold) or an ISO 8601 date or date-time.
_TIME_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "integer",
            "minimum": -62135596800,  # 0001-01-01T00:00:00Z
            "maximum": 253402300799,  # 9999-12-31T23:59:59Z
            "description": "Unix seconds.",
        },
        {"type": "string", "format": "date"},
        {"type": "string", "format": "date-time"},
        {"type": "string", "maxLength": 0, "description": "Empty: no bound."},
    ]
}
# `group_by`: some of billing.GROUPS, each once, comma-separated (none: by day).
_GROUP_BY_PATTERN = (
    "^("
    + "|".join(
        ",".join(p)
        for n in range(1, len(billing.GROUPS) + 1)
        for p in permutations(billing.GROUPS, n)
    )
    + ")?$"
)
Since = Annotated[str | None, Query(alias="from", json_schema_extra=_TIME_SCHEMA)]
Until = Annotated[str | None, Query(alias="to", json_schema_extra=_TIME_SCHEMA)]
GroupBy = Annotated[str | None, Query(json_schema_extra={"pattern": _GROUP_BY_PATTERN})]


def parse_time(value: str | None, name: str) -> datetime | None:
    """Unix seconds, an ISO 8601 date (`2026-11-01`) or date-time; UTC when no zone."""
    if value is None or value == "":
        return None
    try:
        if value.lstrip("-").replace(".", "", 1).isdigit():
            return datetime.fromtimestamp(float(value), UTC)
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        # In UTC here, where it is checked: 9999-12-31T23:59-14:00 is past the last date.
        parsed = (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).astimezone(UTC)
    except (ValueError, OverflowError, OSError):  # OSError: a timestamp the C library refuses
        raise APIError(
            400,
            f"'{name}' must be Unix seconds or an ISO 8601 date or date-time.",
            "invalid_request",
            param=name,
        ) from None
    return parsed


def parse_group_by(value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    parts = tuple(p.strip() for p in value.split(",") if p.strip())
    bad = [p for p in parts if p not in billing.GROUPS]
    if bad or len(set(parts)) != len(parts):
        raise APIError(
            400,
            f"'group_by' takes a comma-separated subset of {', '.join(billing.GROUPS)}.",
            "invalid_request",
            param="group_by",
        )
    return parts


async def usage_report(
    db: Database,
    tenant_id: str,
    start: str | None,
    end: str | None,
    group_by: str | None,
) -> dict[str, Any]:
    since, until = parse_time(start, "from"), parse_time(end, "to")
    groups = parse_group_by(group_by) or ("day",)
    async with db.session() as s:  # the sums are the database's: this only awaits them
        used = await billing.usage(s, tenant_id, since, until, groups)
    return {
        "object": "list",
        "tenant_id": tenant_id,
        "from": start,
        "to": end,
        "group_by": list(groups),
        "data": used.data(),
        "total": used.total().to_api(),
    }


@router.get(
    "/v1/usage",
    response_model=None,
    responses=answered(UsageReport, 400, 401, 503),
)
async def own_usage(
    tenant: TenantDep,
    parts: PartsDep,
    start: Since = None,
    end: Until = None,
    group_by: GroupBy = None,
) -> dict[str, Any]:
    """The caller's own usage: tokens and cost per day, tier or model."""
    return await usage_report(parts.db, tenant.id, start, end, group_by)
