"""Removal of expired files: their rows and their bytes on disk (Celery beat, every
FILE_EXPIRY_INTERVAL_S).

The API stops showing a file the moment it expires; this only reclaims the space. A page
of expired files is deleted and their bytes unlinked inside one transaction, so a crash
at any point leaves rows to take again (idempotent; bytes already gone are fine), never
bytes that no row names. The input of a batch still in progress is left until the batch
ends (models.files.delete_expired).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from pathlib import Path

from models import files as file_repo
from models.db import Database
from models.tables import utcnow
from tierq.settings import Settings

log = logging.getLogger(__name__)

PAGE = 500  # files removed per transaction


async def remove_expired_files(
    settings: Settings, db: Database, now: datetime | None = None
) -> list[str]:
    """Remove every file expired by `now` (default: now) that no active batch reads; the
    ids removed."""
    now = now or utcnow()
    removed: list[str] = []
    while True:
        async with db.transaction() as s:
            ids = await file_repo.delete_expired(s, now, PAGE)
            await asyncio.to_thread(_unlink, settings.resolved_files_dir, ids)
        removed += ids
        if len(ids) < PAGE:
            break
    if removed:
        log.info("removed %d expired files", len(removed), extra={"files": len(removed)})
    return removed


def _unlink(files_dir: Path, ids: list[str]) -> None:
    for file_id in ids:
        (files_dir / file_id).unlink(missing_ok=True)
