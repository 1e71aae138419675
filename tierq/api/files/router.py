"""OpenAI's Files API: uploads streamed to the file store, downloads streamed back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any, BinaryIO, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from tierq.api.deps import PartsDep, TenantDep, api_key_id
from tierq.api.errors import APIError, documented, not_found
from tierq.api.files.lingering import LingeringRefusal, Unread
from tierq.api.files.multipart import Form, read_form
from tierq.api.files.part_writer import PartWriter
from tierq.api.files.upload_lease import UploadLease
from tierq.api.openai.protocol import FileList, FileObject
from tierq.api.pages import list_page
from tierq.api.schemas import Deleted, answered
from tierq.core import metrics
from tierq.core.file_store import READ_BUFFER, file_store
from tierq.core.ids import new_id
from tierq.core.settings import Settings
from tierq.models import batches as batch_repo
from tierq.models import files as file_repo
from tierq.models.db import Database
from tierq.models.records import FileRecord
from tierq.models.tenants import lock_tenant
from tierq.services.admission import refuse_unless_active
from tierq.services.hostile import unstorable
from tierq.services.stored_files import forget

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/files", tags=["files"], responses=documented(400, 401, 503))

UPLOAD_PURPOSES = ("batch",)
MAX_FIELDS = 8  # form fields besides the file
MAX_FIELD_BYTES = 8 * 1024  # each of them (held in memory)
# Room for the multipart framing and the other fields (MAX_FIELDS of MAX_FIELD_BYTES): a
# refusal by Content-Length alone (before any byte is read) must never refuse a file that
# would fit.
FRAMING_BYTES = 64 * 1024 + 2 * 1024
# OpenAI's expires_after, as the SDKs send it in a multipart form.
EXPIRES_ANCHOR, EXPIRES_SECONDS = "expires_after[anchor]", "expires_after[seconds]"
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 30 * 86_400
# The upload as the OpenAPI document states it (the route reads the form itself).
_UPLOAD = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)},
                        EXPIRES_ANCHOR: {"type": "string", "enum": ["created_at"]},
                        EXPIRES_SECONDS: {
                            "type": "integer",
                            "minimum": EXPIRES_MIN_S,
                            "maximum": EXPIRES_MAX_S,
                        },
                    },
                    "dependentRequired": {
                        EXPIRES_ANCHOR: [EXPIRES_SECONDS],
                        EXPIRES_SECONDS: [EXPIRES_ANCHOR],
                    },
                    # Other fields are ignored: at most MAX_FIELDS besides the file, and
                    # none named expires_after... but the two above.
                    "maxProperties": MAX_FIELDS + 1,
                    "additionalProperties": {"type": "string"},
                    "propertyNames": {
                        "anyOf": [
                            {"not": {"pattern": "^expires_after"}},
                            {"enum": [EXPIRES_ANCHOR, EXPIRES_SECONDS]},
                        ]
                    },
                }
            }
        },
    }
}


@router.post(
    "",
    openapi_extra=_UPLOAD,
    response_model=None,
    responses=answered(FileObject, 413, 415, 429),
)
async def create_file(
    request: Request,
    tenant: TenantDep,
    parts: PartsDep,
) -> dict[str, Any] | Response:
    """multipart/form-data with `file`, `purpose` and optionally `expires_after[anchor]`
    and `expires_after[seconds]` (OpenAI's contract). The file part is written to the file
    store as it arrives (appearing there only once whole), counted against the tenant's
    quota with its other uploads in progress (at most FILES_MAX_CONCURRENT_UPLOADS); the
    exact check of its storage quota and file count is made under its row lock in the
    transaction that adds the file."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(
            415,
            "Upload a file as multipart/form-data with 'file' and 'purpose'.",
            "invalid_content_type",
        )
    lease = UploadLease(parts.redis, parts.names, tenant.id)
    file_id = new_id("file")
    store = file_store(parts.settings)
    writer = PartWriter(store, file_id, parts.settings, parts.db, tenant.id, lease, _filename)
    try:
        async with _slot(lease, parts.settings) as committed:
            stored = False
            try:
                form = await _receive(request, parts.db, parts.settings, lease, writer)
                purpose, expires_after_s = _purpose(form), _expires_after(form, parts.settings)
                await writer.commit()
                stored = True
                record = await _add(
                    request,
                    tenant.id,
                    parts.db,
                    parts.settings,
                    file_id,
                    purpose,
                    writer,
                    expires_after_s,
                )
                committed.set()
            except BaseException:
                await forget(store, parts.db, writer.writes, [file_id] if stored else [])
                raise
    except Unread as unread:
        return LingeringRefusal(unread.refusal)
    except ClientDisconnect:
        # The client went away mid-body: nothing is kept (removed above), no one to answer;
        # 499 (nginx's "client closed request") in the access log and metrics, not a 500.
        return Response(status_code=499)
    metrics.FILES_UPLOADED_BYTES.inc(writer.size)
    return record.to_api()


@contextlib.asynccontextmanager
async def _slot(lease: UploadLease, settings: Settings) -> AsyncIterator[asyncio.Event]:
    """One of the tenant's upload slots (429 at FILES_MAX_CONCURRENT_UPLOADS), let go once
    the upload ended — after its row committed (set the event it yields then): see
    tierq/api/files/upload_lease.py."""
    most = settings.files_max_concurrent_uploads
    if not most and not settings.file_storage_quota_bytes:
        yield asyncio.Event()  # nothing to count among uploads: no slot, no Redis
        return
    if not await lease.take(most):
        raise Unread(
            APIError(
                429,
                f"Too many uploads in progress: this tenant may have {most} at once. Retry "
                "when one has ended.",
                "too_many_uploads",
                retry_after_s=1,
            )
        )
    committed = asyncio.Event()
    try:
        yield committed
    finally:
        await lease.release(committed.is_set())


async def _receive(
    request: Request, db: Database, settings: Settings, lease: UploadLease, writer: PartWriter
) -> Form:
    """Read the whole form, the file part into `writer`; a refusal before the body was
    read whole is raised as Unread."""
    try:
        await _refuse_early(request, writer.tenant_id, db, settings)
        await writer.prepare()
        async with lease.kept_alive(writer.touch):
            return await read_form(
                request.headers["content-type"],
                request.stream(),
                writer,
                max_fields=MAX_FIELDS,
                max_field_bytes=MAX_FIELD_BYTES,
            )
    except APIError as exc:
        raise Unread(exc) from None


async def _add(
    request: Request,
    tenant_id: str,
    db: Database,
    settings: Settings,
    file_id: str,
    purpose: str,
    writer: PartWriter,
    expires_after_s: int,
) -> FileRecord:
    async with db.transaction() as s:
        # The tenant's state as of now: a suspension or a revoked key refuses it.
        limited = _limited(settings)
        status = await lock_tenant(s, tenant_id, exclusive=limited, key_id=api_key_id(request))
        refuse_unless_active(status)
        if limited:
            _check_room(await file_repo.storage_used(s, tenant_id), writer.size, settings)
        return await file_repo.add_file(
            s,
            file_id,
            tenant_id,
            purpose,
            writer.filename,
            writer.size,
            expires_after_s=expires_after_s,
        )


def _purpose(form: Form) -> str:
    purpose = form.get("purpose")
    if not isinstance(purpose, str) or not purpose:
        raise APIError(400, "'purpose' is required.", "invalid_request", param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise APIError(
            400,
            f"purpose '{purpose}' is not supported here; use one of: {', '.join(UPLOAD_PURPOSES)}.",
            "invalid_purpose",
            param="purpose",
        )
    return purpose


def _filename(given: str) -> str:
    """The name kept for the file (checked before any of its bytes is written)."""
    filename = os.path.basename(given or "upload.jsonl")[:512] or "upload.jsonl"
    why = unstorable(filename)
    if why is not None:  # PostgreSQL cannot store it: a 400, not a 500 at the INSERT
        raise APIError(
            400, f"The file's name cannot be stored: {why}.", "invalid_request", param="file"
        )
    return filename


def _expires_after(form: Form, settings: Settings) -> int:
    """Seconds from now until the upload expires (0: never): what the client asked for,
    else FILE_EXPIRY_S (OpenAI: batch files expire after 30 days unless asked otherwise)."""
    asked = {key for key in form.names() if key.startswith("expires_after")}
    if not asked:
        return settings.file_expiry_s
    unknown = sorted(asked - {EXPIRES_ANCHOR, EXPIRES_SECONDS})
    if unknown:
        raise APIError(
            400, f"Unknown parameter '{unknown[0]}'.", "invalid_expires_after", param=unknown[0]
        )
    if form.get(EXPIRES_ANCHOR) != "created_at":
        raise APIError(
            400,
            f"'{EXPIRES_ANCHOR}' must be 'created_at'.",
            "invalid_expires_after",
            param=EXPIRES_ANCHOR,
        )
    seconds = _digits(form.get(EXPIRES_SECONDS))
    if seconds is None or not EXPIRES_MIN_S <= seconds <= EXPIRES_MAX_S:
        raise APIError(
            400,
            f"'{EXPIRES_SECONDS}' must be an integer from {EXPIRES_MIN_S} to {EXPIRES_MAX_S}.",
            "invalid_expires_after",
            param=EXPIRES_SECONDS,
        )
    return seconds


def _digits(value: object) -> int | None:
    """A non-negative integer written in ASCII digits (no sign, no space), at most 18 of
    them; None for anything else."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 18:
        return int(value)
    return None


def _limited(settings: Settings) -> bool:
    return bool(settings.file_storage_quota_bytes or settings.max_files_per_tenant)


def _check_room(used: file_repo.Storage, size: int, settings: Settings) -> None:
    """Refuse (413) a file of `size` bytes that would take the tenant past its file count or
    its storage quota (what `used` says it holds now)."""
    most = settings.max_files_per_tenant
    if most and used.files + 1 > most:
        raise APIError(
            413,
            f"The tenant holds {used.files} files, the most it may; delete some or let them "
            "expire.",
            "file_count_quota_exceeded",
        )
    quota = settings.file_storage_quota_bytes
    if quota and used.bytes + size > quota:
        raise APIError(
            413,
            f"The tenant's files take {used.bytes} of its {quota} bytes; {size} more do not "
            "fit. Delete files or let them expire.",
            "file_storage_quota_exceeded",
        )


async def _refuse_early(request: Request, tenant_id: str, db: Database, settings: Settings) -> None:
    """Before a byte is read: refuse an upload whose Content-Length alone (less the
    framing) cannot fit, or one past the file count. Without a lock: the decision that
    holds is the one in the transaction that adds the file."""
    if not _limited(settings):
        return
    size = _digits(request.headers.get("content-length")) or 0
    async with db.session() as s:
        used = await file_repo.storage_used(s, tenant_id)
    _check_room(used, max(0, size - FRAMING_BYTES), settings)


@router.get("", response_model=None, responses=answered(FileList))
async def list_files(
    tenant: TenantDep,
    parts: PartsDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    limit = min(limit, parts.settings.list_page_max)
    async with parts.db.session() as s:
        page, has_more = await file_repo.list_files(
            s, tenant.id, purpose=purpose, after=after, limit=limit, newest_first=order == "desc"
        )
    data = [f.to_api() for f in page]
    return list_page(data, has_more)


@router.get("/{file_id}", response_model=None, responses=answered(FileObject, 404))
async def get_file(file_id: str, tenant: TenantDep, parts: PartsDep) -> dict[str, Any]:
    async with parts.db.session() as s:
        record = await file_repo.get_file(s, file_id, tenant.id)
    if record is None:
        raise not_found("file", file_id)
    return record.to_api()


@router.get(
    "/{file_id}/content",
    response_model=None,
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string"}}}},
        **documented(404),
    },
)
async def file_content(file_id: str, tenant: TenantDep, parts: PartsDep) -> StreamingResponse:
    """The file's bytes, streamed from the file store as they are read."""
    async with parts.db.session() as s:
        record = await file_repo.get_file(s, file_id, tenant.id)
    if record is None:
        raise not_found("file", file_id)
    store = file_store(parts.settings)
    try:
        reader = await asyncio.to_thread(store.open, file_id)
    except FileNotFoundError:
        raise not_found("file", file_id) from None
    return StreamingResponse(
        _streamed(reader),
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(record.bytes),
            "Content-Disposition": content_disposition(record.filename),
        },
    )


def content_disposition(filename: str) -> str:
    """As Starlette's FileResponse writes it: RFC 5987's form for a name that needs it."""
    quoted = quote(filename)
    if quoted != filename:
        return f"attachment; filename*=utf-8''{quoted}"
    return f'attachment; filename="{filename}"'


async def _streamed(reader: BinaryIO) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(reader.read, READ_BUFFER):
            yield chunk
    finally:
        await asyncio.to_thread(reader.close)


@router.delete("/{file_id}", response_model=None, responses=answered(Deleted, 404, 409))
async def delete_file(file_id: str, tenant: TenantDep, parts: PartsDep) -> dict[str, Any]:
    async with parts.db.transaction() as s:
        if await file_repo.get_file(s, file_id, tenant.id) is None:
            raise not_found("file", file_id)
        in_use = await batch_repo.active_batch_reading(s, file_id)
        if in_use is not None:
            raise APIError(
                409,
                f"The file is the input of batch {in_use}, which is still running.",
                "file_in_use",
            )
        await file_repo.delete_file(s, file_id, tenant.id)
    await asyncio.to_thread(file_store(parts.settings).delete, [file_id])
    return {"id": file_id, "object": "file", "deleted": True}
