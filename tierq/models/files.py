"""Files (OpenAI's Files API): every SQL statement about them. Their bytes are on disk.

A file whose `expires_at` has passed is gone for its tenant at once: every read here
leaves it out (the input of a running batch is read with `include_expired`), and it
counts against no quota. Its row and bytes stay until `delete_expired` removes them,
which never touches the input of a batch still in progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, delete, exists, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from tierq.models.batches import ACTIVE
from tierq.models.pages import after_anchor
from tierq.models.records import FileRecord
from tierq.models.tables import Batch, File, utcnow


@dataclass(frozen=True)
class Storage:
    """What a tenant holds: its live files and their bytes."""

    files: int
    bytes: int


def _live(now: datetime) -> ColumnElement[bool]:
    return or_(File.expires_at.is_(None), File.expires_at > now)


async def add_file(
    s: AsyncSession,
    file_id: str,
    tenant_id: str,
    purpose: str,
    filename: str,
    size: int,
    *,
    expires_after_s: int = 0,
) -> FileRecord:
    """A file row; it expires `expires_after_s` after its creation (0: never).

    No quota is checked here: an upload checks its own under the tenant's lock first. A
    batch's output and error files are added without a check, on purpose: the work is done
    and paid for, so they are always kept — and counted like any file (`storage_used`), so
    a tenant they take past its quota has its next uploads refused until it deletes files
    or they expire."""
    now = utcnow()
    row = File(
        id=file_id,
        tenant_id=tenant_id,
        purpose=purpose,
        filename=filename,
        bytes=size,
        created_at=now,
        expires_at=now + timedelta(seconds=expires_after_s) if expires_after_s else None,
    )
    s.add(row)
    await s.flush()
    return FileRecord.from_row(row)


async def storage_used(s: AsyncSession, tenant_id: str) -> Storage:
    """The tenant's live files (uploads and batch outputs alike) and their bytes. Under the
    tenant's row lock this is exact for the rest of the transaction (uploads take it)."""
    stmt = select(func.count(), func.coalesce(func.sum(File.bytes), 0)).where(
        File.tenant_id == tenant_id, _live(utcnow())
    )
    count, size = (await s.execute(stmt)).one()
    return Storage(int(count), int(size))


async def get_file(
    s: AsyncSession,
    file_id: str,
    tenant_id: str | None = None,
    *,
    include_expired: bool = False,
) -> FileRecord | None:
    """A file, or None; an expired one only with `include_expired` (a running batch still
    reads its input after the file expired)."""
    stmt = select(File).where(File.id == file_id)
    if tenant_id is not None:
        stmt = stmt.where(File.tenant_id == tenant_id)
    if not include_expired:
        stmt = stmt.where(_live(utcnow()))
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
    stmt = select(File).where(File.tenant_id == tenant_id, _live(utcnow()))
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


async def known_ids(s: AsyncSession, ids: list[str]) -> set[str]:
    """Those of `ids` that name a file row (expired or not)."""
    if not ids:
        return set()
    rows = await s.execute(select(File.id).where(File.id.in_(ids)))
    return {file_id for (file_id,) in rows}


async def delete_expired(s: AsyncSession, now: datetime, limit: int) -> list[str]:
    """Delete up to `limit` files expired by `now` that no active batch reads; their ids.
    The caller removes their bytes before it commits, so a failure in between leaves rows
    (taken again next time), never bytes without a row. Two callers at once delete each
    row once: the second finds it gone when the first commits."""

    def removable(f: type[File]) -> tuple[ColumnElement[bool], ...]:
        in_use = exists().where(Batch.input_file_id == f.id, Batch.status.in_(ACTIVE))
        return f.expires_at.is_not(None), f.expires_at <= now, ~in_use

    # The page is picked from an alias: a subquery over `files` itself would be correlated
    # with the DELETE's own row.
    picked = aliased(File)
    page = select(picked.id).where(*removable(picked)).order_by(picked.expires_at).limit(limit)
    stmt = (
        delete(File)
        .where(File.id.in_(page.scalar_subquery()), *removable(File))
        .returning(File.id)
        .execution_options(synchronize_session=False)
    )
    return list((await s.execute(stmt)).scalars())
