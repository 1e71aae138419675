"""Files (OpenAI's Files API): every SQL statement about them. Their bytes are on disk."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from models.pages import after_anchor
from models.records import FileRecord
from models.tables import File, utcnow


async def add_file(
    s: AsyncSession, file_id: str, tenant_id: str, purpose: str, filename: str, size: int
) -> FileRecord:
    row = File(
        id=file_id,
        tenant_id=tenant_id,
        purpose=purpose,
        filename=filename,
        bytes=size,
        created_at=utcnow(),
    )
    s.add(row)
    await s.flush()
    return FileRecord.from_row(row)


async def get_file(
    s: AsyncSession, file_id: str, tenant_id: str | None = None
) -> FileRecord | None:
    stmt = select(File).where(File.id == file_id)
    if tenant_id is not None:
        stmt = stmt.where(File.tenant_id == tenant_id)
    row = (await s.execute(stmt)).scalar_one_or_none()
    return None if row is None else FileRecord.from_row(row)


async def list_files(
    s: AsyncSession,
    tenant_id: str,
    *,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = 20,
    newest_first: bool = True,
) -> tuple[list[FileRecord], bool]:
    """One page of the tenant's files; `after` is the id of the last file of the previous page."""
    stmt = select(File).where(File.tenant_id == tenant_id)
    if purpose is not None:
        stmt = stmt.where(File.purpose == purpose)
    anchor = None
    if after is not None:
        found = await get_file(s, after, tenant_id)
        if found is None:
            return [], False
        anchor = (found.created_at, found.id)
    stmt = after_anchor(stmt, File.created_at, File.id, anchor, limit, newest_first)
    rows = list((await s.execute(stmt)).scalars())
    return [FileRecord.from_row(r) for r in rows[:limit]], len(rows) > limit


async def delete_file(s: AsyncSession, file_id: str, tenant_id: str) -> bool:
    result = await s.execute(delete(File).where(File.id == file_id, File.tenant_id == tenant_id))
    return bool(result.rowcount)  # type: ignore[attr-defined]
