"""Uploads cannot fill the disk before the quota applies, on the real API, PostgreSQL and
Redis: a chunked body (no Content-Length) is counted as it arrives and refused once past
the quota, before it was read whole; uploads in progress count against the quota together
and are bounded per tenant (429); batch outputs are kept and counted; `.part` files left by
a crash are swept, a fresh one is not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from tests.conftest import Platform
from tests.helpers import assert_openai_error, client
from tests.integration.batch_helpers import finished, jsonl, line, lines_of, sdk, submit
from tests.integration.celery_proc import CeleryWorker
from tests.integration.test_file_quotas import limit, on_disk, rows, upload
from tierq.core.settings import Settings
from tierq.workers.files_expiry import remove_expired_files

pytestmark = pytest.mark.integration

BOUNDARY = "tierqbounds"
CHUNK = 64 * 1024
FILE_HEAD = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"'
    "\r\nContent-Type: application/octet-stream\r\n\r\n"
).encode()
FILE_TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()
MIB = 1024 * 1024


def held_on_disk(settings: Settings) -> int:
    """Bytes of every file on the files volume, `.part` files included."""
    files_dir = settings.resolved_files_dir
    if not files_dir.exists():
        return 0
    held = 0
    for p in files_dir.iterdir():
        # the API renames or removes `.part` files while this counts: a file gone between
        # the listing and its stat holds nothing any more
        with contextlib.suppress(FileNotFoundError):
            held += p.stat().st_size if p.is_file() else 0
    return held


class Body:
    """A multipart upload sent in CHUNK pieces, with no Content-Length (chunked): it can
    stop after `pause_at` bytes of the file until `go` is set, and it records how much it
    sent and the most the files volume held meanwhile."""

    def __init__(
        self,
        settings: Settings,
        size: int,
        pause_at: int | None = None,
        go: asyncio.Event | None = None,
    ) -> None:
        self.settings, self.size, self.pause_at = settings, size, pause_at
        self.go = go or asyncio.Event()
        self.paused = asyncio.Event()
        self.sent = 0  # bytes of the file handed to the client
        self.done = False  # the whole body was handed out
        self.most_held = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield FILE_HEAD
        while self.sent < self.size:
            if self.pause_at is not None and self.sent >= self.pause_at and not self.go.is_set():
                self.paused.set()
                await self.go.wait()
            piece = min(CHUNK, self.size - self.sent)
            self.most_held = max(self.most_held, held_on_disk(self.settings))
            self.sent += piece
            yield b"x" * piece
        yield FILE_TAIL
        self.done = True

    async def post(self, c: httpx.AsyncClient) -> httpx.Response:
        return await c.post(
            "/v1/files",
            content=self.__aiter__(),
            headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
        )


class Chunked:
    """A multipart upload written by hand with Transfer-Encoding: chunked (no
    Content-Length), its answer read while it is still being sent — as a client that
    watches for an early answer does (httpx reads one only once the body is all sent)."""

    def __init__(self, platform: Platform, key: str, size: int) -> None:
        self.platform, self.key, self.size = platform, key, size
        self.sent = 0
        self.done = False
        self.most_held = 0

    async def post(self) -> tuple[int, dict[str, Any]]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.platform.port)
        head = (
            f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {self.key}"
            f"\r\nContent-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode()
        sending = asyncio.create_task(self._send(writer, head))
        try:
            status = int((await asyncio.wait_for(reader.readline(), 60)).split()[1])
            headers = {}
            while (raw := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = raw.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers["content-length"]))
            return status, json.loads(body)
        finally:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await sending
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, head: bytes) -> None:
        def chunk(data: bytes) -> bytes:
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        writer.write(head + chunk(FILE_HEAD))
        while self.sent < self.size:
            piece = min(CHUNK, self.size - self.sent)
            self.most_held = max(self.most_held, held_on_disk(self.platform.settings))
            writer.write(chunk(b"x" * piece))
            await writer.drain()
            self.sent += piece
        writer.write(chunk(FILE_TAIL) + b"0\r\n\r\n")
        await writer.drain()
        self.done = True


async def test_a_chunked_upload_past_the_quota_is_refused_before_it_is_read(
    platform: Platform, tenant_key: str
) -> None:
    quota = MIB
    limit(platform.settings, file_storage_quota_bytes=quota)
    upload = Chunked(platform, tenant_key, 200 * MIB)
    status, body = await upload.post()
    assert (status, body["error"]["code"]) == (413, "file_storage_quota_exceeded"), body
    # Answered long before the end of a body that nothing announced the size of.
    assert not upload.done and upload.sent < 50 * MIB, upload.sent
    assert upload.most_held <= quota + CHUNK, upload.most_held
    assert on_disk(platform.settings) == [] and await rows(platform) == {}


async def test_a_chunked_upload_past_the_file_size_limit_is_refused(
    platform: Platform, tenant_key: str, a: httpx.AsyncClient
) -> None:
    limit(platform.settings, file_storage_quota_bytes=0, max_upload_bytes=MIB)
    upload = Chunked(platform, tenant_key, 200 * MIB)
    status, body = await upload.post()
    assert (status, body["error"]["code"]) == (413, "file_too_large"), body
    assert not upload.done and upload.sent < 50 * MIB, upload.sent
    assert on_disk(platform.settings) == [] and await rows(platform) == {}
    small = await Body(platform.settings, MIB).post(a)  # exactly the limit: taken
    assert small.status_code == 200, small.text
    assert small.json()["bytes"] == MIB


async def test_an_upload_slower_than_its_time_limit_is_refused_and_leaves_nothing(
    platform: Platform, a: httpx.AsyncClient
) -> None:
    """FILES_UPLOAD_MAX_S after its first bytes were stored, an upload still arriving is
    refused with a 400 (a 408 the SDKs would retry as slowly): an object store dates a
    multipart object from its start, and a slower one could look old enough to the orphan
    sweep while its row commits."""
    limit(platform.settings, files_upload_max_s=1.0)
    slow = Body(platform.settings, 3 * MIB, pause_at=2 * MIB)  # past the first write
    sending = asyncio.create_task(slow.post(a))
    await asyncio.wait_for(slow.paused.wait(), 10)
    await asyncio.sleep(1.5)  # past FILES_UPLOAD_MAX_S
    slow.go.set()
    refused = await sending
    assert_openai_error(refused, 400, "upload_too_slow")
    assert on_disk(platform.settings) == [] and await rows(platform) == {}


async def test_uploads_in_progress_count_against_the_quota_together(
    platform: Platform, tenant_key: str, a: httpx.AsyncClient
) -> None:
    """Each fits alone, not both: the second is refused while the first is still being
    sent (its bytes in flight count), and no more than the quota is ever on disk."""
    quota = 4 * MIB
    limit(platform.settings, file_storage_quota_bytes=quota)
    first = Body(platform.settings, 3 * MIB, pause_at=5 * MIB // 2)
    sending = asyncio.create_task(first.post(a))
    await asyncio.wait_for(first.paused.wait(), 10)
    await _until_uploads(platform, lambda n, held: held >= 2 * MIB)  # what was sent counts
    second = Chunked(platform, tenant_key, 3 * MIB)
    status, body = await second.post()
    assert (status, body["error"]["code"]) == (413, "file_storage_quota_exceeded"), body
    assert not sending.done()  # decided while the first was still in progress
    first.go.set()
    taken = await sending
    assert taken.status_code == 200, taken.text
    assert on_disk(platform.settings) == [taken.json()["id"]]
    assert await rows(platform) == {taken.json()["id"]: 3 * MIB}
    assert max(first.most_held, second.most_held) <= quota


async def test_a_tenant_has_at_most_its_bound_of_uploads_in_progress(
    platform: Platform, a: httpx.AsyncClient, b: httpx.AsyncClient
) -> None:
    assert platform.settings.files_max_concurrent_uploads == 2  # the default
    go = asyncio.Event()
    bodies = [Body(platform.settings, MIB, pause_at=MIB // 2, go=go) for _ in range(2)]
    sending = [asyncio.create_task(body.post(a)) for body in bodies]
    for body in bodies:
        await asyncio.wait_for(body.paused.wait(), 10)
    await _until_uploads(platform, lambda n, held: n == 2)  # both hold their slots
    third = await upload(a, 100)
    assert_openai_error(third, 429, "too_many_uploads")
    assert third.headers["Retry-After"] == "1"
    assert (await upload(b, 100)).status_code == 200  # another tenant's bound is its own
    go.set()
    assert [(await t).status_code for t in sending] == [200, 200]
    assert (await upload(a, 100)).status_code == 200  # the slots were let go


async def test_a_batch_output_is_kept_past_the_quota_and_counted(
    platform: Platform, tenant_key: str
) -> None:
    """The rule for batch outputs: never lost, always counted — the tenant's later uploads
    are refused until it deletes files."""
    platform.start_dispatcher()
    await platform.start_worker("w1")
    celery = CeleryWorker(platform.settings)
    celery.start()
    try:
        openai = sdk(platform, tenant_key)
        data = jsonl([line("one"), line("two")])
        limit(platform.settings, file_storage_quota_bytes=len(data) + 10, max_files_per_tenant=2)
        batch = await submit(openai, data)
        done = await finished(openai, batch.id, celery)
    finally:
        celery.stop()
    assert done.status == "completed" and done.output_file_id
    assert len(await lines_of(openai, done.output_file_id)) == 2
    stored = await rows(platform)
    assert sum(stored.values()) > len(data) + 10  # past the quota: kept all the same
    async with client(platform.url, tenant_key) as c:
        assert_openai_error(await upload(c, 1), 413, "file_count_quota_exceeded")
        limit(platform.settings, max_files_per_tenant=0)
        assert_openai_error(await upload(c, 1), 413, "file_storage_quota_exceeded")
        assert (await c.delete(f"/v1/files/{done.output_file_id}")).status_code == 200
        assert (await upload(c, 5)).status_code == 200  # room again


async def _until_uploads(
    platform: Platform, done: Callable[[int, int], bool], timeout_s: float = 10
) -> None:
    """Until the (one) tenant's uploads in progress as Redis holds them — how many, the
    bytes they hold — satisfy `done`."""
    prefix = platform.settings.redis_prefix
    deadline = time.monotonic() + timeout_s
    while True:
        slots = [k async for k in platform.r.scan_iter(match=f"{prefix}:tenant:*:uploads")]
        held = [k async for k in platform.r.scan_iter(match=f"{prefix}:tenant:*:uploads:bytes")]
        n = reserved = 0
        for k in slots:
            n += int(await platform.r.zcard(k))
        for k in held:
            reserved += sum(int(v) for v in (await platform.r.hgetall(k)).values())  # type: ignore[misc]
        if done(n, reserved):
            return
        assert time.monotonic() < deadline, (n, reserved)
        await asyncio.sleep(0.05)


async def test_old_part_files_and_orphans_are_swept_and_fresh_ones_kept(
    platform: Platform, tenant_key: str
) -> None:
    """Left by a crash: an upload's `.part` untouched for FILES_PART_MAX_AGE_S, and a file
    renamed into place whose row never committed (an orphan) — both removed once that old.
    A `.part` still written, a fresh orphan (its commit may be under way) and a stored
    file however old (the expiry's to decide) stay."""
    settings = platform.settings
    files_dir = settings.resolved_files_dir
    files_dir.mkdir(parents=True, exist_ok=True)
    async with client(platform.url, tenant_key) as c:
        stored = (await upload(c, 10)).json()["id"]
    old, fresh = files_dir / "file_crashed.part", files_dir / "file_writing.part"
    orphan, young_orphan = files_dir / "file_orphan", files_dir / "file_committing"
    for path in (old, fresh, orphan, young_orphan):
        path.write_bytes(b"x" * 10)
    long_ago = time.time() - settings.files_part_max_age_s - 60
    for path in (old, orphan, files_dir / stored):
        os.utime(path, (long_ago, long_ago))
    assert await remove_expired_files(settings, platform.db) == []
    assert on_disk(settings) == sorted([fresh.name, young_orphan.name, stored])


async def test_a_client_that_hangs_up_mid_upload_leaves_nothing_and_no_error(
    platform: Platform, tenant_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Half a body, then the connection closed: no file, no row, its slot given back (the
    tenant uploads again at once), and no 'unhandled error' in the API's log."""
    limit(platform.settings, file_storage_quota_bytes=8 * MIB)
    caplog.set_level("ERROR")
    _reader, writer = await asyncio.open_connection("127.0.0.1", platform.port)
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {tenant_key}"
        f"\r\nContent-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        f"Content-Length: {len(FILE_HEAD) + 4 * MIB + len(FILE_TAIL)}\r\n\r\n"
    ).encode()
    writer.write(head + FILE_HEAD + b"x" * (2 * MIB))
    await writer.drain()
    await _until_uploads(platform, lambda n, held: n == 1 and held >= MIB)
    writer.close()  # gone, mid-file
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    await _until_uploads(platform, lambda n, held: n == 0)
    assert on_disk(platform.settings) == [] and await rows(platform) == {}
    async with client(platform.url, tenant_key) as c:
        assert (await upload(c, 100)).status_code == 200
    assert not [r for r in caplog.records if "unhandled error" in r.getMessage()]
