"""The file part of an upload, written straight to the file store as it arrives (a `.part`
file, or an S3 multipart upload): counted byte by byte, refused (413) as soon as the count
passes the per-file maximum or what the tenant may still store, and never more stored than
its reservation among the tenant's uploads in progress (tierq/api/files/upload_lease.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tierq.api.errors import APIError
from tierq.api.files.upload_lease import Reserved, UploadLease
from tierq.core.file_store import FileStore, Writer
from tierq.core.settings import Settings
from tierq.models import files as file_repo
from tierq.models.db import Database

FLUSH_BYTES = 1024 * 1024  # bytes held in memory before they are written
# Bytes received beyond the reservation before it is raised: what another upload of the
# tenant may not see of this one's (one Redis call per step, not per network read).
RESERVE_STEP = 256 * 1024
FRESH_S = 2.0  # a committed-storage figure older than this is read again
RESERVE_TRIES = 20  # stale figures in a row (uploads committed meanwhile) before a 503
# A refusal that only other uploads in progress cause (the committed bytes alone leave
# room) is asked again after this, a few times: one that has just committed holds its
# reservation until it lets its slot go, counted twice for that moment.
CROWDED_WAIT_S = 0.1
CROWDED_TRIES = 5


class PartWriter:
    """A multipart FileSink for one upload of one tenant, file `name` in `store`. `prepare`
    before the body is read; after it: `commit`, or on failure abort its `writes`."""

    def __init__(
        self,
        store: FileStore,
        name: str,
        settings: Settings,
        db: Database,
        tenant_id: str,
        lease: UploadLease,
        check_name: Callable[[str], str],
    ) -> None:
        self.store, self.name, self.settings, self.db = store, name, settings, db
        self.tenant_id, self.lease, self.check_name = tenant_id, lease, check_name
        self.filename = ""
        self.size = 0  # bytes of the file received so far (written or buffered)
        self._buffer = bytearray()
        self._out: Writer | None = None  # made with the first bytes to store
        self._reserved = 0  # bytes this upload holds among the tenant's uploads in progress
        self._may_hold: int | None = None  # the most this upload may hold, as of the last grant
        self._room: int | None = None  # the quota less the committed bytes, read after...
        self._ended = "0"  # ...this value of the tenant's `ended` counter
        self._read_at = 0.0
        self._started: float | None = None  # when its first bytes were stored

    async def prepare(self) -> None:
        """Learn what this upload may hold before its first byte (0 bytes reserved)."""
        await self._reserve(0)

    def begin(self, filename: str) -> None:
        self.filename = self.check_name(filename)

    async def write(self, data: bytes) -> None:
        self.size += len(data)
        self._in_time()
        most = self.settings.max_upload_bytes
        if most and self.size > most:
            raise APIError(
                413,
                f"The file exceeds {most} bytes, the most one upload may hold.",
                "file_too_large",
            )
        self._buffer += data
        # Past what was granted: checked now (the tenant may have made room meanwhile).
        if self.size - self._reserved >= RESERVE_STEP or (
            self._may_hold is not None and self.size > self._may_hold
        ):
            await self._reserve(self.size)
        if len(self._buffer) >= FLUSH_BYTES:
            await self._flush()

    async def end(self) -> None:
        self._in_time()
        await self._flush()
        if self._out is None:  # an empty file is a file too
            self._out = await asyncio.to_thread(self.store.create, self.name)

    def _in_time(self) -> None:
        """Refuse an upload past FILES_UPLOAD_MAX_S since its first bytes were stored: a
        400, not a 408, which the OpenAI SDKs would send again as slowly."""
        most = self.settings.upload_time_limit_s
        if self._started is not None and time.monotonic() - self._started > most:
            raise APIError(
                400,
                f"The upload took longer than {most:g} s, the most one may take; send it "
                "again at a faster rate.",
                "upload_too_slow",
            )

    def touch(self) -> None:
        """The write's sign of life (blocking: call it in a thread)."""
        if self._out is not None:
            self._out.touch()

    async def commit(self) -> None:
        """The file, whole, under its name (after `end`)."""
        assert self._out is not None, "committed before its end"
        await asyncio.to_thread(self._out.commit)

    @property
    def writes(self) -> list[Writer]:
        """Its write of the store, once its first bytes were stored (to abort on failure)."""
        return [] if self._out is None else [self._out]

    async def _flush(self) -> None:
        if not self._buffer:
            return
        if self.size > self._reserved:  # never more stored than reserved
            await self._reserve(self.size)
        if self._out is None:
            self._out = await asyncio.to_thread(self.store.create, self.name)
            self._started = time.monotonic()
        chunk = bytes(self._buffer)
        self._buffer.clear()
        await asyncio.to_thread(self._out.write, chunk)

    async def _reserve(self, total: int) -> None:
        """Hold `total` bytes among the tenant's uploads in progress, or refuse (413)."""
        quota = self.settings.file_storage_quota_bytes
        if not quota:
            self._reserved = total
            return
        crowded = 0
        for _ in range(RESERVE_TRIES):
            fresh = self._room is None or time.monotonic() - self._read_at > FRESH_S
            if fresh:
                await self._read_room(quota)
            assert self._room is not None
            got = await self.lease.reserve(total, self._room, self._ended)
            if got is Reserved.LAPSED:
                raise APIError(
                    503,
                    "The upload lost its slot (the platform could not renew it); retry.",
                    "upload_interrupted",
                    retry_after_s=1,
                )
            if got is Reserved.NO_ROOM and fresh and total <= self._room:
                crowded += 1
                if crowded <= CROWDED_TRIES:  # other uploads in flight: ask again shortly
                    await asyncio.sleep(CROWDED_WAIT_S)
                    self._room = None
                    continue
            if got is Reserved.NO_ROOM and fresh:
                raise APIError(
                    413,
                    f"The tenant's files and uploads in progress leave less than {total} "
                    f"bytes of its {quota}; delete files or let them expire.",
                    "file_storage_quota_exceeded",
                )
            if isinstance(got, int):
                self._reserved, self._may_hold = total, got
                return
            self._room = None  # stale, or refused on an old figure: read it again
        raise APIError(
            503,
            "The tenant's uploads changed too often to count; retry.",
            "upload_busy",
            retry_after_s=1,
        )

    async def _read_room(self, quota: int) -> None:
        # The counter first: a commit after this read bumps it, and the grant is refused.
        self._ended = await self.lease.ended()
        async with self.db.session() as s:
            used = await file_repo.storage_used(s, self.tenant_id)
        self._room, self._read_at = quota - used.bytes, time.monotonic()
