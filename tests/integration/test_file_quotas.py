"""Per-tenant file storage quotas and file expiry, on the real PostgreSQL and Redis: a refused
upload leaves nothing behind, concurrent uploads never pass the quota, expired files are gone
from the API at once, and the removal task deletes their rows and bytes — never the input of
a batch still in progress, never another tenant's file."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from sqlalchemy import func, select, update

from tests.conftest import Platform
from tests.helpers import assert_openai_error
from tests.integration.batch_helpers import finished, jsonl, line, lines_of, submit
from tests.integration.celery_proc import CeleryWorker
from tierq.core.settings import Settings
from tierq.core.states import BatchStatus
from tierq.models import batches as batch_repo
from tierq.models.tables import File, utcnow
from tierq.workers.files_expiry import remove_expired_files

pytestmark = pytest.mark.integration

DAY = 86_400


def limit(settings: Settings, **values: Any) -> None:
    """Set limits on the running API's settings (the app holds this very object)."""
    for name, value in values.items():
        setattr(settings, name, value)


async def upload(c: httpx.AsyncClient, size: int, **form: str) -> httpx.Response:
    return await c.post(
        "/v1/files",
        files={"file": ("in.jsonl", b"x" * size)},
        data={"purpose": "batch", **form},
    )


def on_disk(settings: Settings) -> list[str]:
    files_dir = settings.resolved_files_dir
    return sorted(p.name for p in files_dir.iterdir()) if files_dir.exists() else []


async def rows(platform: Platform) -> dict[str, int]:
    """Every file row: id -> bytes."""
    async with platform.db.session() as s:
        return dict((await s.execute(select(File.id, File.bytes))).tuples().all())


async def expire(platform: Platform, *file_ids: str) -> None:
    """Move files' expiry into the past (as if their time had come)."""
    async with platform.db.transaction() as s:
        await s.execute(
            update(File)
            .where(File.id.in_(file_ids))
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )


async def test_an_upload_past_the_quota_is_refused_and_leaves_nothing(
    platform: Platform, a: httpx.AsyncClient, b: httpx.AsyncClient
) -> None:
    limit(platform.settings, file_storage_quota_bytes=1000)
    first = await upload(a, 600)
    assert first.status_code == 200, first.text
    # Decided under the tenant's lock, after the bytes were spooled.
    assert_openai_error(await upload(a, 600), 413, "file_storage_quota_exceeded")
    # Decided by Content-Length alone, before the body is read.
    assert_openai_error(await upload(a, 200_000), 413, "file_storage_quota_exceeded")
    assert on_disk(platform.settings) == [first.json()["id"]]
    assert await rows(platform) == {first.json()["id"]: 600}
    # What is left still fits; the other tenant has a quota of its own.
    assert (await upload(a, 400)).status_code == 200
    assert_openai_error(await upload(a, 1), 413, "file_storage_quota_exceeded")
    assert (await upload(b, 1000)).status_code == 200
    # Deleting a file makes room.
    assert (await a.delete(f"/v1/files/{first.json()['id']}")).status_code == 200
    assert (await upload(a, 600)).status_code == 200
    assert sum((await rows(platform)).values()) == 1000 + 1000
    limit(platform.settings, file_storage_quota_bytes=0)  # 0: no limit
    assert (await upload(a, 5000)).status_code == 200


async def raw_upload(
    platform: Platform, key: str, filename: str, content: bytes, length: int | None = None
) -> bytes:
    """POST /v1/files written by hand (a name httpx would escape, a Content-Length that
    announces more than is sent); the status line of the answer."""
    boundary = "tierqboundary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"'
        "\r\nContent-Type: application/octet-stream\r\n\r\n"
    ).encode() + content
    if length is None:
        body += f"\r\n--{boundary}--\r\n".encode()
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {length or len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", platform.port)
    try:
        writer.write(head + body)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()


async def test_a_refusal_by_content_length_comes_before_the_body_is_read(
    platform: Platform, tenant_key: str
) -> None:
    """Only the headers and a first chunk are sent: the refusal cannot have waited for the
    rest of a body announced at 10 MB."""
    limit(platform.settings, file_storage_quota_bytes=1000)
    status = await raw_upload(platform, tenant_key, "a.jsonl", b"x" * 1000, length=10_000_000)
    assert status.split()[1] == b"413", status
    assert on_disk(platform.settings) == [] and await rows(platform) == {}


async def test_a_file_name_postgresql_cannot_store_is_a_400(
    platform: Platform, tenant_key: str
) -> None:
    status = await raw_upload(platform, tenant_key, "a\x00b.jsonl", b"{}\n")
    assert status.split()[1] == b"400", status
    assert on_disk(platform.settings) == [] and await rows(platform) == {}


async def test_concurrent_uploads_never_pass_the_quota(
    platform: Platform, a: httpx.AsyncClient
) -> None:
    # All eight at once (the bound on concurrent uploads is tests/.../test_upload_bounds.py's).
    limit(
        platform.settings, file_storage_quota_bytes=3 * 1000 + 500, files_max_concurrent_uploads=0
    )
    answers = await asyncio.gather(*(upload(a, 1000) for _ in range(8)))
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200] * 3 + [413] * 5, [r.text for r in answers]
    for refused in (r for r in answers if r.status_code == 413):
        assert_openai_error(refused, 413, "file_storage_quota_exceeded")
    kept = sorted(r.json()["id"] for r in answers if r.status_code == 200)
    assert on_disk(platform.settings) == kept  # no refused bytes, no .part left
    assert await rows(platform) == dict.fromkeys(kept, 1000)


async def test_the_file_count_is_capped_per_tenant(
    platform: Platform, a: httpx.AsyncClient, b: httpx.AsyncClient
) -> None:
    limit(platform.settings, max_files_per_tenant=2)
    ids = [(await upload(a, 10)).json()["id"] for _ in range(2)]
    assert_openai_error(await upload(a, 10), 413, "file_count_quota_exceeded")
    assert sorted(on_disk(platform.settings)) == sorted(ids)
    assert (await upload(b, 10)).status_code == 200  # a count of its own
    assert (await a.delete(f"/v1/files/{ids[0]}")).status_code == 200
    assert (await upload(a, 10)).status_code == 200
    # An expired file no longer counts, even before the removal task runs.
    await expire(platform, ids[1])
    assert (await upload(a, 10)).status_code == 200
    assert_openai_error(await upload(a, 10), 413, "file_count_quota_exceeded")


async def test_expires_after_round_trips_through_the_sdk(
    platform: Platform, tenant_key: str
) -> None:
    sdk = AsyncOpenAI(base_url=f"{platform.url}/v1", api_key=tenant_key, max_retries=0)
    asked = await sdk.files.create(
        file=("a.jsonl", b"{}\n"),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert asked.expires_at == asked.created_at + 3600
    assert (await sdk.files.retrieve(asked.id)).expires_at == asked.expires_at
    assert [f.expires_at async for f in await sdk.files.list()] == [asked.expires_at]
    longest = await sdk.files.create(
        file=("b.jsonl", b"{}\n"),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 30 * DAY},
    )
    assert longest.expires_at == longest.created_at + 30 * DAY
    # Not asked: FILE_EXPIRY_S (30 days by default, as OpenAI does for purpose batch).
    assert platform.settings.file_expiry_s == 30 * DAY
    default = await sdk.files.create(file=("c.jsonl", b"{}\n"), purpose="batch")
    assert default.expires_at == default.created_at + 30 * DAY
    limit(platform.settings, file_expiry_s=0)  # 0: never
    never = await sdk.files.create(file=("d.jsonl", b"{}\n"), purpose="batch")
    assert never.expires_at is None


@pytest.mark.parametrize(
    ("form", "param"),
    [
        ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, "anchor"),
        ({"expires_after[seconds]": "3600"}, "anchor"),
        ({"expires_after[anchor]": "created_at"}, "seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"}, "seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "-3600"}, "seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600.5"}, "seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "٣٦٠٠"}, "seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "9" * 5000}, "seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": ""}, "seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[days]": "1"}, "days"),
    ],
)
async def test_expires_after_is_validated(
    platform: Platform, a: httpx.AsyncClient, form: dict[str, str], param: str
) -> None:
    resp = await upload(a, 10, **form)
    assert_openai_error(resp, 400, "invalid_expires_after")
    assert resp.json()["error"]["param"] == f"expires_after[{param}]"
    assert on_disk(platform.settings) == [] and await rows(platform) == {}


async def test_expired_files_are_gone_at_once_and_removed_except_a_running_batchs_input(
    platform: Platform, a: httpx.AsyncClient, b: httpx.AsyncClient
) -> None:
    plain, read, gone, fresh = [(await upload(a, 100)).json()["id"] for _ in range(4)]
    theirs = (await upload(b, 100)).json()["id"]
    async with platform.db.transaction() as s:
        owner = (await s.execute(select(File.tenant_id).where(File.id == plain))).scalar_one()
        batch = await batch_repo.create_batch(
            s, owner, "/v1/chat/completions", read, "24h", None, utcnow() + timedelta(days=1)
        )
        await batch_repo.transition(s, batch.id, BatchStatus.IN_PROGRESS, [BatchStatus.VALIDATING])
    await expire(platform, plain, read, gone, theirs)
    (platform.settings.resolved_files_dir / gone).unlink()  # its bytes already gone

    # Gone from the API at once, before any removal.
    for file_id in (plain, read, gone):
        assert_openai_error(await a.get(f"/v1/files/{file_id}"), 404, "file_not_found")
        assert_openai_error(await a.get(f"/v1/files/{file_id}/content"), 404, "file_not_found")
        assert_openai_error(await a.delete(f"/v1/files/{file_id}"), 404, "file_not_found")
    assert [f["id"] for f in (await a.get("/v1/files")).json()["data"]] == [fresh]
    assert (await b.get("/v1/files")).json()["data"] == []
    refused = await a.post(
        "/v1/batches",
        json={
            "input_file_id": plain,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert_openai_error(refused, 404, "file_not_found")

    removed = await remove_expired_files(platform.settings, platform.db)
    assert sorted(removed) == sorted([plain, gone, theirs])
    assert set(await rows(platform)) == {read, fresh}
    assert on_disk(platform.settings) == sorted([read, fresh])
    assert await remove_expired_files(platform.settings, platform.db) == []  # idempotent

    # Once the batch has ended, its input goes too.
    async with platform.db.transaction() as s:
        await batch_repo.transition(s, batch.id, BatchStatus.CANCELLED, [BatchStatus.IN_PROGRESS])
    assert await remove_expired_files(platform.settings, platform.db) == [read]
    assert set(await rows(platform)) == {fresh} and on_disk(platform.settings) == [fresh]


async def test_beat_removes_expired_files_and_batch_outputs_expire(
    platform: Platform, tenant_key: str
) -> None:
    """The real Celery worker with beat: a batch's output file gets FILE_EXPIRY_S, and an
    expired file's row and bytes are removed by the periodic task."""
    platform.start_dispatcher()
    await platform.start_worker("w1")
    celery = CeleryWorker(platform.settings, FILE_EXPIRY_INTERVAL_S="0.5", FILE_EXPIRY_S="7200")
    celery.start()
    try:
        sdk = AsyncOpenAI(base_url=f"{platform.url}/v1", api_key=tenant_key, max_retries=0)
        batch = await submit(sdk, jsonl([line("one"), line("two")]))
        done = await finished(sdk, batch.id, celery)
        assert done.status == "completed" and done.output_file_id
        output = await sdk.files.retrieve(done.output_file_id)
        assert output.purpose == "batch_output"
        assert output.expires_at == output.created_at + 7200
        assert len(await lines_of(sdk, done.output_file_id)) == 2

        await expire(platform, batch.input_file_id)
        deadline = time.monotonic() + 30
        while batch.input_file_id in await rows(platform):
            assert time.monotonic() < deadline, celery.output()
            await asyncio.sleep(0.2)
        assert batch.input_file_id not in on_disk(platform.settings)
        assert done.output_file_id in on_disk(platform.settings)
    finally:
        celery.stop()
    async with platform.db.session() as s:
        assert (await s.execute(select(func.count()).select_from(File))).scalar_one() == 1
