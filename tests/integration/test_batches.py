"""Files and Batches through the official `openai` SDK, with a real Celery worker and beat,
the real PostgreSQL and Redis, and the simulated engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import update

from tests.conftest import Platform
from tests.helpers import assert_openai_error, until, until_async
from tests.integration.batch_helpers import CHAT, finished, jsonl, line, lines_of, sdk, submit
from tests.integration.celery_proc import CeleryWorker
from tierq.api.app import build_app
from tierq.models import batches as batch_repo
from tierq.models.tables import Batch
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration


async def completed(client: openai.AsyncOpenAI, batch_id: str, n: int, timeout: float = 60) -> None:
    """Until at least `n` of the batch's lines have completed."""

    async def enough() -> bool:
        counts = (await client.batches.retrieve(batch_id)).request_counts
        return counts is not None and counts.completed >= n

    await until_async(enough, f"{n} lines of {batch_id} completed", timeout)


@pytest.fixture
async def celery(platform: Platform) -> AsyncIterator[CeleryWorker]:
    worker = CeleryWorker(
        platform.settings,
        BATCH_MAX_OUTSTANDING="40",
        BATCH_MAX_REQUESTS="400",
        BATCH_MAX_BYTES="200000",
    )
    worker.start()
    yield worker
    worker.stop()


async def test_batches_of_two_tenants_answer_every_custom_id_exactly_once(
    running: Platform, celery: CeleryWorker, tenant_key: str, other_tenant_key: str
) -> None:
    a, b = sdk(running, tenant_key), sdk(running, other_tenant_key)
    a_lines = [line(f"a-{i}", f"Question {i}?") for i in range(200)]
    a_lines[10] = line("a-10", max_tokens=5000)  # refused at expansion: longer than the context
    a_lines[20] = line("a-20", "word " * 3000)  # refused by the engine: too many prompt tokens
    a_lines[30] = line("a-30", model="gpt-4o")  # no such model
    b_lines = [line(f"b-{i}") for i in range(100)]
    batch_a, batch_b = await asyncio.gather(submit(a, jsonl(a_lines)), submit(b, jsonl(b_lines)))
    assert batch_a.status == "validating" and batch_a.metadata == {"run": "test"}

    peak = 0
    while True:  # the expansion never has more than the bound outstanding
        async with running.db.session() as s:
            counts = await batch_repo.job_counts(s, batch_a.id)
        peak = max(peak, counts.get("queued", 0) + counts.get("running", 0))  # type: ignore[call-overload]
        if (await a.batches.retrieve(batch_a.id)).status in ("completed", "failed"):
            break
        await asyncio.sleep(0.05)
    assert 0 < peak <= 40

    done_a = await finished(a, batch_a.id, celery)
    done_b = await finished(b, batch_b.id, celery)
    for done, items, failed in ((done_a, a_lines, 3), (done_b, b_lines, 0)):
        assert done.status == "completed", done
        counts = done.request_counts
        assert counts is not None
        assert (counts.total, counts.completed, counts.failed) == (
            len(items),
            len(items) - failed,
            failed,
        )
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        client = a if done is done_a else b
        output = await lines_of(client, done.output_file_id)
        errors = await lines_of(client, done.error_file_id)
        answered = [x["custom_id"] for x in output + errors]
        assert sorted(answered) == sorted(i["custom_id"] for i in items)  # each exactly once
        assert [x["custom_id"] for x in output] == [
            i["custom_id"] for i in items if i["custom_id"] in {x["custom_id"] for x in output}
        ]  # in input order
        for x in output:
            assert x["error"] is None and x["response"]["status_code"] == 200
            body = x["response"]["body"]
            assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
            assert body["usage"]["completion_tokens"] > 0
    errors_a = {x["custom_id"]: x for x in await lines_of(a, done_a.error_file_id)}
    assert errors_a["a-10"]["error"]["code"] == "context_length_exceeded"
    assert errors_a["a-20"]["error"]["code"] == "context_length_exceeded"
    assert errors_a["a-20"]["response"]["status_code"] == 400
    assert errors_a["a-30"]["error"]["code"] == "model_not_found"

    page = await a.batches.list(limit=1)
    assert [x.id for x in page.data] == [batch_a.id] and not page.has_more
    # Nothing of one tenant is visible to the other.
    with pytest.raises(openai.NotFoundError):
        await b.batches.retrieve(batch_a.id)
    with pytest.raises(openai.NotFoundError):
        await b.batches.cancel(batch_a.id)
    with pytest.raises(openai.NotFoundError):
        await b.files.content(done_a.output_file_id or "")
    with pytest.raises(openai.NotFoundError):
        await b.files.delete(batch_a.input_file_id)
    assert batch_a.id not in [x.id for x in (await b.batches.list()).data]


async def test_malformed_files_fail_with_the_lines_named(
    platform: Platform, celery: CeleryWorker, tenant_key: str, other_tenant_key: str
) -> None:
    client = sdk(platform, tenant_key)
    good = line("one")
    bad = jsonl(
        [
            good,
            b"{not json",
            b"[1, 2]",
            {k: v for k, v in line("x").items() if k != "custom_id"},
            line("one"),
            {**line("get"), "method": "GET"},
            {**line("emb"), "url": "/v1/embeddings"},
            {**line("body"), "body": "hello"},
        ]
    )
    cases: dict[str, tuple[bytes, list[tuple[str, int | None]]]] = {
        "every kind": (
            bad,
            [
                ("invalid_json_line", 2),
                ("invalid_json_line", 3),
                ("missing_custom_id", 4),
                ("duplicate_custom_id", 5),
                ("invalid_method", 6),
                ("invalid_url", 7),
                ("invalid_body", 8),
            ],
        ),
        "empty": (b"\n", [("empty_file", None)]),
        "too many": (jsonl([line(f"n{i}") for i in range(401)]), [("too_many_requests", 401)]),
        "too large": (
            jsonl([line(f"l{i}", "x" * 30_000) for i in range(8)]),
            [("file_too_large", None)],
        ),
    }
    batches = {name: await submit(client, data) for name, (data, _) in cases.items()}
    for name, (_, expected) in cases.items():
        done = await finished(client, batches[name].id, celery)
        assert done.status == "failed", (name, done)
        assert done.failed_at is not None and done.output_file_id is None
        assert done.errors is not None and done.errors.data is not None
        got = [(e.code, e.line) for e in done.errors.data]
        assert got == expected, name

    file = await client.files.create(file=("in.jsonl", jsonl([good])), purpose="batch")
    for body, status in (
        ({"endpoint": "/v1/embeddings"}, 400),
        ({"completion_window": "1h"}, 400),
        ({"input_file_id": "file_nope"}, 404),
    ):
        async with httpx.AsyncClient(base_url=platform.url) as raw:
            resp = await raw.post(
                "/v1/batches",
                json={
                    "input_file_id": file.id,
                    "endpoint": CHAT,
                    "completion_window": "24h",
                    **body,
                },
                headers={"Authorization": f"Bearer {tenant_key}"},
            )
        assert_openai_error(resp, status)
    with pytest.raises(openai.NotFoundError):  # another tenant's file
        await sdk(platform, other_tenant_key).batches.create(
            input_file_id=file.id, endpoint=CHAT, completion_window="24h"
        )


async def test_cancel_drops_queued_work_and_keeps_finished_results(
    platform: Platform, celery: CeleryWorker, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1", cost=CostModel(slots=8))  # real-time speed: slow
    client = sdk(platform, tenant_key)
    batch = await submit(client, jsonl([line(f"c{i}", max_tokens=40) for i in range(80)]))
    await completed(client, batch.id, 3)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await finished(client, batch.id, celery)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    output = await lines_of(client, done.output_file_id)
    assert done.request_counts is not None
    assert len(output) == done.request_counts.completed >= 3
    assert done.request_counts.completed < 80
    async with platform.db.session() as s:
        counts = await batch_repo.job_counts(s, batch.id)
    assert counts.get("queued", 0) == counts.get("running", 0) == 0  # type: ignore[call-overload]
    worker = platform.workers["w1"][0]
    await until(lambda: not worker._runs, "the worker let go of the aborted jobs", 5)
    again = await client.batches.cancel(batch.id)  # harmless twice
    assert again.status == "cancelled"


async def test_an_expired_batch_keeps_finished_results_and_reports_the_rest(
    platform: Platform, celery: CeleryWorker, tenant_key: str
) -> None:
    platform.start_dispatcher()
    await platform.start_worker("w1", cost=CostModel(slots=8))
    client = sdk(platform, tenant_key)
    batch = await submit(client, jsonl([line(f"e{i}", max_tokens=40) for i in range(120)]))
    await completed(client, batch.id, 2)
    async with platform.db.transaction() as s:  # the 24 h window passes
        await s.execute(
            update(Batch).where(Batch.id == batch.id).values(expires_at=Batch.created_at)
        )
    done = await finished(client, batch.id, celery)
    assert done.status == "expired" and done.expired_at is not None
    counts = done.request_counts
    assert counts is not None and counts.total == 120
    output = await lines_of(client, done.output_file_id)
    errors = await lines_of(client, done.error_file_id)
    assert len(output) == counts.completed >= 2
    assert len(errors) == counts.failed == 120 - counts.completed
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert sorted(x["custom_id"] for x in output + errors) == sorted(f"e{i}" for i in range(120))


async def test_a_batch_survives_its_celery_worker_being_killed_midway(
    running: Platform, tenant_key: str
) -> None:
    celery = CeleryWorker(running.settings, BATCH_MAX_OUTSTANDING="15")
    celery.start()
    client = sdk(running, tenant_key)
    try:
        batch = await submit(client, jsonl([line(f"k{i}") for i in range(150)]))
        await completed(client, batch.id, 30)
        celery.kill()
        await asyncio.sleep(1)  # down a while, as a crashed worker is before its restart
        celery.start()
        done = await finished(client, batch.id, celery, timeout=120)
    finally:
        celery.stop()
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == 150
    output = await lines_of(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in output) == sorted(f"k{i}" for i in range(150))


async def test_files_upload_list_download_delete(
    platform: Platform, tenant_key: str, other_tenant_key: str
) -> None:
    client = sdk(platform, tenant_key)
    data = jsonl([line(f"f{i}") for i in range(3)])
    first = await client.files.create(file=("a.jsonl", data), purpose="batch")
    second = await client.files.create(file=("b.jsonl", b"{}\n"), purpose="batch")
    assert first.bytes == len(data) and first.filename == "a.jsonl" and first.purpose == "batch"
    assert (await client.files.retrieve(first.id)).id == first.id
    assert (await client.files.content(first.id)).content == data
    page = await client.files.list(limit=1)
    assert [f.id for f in page.data] == [second.id] and page.has_more
    ids = [f.id async for f in await client.files.list(limit=1)]  # auto-pagination
    assert ids == [second.id, first.id]
    other = sdk(platform, other_tenant_key)
    assert [f.id async for f in await other.files.list()] == []
    with pytest.raises(openai.NotFoundError):
        await other.files.retrieve(first.id)
    deleted = await client.files.delete(first.id)
    assert deleted.deleted and deleted.id == first.id
    with pytest.raises(openai.NotFoundError):
        await client.files.content(first.id)
    with pytest.raises(openai.BadRequestError):
        await client.files.create(file=("a.jsonl", data), purpose="fine-tune")
    async with httpx.AsyncClient(base_url=platform.url) as raw:
        resp = await raw.post(
            "/v1/files",
            json={"purpose": "batch"},
            headers={"Authorization": f"Bearer {tenant_key}"},
        )
        assert_openai_error(resp, 415)


async def test_an_upload_over_the_limit_is_refused_before_it_is_read(platform: Platform) -> None:
    app = build_app(platform.settings.model_copy(update={"max_upload_bytes": 1000}))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tierq") as c:
        resp = await c.post(
            "/v1/files", files={"file": ("big.jsonl", b"x" * 100_000)}, data={"purpose": "batch"}
        )
    assert_openai_error(resp, 413, "request_too_large")


async def test_a_batch_over_the_tenants_budget_is_refused_before_it_starts(
    platform: Platform, celery: CeleryWorker
) -> None:
    admin_client = httpx.AsyncClient(
        base_url=platform.url,
        headers={"Authorization": f"Bearer {platform.settings.admin_api_key}"},
    )
    async with admin_client as a:
        tenant = (await a.post("/admin/tenants", json={"name": "budgeted"})).json()
        key = (await a.post(f"/admin/tenants/{tenant['id']}/keys")).json()["key"]
        # A line reserves its prompt (about 40 tokens, chat template included) plus
        # max_tokens (8): 20 lines are far more than 400, 3 lines fit.
        await a.put(f"/admin/tenants/{tenant['id']}/quota", json={"token_budget": 400})
    client = sdk(platform, key)
    batch = await submit(client, jsonl([line(f"b{i}") for i in range(20)]))
    done = await finished(client, batch.id, celery)
    assert done.status == "failed" and done.errors is not None and done.errors.data
    assert [e.code for e in done.errors.data] == ["budget_exceeded"]
    async with platform.db.session() as s:
        counts = await batch_repo.job_counts(s, batch.id)
    assert counts == {}  # refused whole: nothing of it ran
    small = await submit(client, jsonl([line(f"s{i}") for i in range(3)]))

    async def validated() -> bool:
        return (await client.batches.retrieve(small.id)).status != "validating"

    await until_async(validated, "the small batch validated", 10)
    assert (await client.batches.retrieve(small.id)).status == "in_progress"


async def test_the_batch_cli_submits_waits_and_downloads(
    running: Platform, celery: CeleryWorker, tenant_key: str, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from tierq.cli.main import app

    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(
        jsonl([line(f"cli-{i}") for i in range(12)] + [line("bad", max_tokens=5000)])
    )
    common = ["--url", running.url, "--key", tenant_key]
    runner = CliRunner()

    def invoke(*argv: str) -> Any:
        return runner.invoke(app, ["batch", *argv, *common])

    submitted = await asyncio.to_thread(invoke, "submit", str(requests), "--wait")
    assert submitted.exit_code == 0, submitted.output
    batch = json.loads(submitted.stdout[submitted.stdout.index("{") :])
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 13, "completed": 12, "failed": 1}
    out = tmp_path / "results"
    downloaded = await asyncio.to_thread(invoke, "download", batch["id"], "--out", str(out))
    assert downloaded.exit_code == 0, downloaded.output
    output = (out / f"{batch['id']}_output.jsonl").read_text().splitlines()
    errors = (out / f"{batch['id']}_error.jsonl").read_text().splitlines()
    assert len(output) == 12 and [json.loads(e)["custom_id"] for e in errors] == ["bad"]
