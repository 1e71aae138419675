"""OpenAI's Files API: uploads streamed to the files volume, downloads streamed back."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile

from api.deps import DbDep, SettingsDep, TenantDep
from api.errors import APIError, not_found
from api.pages import list_page
from models import batches as batch_repo
from models import files as file_repo
from models.tenants import new_id
from tierq import metrics
from tierq.settings import Settings

router = APIRouter(prefix="/v1/files", tags=["files"])

UPLOAD_PURPOSES = ("batch",)
COPY_CHUNK = 1024 * 1024


@router.post("")
async def create_file(
    request: Request, tenant: TenantDep, db: DbDep, settings: SettingsDep
) -> dict[str, Any]:
    """multipart/form-data with `file` and `purpose` (OpenAI's contract)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(
            415,
            "Upload a file as multipart/form-data with 'file' and 'purpose'.",
            "invalid_content_type",
        )
    # Starlette spools a file part to a temporary file beyond 1 MB: never whole in memory.
    async with request.form(max_files=1, max_fields=8) as form:
        purpose = form.get("purpose")
        upload = form.get("file")
        if not isinstance(purpose, str) or not purpose:
            raise APIError(400, "'purpose' is required.", "invalid_request", param="purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(
                400,
                f"purpose '{purpose}' is not supported here; "
                f"use one of: {', '.join(UPLOAD_PURPOSES)}.",
                "invalid_purpose",
                param="purpose",
            )
        if not isinstance(upload, UploadFile):
            raise APIError(400, "'file' must be a file part.", "invalid_request", param="file")
        file_id = new_id("file")
        size = await _store(upload, settings, file_id)
        filename = os.path.basename(upload.filename or "upload.jsonl")[:512] or "upload.jsonl"
    try:
        async with db.transaction() as s:
            record = await file_repo.add_file(s, file_id, tenant.id, purpose, filename, size)
    except BaseException:
        _path(settings, file_id).unlink(missing_ok=True)
        raise
    metrics.FILES_UPLOADED_BYTES.inc(size)
    return record.to_api()


async def _store(upload: UploadFile, settings: Settings, file_id: str) -> int:
    target = _path(settings, file_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    size = 0
    try:
        with part.open("wb") as out:
            while chunk := await upload.read(COPY_CHUNK):
                size += len(chunk)
                await asyncio.to_thread(out.write, chunk)
        part.rename(target)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return size


def _path(settings: Settings, file_id: str) -> Path:
    return settings.resolved_files_dir / file_id


@router.get("")
async def list_files(
    tenant: TenantDep,
    db: DbDep,
    settings: SettingsDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    limit = min(limit, settings.list_page_max)
    async with db.session() as s:
        page, has_more = await file_repo.list_files(
            s, tenant.id, purpose=purpose, after=after, limit=limit, newest_first=order == "desc"
        )
    data = [f.to_api() for f in page]
    return list_page(data, has_more)


@router.get("/{file_id}")
async def get_file(file_id: str, tenant: TenantDep, db: DbDep) -> dict[str, Any]:
    async with db.session() as s:
        record = await file_repo.get_file(s, file_id, tenant.id)
    if record is None:
        raise not_found("file", file_id)
    return record.to_api()


@router.get("/{file_id}/content", response_model=None)
async def file_content(
    file_id: str, tenant: TenantDep, db: DbDep, settings: SettingsDep
) -> FileResponse:
    async with db.session() as s:
        record = await file_repo.get_file(s, file_id, tenant.id)
    path = _path(settings, file_id)
    if record is None or not path.exists():
        raise not_found("file", file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=record.filename)


@router.delete("/{file_id}")
async def delete_file(
    file_id: str, tenant: TenantDep, db: DbDep, settings: SettingsDep
) -> dict[str, Any]:
    async with db.transaction() as s:
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
    _path(settings, file_id).unlink(missing_ok=True)
    return {"id": file_id, "object": "file", "deleted": True}
