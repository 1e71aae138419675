"""Removal of expired files: their rows and their bytes in the file store (Celery beat, every
FILE_EXPIRY_INTERVAL_S).

The API stops showing a file the moment it expires; this only reclaims the space. A page
of expired files is deleted and their bytes removed inside one transaction, so a crash
at any point leaves rows to take again (idempotent; bytes already gone are fine), never
bytes that no row names. The input of a batch still in progress is left until the batch
ends (models.files.delete_expired).

It also removes the writes (uploads, batch outputs being written) that a crash left
behind: one untouched for FILES_PART_MAX_AGE_S — a `.part` file, or on S3 a multipart
upload whose last part is that old. An upload in progress touches its own every few
seconds (tierq/api/files/upload_lease.py) and a batch's writer touches both of its own every
page, so neither is ever one of them. And the orphans: a file committed (touched then)
whose row never did — its process killed between the two — is removed once it is that
old and still named by no row.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime

from tierq.core.file_store import FileStore, StoreUnavailable, file_store
from tierq.core.settings import Settings
from tierq.models import files as file_repo
from tierq.models.db import Database
from tierq.models.tables import utcnow

log = logging.getLogger(__name__)

PAGE = 500  # files removed per transaction


async def remove_expired_files(
    settings: Settings, db: Database, now: datetime | None = None
) -> list[str]:
    """Remove every file expired by `now` (default: now) that no active batch reads; the
    ids removed."""
    now = now or utcnow()
    store = file_store(settings)
    removed: list[str] = []
    while True:
        async with db.transaction() as s:
            ids = await file_repo.delete_expired(s, now, PAGE)
            await _delete(store, ids)
        removed += ids
        if len(ids) < PAGE:
            break
    if removed:
        log.info("removed %d expired files", len(removed), extra={"files": len(removed)})
    await asyncio.to_thread(remove_stale_parts, settings)
    await remove_orphans(settings, db)
    return removed


async def remove_orphans(settings: Settings, db: Database, now: float | None = None) -> list[str]:
    """Delete the stored files that no row names, last written FILES_PART_MAX_AGE_S or
    more before `now` (wall clock); their names."""
    store = file_store(settings)
    oldest = (time.time() if now is None else now) - settings.files_part_max_age_s
    old = await asyncio.to_thread(store.committed_before, oldest)
    removed: list[str] = []
    for start in range(0, len(old), PAGE):
        page = old[start : start + PAGE]
        async with db.session() as s:
            known = await file_repo.known_ids(s, page)
        gone = [name for name in page if name not in known]
        await _delete(store, gone)
        removed += gone
    if removed:
        log.warning(
            "removed %d files no row names (left by a crash)",
            len(removed),
            extra={"orphan_files": len(removed)},
        )
    return removed


async def _delete(store: FileStore, names: list[str]) -> None:
    """Delete the files; the ones the store refuses one by one (an object lock, a denied
    key) are logged and left — the orphan sweep tries them again — rather than holding
    up, run after run, the page they are in. A store that cannot be reached raises: the
    page's rows stay and are taken again."""
    try:
        await asyncio.to_thread(store.delete, names)
    except StoreUnavailable as exc:
        if not exc.failed:
            raise
        log.warning("the store kept %d files it was asked to delete: %s", len(exc.failed), exc)


def remove_stale_parts(settings: Settings, now: float | None = None) -> list[str]:
    """Remove the writes neither committed nor aborted, untouched for FILES_PART_MAX_AGE_S
    or more before `now` (wall clock; default: now); their names. Blocking."""
    oldest = (time.time() if now is None else now) - settings.files_part_max_age_s
    removed = file_store(settings).remove_incomplete(oldest)
    if removed:
        log.info("removed %d stale writes", len(removed), extra={"part_files": len(removed)})
    return removed
