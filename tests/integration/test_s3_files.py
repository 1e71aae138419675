"""Files in an S3-compatible object store (FILES_URL), against a real S3 server (SeaweedFS):
the store's contract, the same on a folder and on S3; a batch whose hosts share nothing on
disk; uploads cut off by a client or by SIGKILL leave nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from benchmarks.ports import free_port
from tests.conftest import ADMIN_KEY, Platform, base_settings
from tests.helpers import client, until
from tests.integration.batch_helpers import finished, jsonl, line, lines_of, sdk, submit
from tests.integration.celery_proc import CeleryWorker, child_env
from tests.s3_server import READER_KEY, READER_SECRET, SeaweedS3
from tierq.api.app import build_app
from tierq.core.file_store import (
    PART_BYTES,
    FileStore,
    LocalStore,
    S3Location,
    S3Store,
    StoreUnavailable,
)
from tierq.core.settings import Settings
from tierq.workers.files_expiry import remove_stale_parts

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
BOUNDARY = "tierqs3"
FILE_HEAD = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"'
    "\r\nContent-Type: application/octet-stream\r\n\r\n"
).encode()


@pytest.fixture
def settings(pg_database: str, tmp_path: Path, s3: SeaweedS3) -> Settings:
    """The API's settings: files in the test's own prefix of the S3 server; its own state
    folder (no other process of the test writes there)."""
    (tmp_path / "api").mkdir()
    return base_settings(pg_database, tmp_path / "api").model_copy(update={"files_url": s3.url()})


@pytest.fixture(params=["folder", "s3"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[FileStore, Callable[[], list[str]]]]:
    """A store of each kind, and what it holds: its files, and its writes not ended as
    `<name> (upload)`."""
    if request.param == "folder":
        folder = tmp_path / "files"

        def held_here() -> list[str]:
            names = [p.name for p in folder.iterdir()] if folder.exists() else []
            return sorted(
                n.removesuffix(".part") + (" (upload)" if n.endswith(".part") else "")
                for n in names
            )

        yield LocalStore(folder), held_here
        return
    s3: SeaweedS3 = request.getfixturevalue("s3")
    url = s3.url()
    yield S3Store(S3Location.parse(url)), lambda: s3.keys(url)


def test_a_write_appears_whole_once_committed_and_reads_from_any_offset(
    store: tuple[FileStore, Callable[[], list[str]]],
) -> None:
    files, held = store
    data = random.Random(0).randbytes(2 * PART_BYTES + 12345)  # three parts on S3
    writer = files.create("file_big")
    for start in range(0, len(data), MIB):
        writer.write(data[start : start + MIB])
    assert not files.exists("file_big") and held() == ["file_big (upload)"]
    writer.commit()
    assert files.exists("file_big") and held() == ["file_big"]
    with files.open("file_big") as f:
        assert f.read() == data
    with files.open("file_big", PART_BYTES + 5) as f:
        assert f.read() == data[PART_BYTES + 5 :]
    with files.open("file_big", len(data)) as f:
        assert f.read() == b""
    assert b"".join(files.chunks("file_big", 7)) == data[7:]

    small = files.create("file_lines")  # less than a part: one PUT on S3
    small.write(b'{"a": 1}\n\n{"b": 2}\n')
    small.commit()
    with files.open("file_lines") as f:
        assert list(f) == [b'{"a": 1}\n', b"\n", b'{"b": 2}\n']
    with files.open("file_lines", 10) as f:
        assert list(f) == [b'{"b": 2}\n']
    empty = files.create("file_empty")
    empty.commit()
    with files.open("file_empty") as f:
        assert f.read() == b""

    with pytest.raises(FileNotFoundError):
        files.open("file_none")
    assert not files.exists("file_none")
    files.delete(["file_big", "file_none"])
    assert held() == ["file_empty", "file_lines"]


def test_an_aborted_write_leaves_nothing(
    store: tuple[FileStore, Callable[[], list[str]]],
) -> None:
    files, held = store
    writer = files.create("file_gone")
    writer.write(b"x" * (PART_BYTES + 1))  # a part stored on S3
    assert held() == ["file_gone (upload)"]
    writer.abort()
    writer.abort()  # idempotent
    assert held() == [] and not files.exists("file_gone")


def test_a_write_a_crash_left_is_swept_once_untouched_and_a_live_one_is_kept(
    store: tuple[FileStore, Callable[[], list[str]]],
) -> None:
    files, held = store
    crashed = files.create("file_crashed")
    crashed.write(b"x" * (PART_BYTES + 1))  # then nothing: its process died
    time.sleep(2.2)  # the store's times are whole seconds
    between = time.time() - 1.1
    live = files.create("file_live")
    live.write(b"y" * (PART_BYTES + 1))
    live.touch()
    assert files.remove_incomplete(between - 3600) == []
    assert files.remove_incomplete(between) == ["file_crashed"]
    assert held() == ["file_live (upload)"]
    live.commit()
    assert held() == ["file_live"]
    assert files.committed_before(between) == []
    assert files.committed_before(time.time() + 2) == ["file_live"]


@contextlib.asynccontextmanager
async def api_replica(settings: Settings) -> AsyncIterator[str]:
    """One more API replica in this process, on its own port and state folder."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_a_batch_runs_with_no_file_on_any_hosts_disk(
    running: Platform, tenant_key: str, s3: SeaweedS3, tmp_path: Path
) -> None:
    """Uploaded through one API replica, validated, expanded and finalised by a Celery
    worker with a state folder of its own, its output downloaded through another replica:
    every byte went through the object store, none through a disk two of them share."""
    settings = running.settings
    url = settings.files_url
    assert url is not None
    celery = CeleryWorker(
        settings, STATE_DIR=str(tmp_path / "celery"), FILES_URL=url, BATCH_MAX_OUTSTANDING="20"
    )
    celery.start()
    try:
        a = sdk(running, tenant_key)
        batch = await submit(a, jsonl([line(f"q-{i}", f"Question {i}?") for i in range(60)]))
        done = await finished(a, batch.id, celery)
    finally:
        celery.stop()
    assert done.status == "completed", done
    assert done.request_counts.completed == 60 and done.output_file_id

    other = settings.model_copy(update={"state_dir": tmp_path / "api-2"})
    async with api_replica(other) as url_2, client(url_2, tenant_key) as c:
        got = await c.get(f"/v1/files/{done.output_file_id}/content")
        assert got.status_code == 200, got.text
        assert got.headers["content-length"] == str(len(got.content))
        assert got.headers["content-disposition"] == (
            f'attachment; filename="{batch.id}_output.jsonl"'
        )
    out = [json.loads(raw) for raw in got.content.splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(f"q-{i}" for i in range(60))
    assert out == await lines_of(a, done.output_file_id)  # the same through either replica

    assert s3.keys(url) == sorted([batch.input_file_id, done.output_file_id])
    for folder in (tmp_path / "api", tmp_path / "api-2", tmp_path / "celery"):
        assert not (folder / "files").exists(), list(folder.iterdir())
    await a.files.delete(batch.input_file_id)
    assert s3.keys(url) == [done.output_file_id]


async def _send_part_of_an_upload(port: int, key: str, size: int) -> asyncio.StreamWriter:
    """The head of a multipart upload of `size` bytes and its first PART_BYTES + 1 MiB."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}"
        f"\r\nContent-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        f"Content-Length: {len(FILE_HEAD) + size + 8 + len(BOUNDARY)}\r\n\r\n"
    ).encode()
    writer.write(head + FILE_HEAD + b"x" * (PART_BYTES + MIB))
    await writer.drain()
    return writer


async def test_a_client_that_hangs_up_mid_upload_leaves_no_object_and_no_upload(
    platform: Platform, tenant_key: str, s3: SeaweedS3
) -> None:
    url = platform.settings.files_url
    assert url is not None
    writer = await _send_part_of_an_upload(platform.port, tenant_key, 32 * MIB)
    await until(lambda: s3.keys(url) != [], "a part stored")
    assert len(s3.keys(url)) == 1 and s3.keys(url)[0].endswith(" (upload)")
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    await until(lambda: s3.keys(url) == [], "the upload aborted")
    async with client(platform.url, tenant_key) as c:
        assert (await c.get("/v1/files")).json()["data"] == []


async def test_an_api_killed_mid_upload_leaves_an_upload_that_the_sweep_removes(
    settings: Settings, db: object, tenant_key: str, s3: SeaweedS3
) -> None:
    """SIGKILL of a real `tierq api` process while a file streams to S3: no object ever
    appears (the multipart upload was never completed), and the expiry task's sweep aborts
    the upload once it is older than FILES_PART_MAX_AGE_S."""
    url = settings.files_url
    assert url is not None
    port = free_port()
    env = child_env(settings, FILES_URL=url, ADMIN_API_KEY=ADMIN_KEY)
    log = Path(settings.state_dir) / "api.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        api = subprocess.Popen(
            [str(Path(sys.executable).parent / "tierq"), "api", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        async with httpx.AsyncClient() as h:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await h.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200:
                        break
                assert api.poll() is None and time.monotonic() < deadline, log.read_text()
                await asyncio.sleep(0.2)
        writer = await _send_part_of_an_upload(port, tenant_key, 32 * MIB)
        await until(lambda: s3.keys(url) != [], "a part stored")
        os.killpg(api.pid, signal.SIGKILL)
        api.wait(10)
        writer.close()
    finally:
        if api.poll() is None:
            os.killpg(api.pid, signal.SIGKILL)
            api.wait()
    (left,) = s3.keys(url)
    assert left.endswith(" (upload)")
    assert remove_stale_parts(settings) == []  # young: it may still be written
    later = time.time() + settings.files_part_max_age_s + 5
    assert remove_stale_parts(settings, now=later) == [left.removesuffix(" (upload)")]
    assert s3.keys(url) == []


def test_migrate_makes_the_bucket_once(s3: SeaweedS3, settings: Settings) -> None:
    """`tierq migrate` (once per deployment) creates a missing bucket, and leaves one that
    exists as it is: its objects stay."""
    bucket = f"tierq-made-{os.getpid()}-{random.Random().randrange(10**6)}"
    env = child_env(settings, FILES_URL=f"s3://{bucket}/files")
    tierq = str(Path(sys.executable).parent / "tierq")
    first = subprocess.run([tierq, "migrate"], env=env, capture_output=True, text=True)
    assert first.returncode == 0 and f"created the bucket {bucket}" in first.stderr, first.stderr
    s3.client().put_object(Bucket=bucket, Key="files/file_kept", Body=b"kept")
    again = subprocess.run([tierq, "migrate"], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "created" not in again.stderr, again.stderr
    assert S3Store(S3Location.parse(f"s3://{bucket}/files")).exists("file_kept")


async def test_a_store_that_refuses_is_a_503_to_retry_and_keeps_nothing(
    platform: Platform,
    tenant_key: str,
    tmp_path: Path,
    s3: SeaweedS3,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store that refuses (here: keys it does not know, as after a rotation) fails the
    upload with a 503 in OpenAI's shape, which the SDKs retry, and no row is written."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")  # read by its new client
    gone = platform.settings.model_copy(
        update={"files_url": s3.url(), "state_dir": tmp_path / "api-2"}
    )
    async with api_replica(gone) as url, client(url, tenant_key) as c:
        got = await c.post("/v1/files", data={"purpose": "batch"}, files={"file": b"{}\n"})
        assert got.status_code == 503, got.text
        assert got.json()["error"]["code"] == "service_unavailable"
        assert got.headers["retry-after"]
        assert (await c.get("/v1/files")).json()["data"] == []


async def test_migrate_waits_for_an_object_store_still_coming_up(
    s3: SeaweedS3, settings: Settings
) -> None:
    """`tierq migrate --wait` (the compose file's first start) retries while the store's
    port refuses connections, and makes the bucket once it answers."""
    port = free_port()
    env = child_env(
        settings,
        FILES_URL=f"s3://tierq-late-{os.getpid()}/f",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "tierq"),
        "migrate",
        "--wait",
        "60",
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    said = b""
    while b"waiting for the database and the object store" not in said:
        said += await asyncio.wait_for(proc.stderr.readline(), 60)
    target = s3.endpoint.removeprefix("http://").split(":")

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(target[0], int(target[1]))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(forward, "127.0.0.1", port)  # the store comes up
    try:
        rest = await asyncio.wait_for(proc.stderr.read(), 60)
        assert await proc.wait() == 0, (said + rest).decode()
    finally:
        server.close()
    assert b"created the bucket tierq-late-" in rest


def test_a_delete_the_store_refuses_is_an_error_not_a_success(
    s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials that may read but not delete: the store's refusal (whole, or per key in
    a quiet DeleteObjects' 200) is raised, never taken for a deletion."""
    url = s3.url()
    location = S3Location.parse(url)
    s3.client().put_object(Bucket=location.bucket, Key=location.prefix + "file_kept", Body=b"x")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", READER_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READER_SECRET)
    reader = S3Store(location)
    assert reader.exists("file_kept")  # it may read
    with pytest.raises(StoreUnavailable):
        reader.delete(["file_kept"])
    assert s3.keys(url) == ["file_kept"]


def test_the_sweep_leaves_other_applications_uploads_in_the_bucket(s3: SeaweedS3) -> None:
    """Only tierq's own writes (file_*) are swept: another application's multipart upload
    under the same prefix, however old, is its own."""
    url = s3.url()
    location = S3Location.parse(url)
    c = s3.client()
    theirs = c.create_multipart_upload(Bucket=location.bucket, Key=location.prefix + "report.csv")
    ours = S3Store(location).create("file_crashed")
    ours.write(b"x" * (PART_BYTES + 1))
    later = time.time() + 3600
    assert S3Store(location).remove_incomplete(later) == ["file_crashed"]
    assert s3.keys(url) == ["report.csv (upload)"]
    c.abort_multipart_upload(
        Bucket=location.bucket, Key=location.prefix + "report.csv", UploadId=theirs["UploadId"]
    )
