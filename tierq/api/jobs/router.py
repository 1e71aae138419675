"""Routes of the native job API (`/v1/jobs`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from tierq.api.deps import PartsDep, TenantDep, api_key_id, refuse_at_stream_cap, stream_slot
from tierq.api.errors import APIError, documented, not_found
from tierq.api.jobs.events import EVENT_STREAM, FINAL_AFTER_EXPIRY, job_event_stream
from tierq.api.jobs.schemas import Job, JobList
from tierq.api.pages import list_page
from tierq.api.schemas import answered
from tierq.core.queue import EventLog
from tierq.core.states import TERMINAL, JobStatus
from tierq.core.tiers import Tier
from tierq.models import jobs as job_repo
from tierq.services import admission, cancellation
from tierq.services.requests import JobCreate

# Every route: the door's guard (400), the key (401), the database (503).
router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=documented(400, 401, 503))
_EVENTS: dict[int | str, dict[str, Any]] = {
    200: {"description": "The job's events as Server-Sent Events.", "content": EVENT_STREAM},
    204: {"description": "Last-Event-ID is the job's final event: nothing follows."},
    **documented(404, 429),
}


@router.post(
    "",
    status_code=202,
    response_model=None,
    responses=answered(Job, 403, 404, 409, 413, 429, status=202),
)
async def create_job(
    body: JobCreate,
    request: Request,
    tenant: TenantDep,
    parts: PartsDep,
    idempotency_key: Annotated[
        str | None,
        Header(alias="Idempotency-Key", json_schema_extra={"minLength": 1, "maxLength": 255}),
    ] = None,
) -> JSONResponse:
    job, _created = await admission.submit(
        parts.jobs,
        parts.enqueuer,
        parts.settings,
        tenant,
        body,
        idempotency_key,
        key_id=api_key_id(request),
        gate=parts.gate.enter,
    )
    return JSONResponse(job.to_api(), status_code=202)


@router.get("", response_model=None, responses=answered(JobList))
async def list_jobs(
    tenant: TenantDep,
    parts: PartsDep,
    status: JobStatus | None = None,
    tier: Tier | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
) -> dict[str, Any]:
    limit = min(limit, parts.settings.list_page_max)
    async with parts.db.session() as s:
        page, has_more = await job_repo.list_jobs(
            s, tenant.id, status=status, tier=tier, after=after, limit=limit
        )
    data = [job.to_api() for job in page]
    return list_page(data, has_more)


@router.get("/{job_id}", response_model=None, responses=answered(Job, 404))
async def get_job(job_id: str, tenant: TenantDep, parts: PartsDep) -> dict[str, Any]:
    async with parts.db.session() as s:
        job = await job_repo.get_job(s, job_id, tenant.id)
    if job is None:
        raise not_found("job", job_id)
    return job.to_api()


@router.post("/{job_id}/cancel", response_model=None, responses=answered(Job, 404, 409))
async def cancel_job(job_id: str, tenant: TenantDep, parts: PartsDep) -> dict[str, Any]:
    job = await cancellation.cancel_job(
        parts.jobs, parts.redis, parts.names, parts.events, tenant.id, job_id
    )
    return job.to_api()


async def _has_the_end(events: EventLog, job_id: str, last_seq: int) -> bool:
    """Whether a client that has the finished job's events up to `last_seq` has its final
    one. Once the replay buffer has expired only the final event's own id can say so: any
    other id gets the final event again, from the database."""
    if last_seq >= FINAL_AFTER_EXPIRY:
        return True
    return not await events.since(job_id, last_seq) and await events.exists(job_id)


@router.get("/{job_id}/events", responses=_EVENTS)
async def job_events(
    job_id: str,
    request: Request,
    tenant: TenantDep,
    parts: PartsDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> Response:
    if last_event_id is None:
        # A tenant opening streams past its cap is refused before the database is asked.
        # (A reconnect is not: the end of a finished job answers 204 without a slot.)
        refuse_at_stream_cap(parts.streams.slots, tenant)
    job = await parts.jobs.head(job_id, tenant.id)
    if job is None:
        raise not_found("job", job_id)
    last_seq = 0
    if last_event_id:
        # ASCII digits only ("²".isdigit() is true), and no more of them than an id has.
        if not (last_event_id.isascii() and last_event_id.isdigit() and len(last_event_id) < 19):
            raise APIError(400, "Last-Event-ID must be an event id.", "invalid_last_event_id")
        last_seq = int(last_event_id)
    if (
        last_seq > 0
        and job.status in TERMINAL
        and await _has_the_end(parts.events, job.id, last_seq)
    ):
        # 204 is what ends EventSource's reconnecting (another final event would have it
        # reconnect forever).
        return Response(status_code=204)
    slot = await stream_slot(parts.streams.slots, tenant)
    stream = job_event_stream(
        parts.streams.hub, parts.db, parts.events, job, last_seq, api_key_id(request), slot
    )
    # The stream lets its slot go when it ends; the background task covers a response
    # that never started streaming.
    return EventSourceResponse(stream, ping=15, background=BackgroundTask(slot.release))
