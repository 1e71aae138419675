"""Clearing up after a write of the file store that is not to be kept: an upload that
failed, a batch's outputs another holder closed first."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from tierq.core.file_store import FileStore, Writer
from tierq.models import files as file_repo
from tierq.models.db import Database

log = logging.getLogger(__name__)


async def forget(
    store: FileStore, db: Database, writers: Iterable[Writer], stored: list[str]
) -> None:
    """Leave nothing of them: each write aborted, and each file `stored` (committed to the
    store) deleted unless a row names it — a COMMIT whose reply was lost may have written
    one. Best effort, each on its own: the failure that brought the caller here is the one
    to report, and what is left (a store or a database that refuses now), the expiry
    task's sweeps remove."""
    for writer in writers:
        try:
            await asyncio.to_thread(writer.abort)
        except Exception as exc:
            log.warning("could not abort a write of the file store (the sweep will): %s", exc)
    if not stored:
        return
    try:
        async with db.session() as s:
            named = await file_repo.known_ids(s, stored)
        await asyncio.to_thread(store.delete, [name for name in stored if name not in named])
    except Exception as exc:
        log.warning("could not delete files not kept (the orphan sweep will): %s", exc)
