"""The batch lease is a fence: a Celery worker frozen (SIGSTOP) while it writes a batch's
output, past its lease, is taken over by another that finishes the batch; when the first
wakes and goes on, nothing of it lands — the output file is the second's, whole, every
line once, and no file of the first is left on the volume.

Real processes, real faults: two Celery workers (each with beat) on the test's PostgreSQL
and Redis, the first stopped with SIGSTOP and resumed with SIGCONT.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from tests.conftest import Platform
from tests.helpers import client, new_tenant
from tests.integration.celery_proc import CeleryWorker
from tierq.core.states import BatchStatus
from tierq.models import batches as batch_repo

pytestmark = pytest.mark.integration

LINES = 40_000  # enough that its output takes a while to write
LEASE = {"BATCH_LEASE_S": "2"}


async def _finalizing_batch(platform: Platform, tenant_id: str) -> str:
    """A batch whose LINES jobs all succeeded, waiting to be finalised (its jobs written by
    PostgreSQL itself: the subject is the finalising, not the running)."""
    async with platform.db.transaction() as s:
        batch = await batch_repo.create_batch(
            s,
            tenant_id,
            "/v1/chat/completions",
            "file_gone",
            "24h",
            None,
            datetime.now(UTC) + timedelta(hours=24),
        )
        await s.execute(
            text(
                """
                INSERT INTO jobs (id, tenant_id, tier, model, status, params, created_at,
                    started_at, finished_at, result_text, finish_reason, prompt_tokens,
                    completion_tokens, deliveries, preemptions, fault_charge, batch_id,
                    batch_line, custom_id, reserved_tokens)
                SELECT 'job_fence_' || g, :tenant, 'batch', :model, 'succeeded',
                    '{"max_tokens": 8}', now(), now(), now(), 'answer number ' || g, 'stop',
                    5, 2, 1, 0, 0, :batch, g, 'req-' || g, 0
                FROM generate_series(0, :n - 1) AS g
                """
            ),
            {
                "tenant": tenant_id,
                "model": platform.settings.served_model_name,
                "batch": batch.id,
                "n": LINES,
            },
        )
        await batch_repo.transition(
            s,
            batch.id,
            BatchStatus.FINALIZING,
            (BatchStatus.VALIDATING,),
            request_total=LINES,
            in_progress_at=datetime.now(UTC),
            finalizing_at=datetime.now(UTC),
        )
    return batch.id


def _parts(platform: Platform, batch_id: str) -> list[str]:
    """The files being written (the batch's are the only ones: its input is not stored)."""
    files = platform.settings.resolved_files_dir
    return sorted(p.name for p in files.glob("*.part")) if files.exists() else []


async def _status(platform: Platform, batch_id: str) -> str:
    async with platform.db.session() as s:
        batch = await batch_repo.get_batch(s, batch_id)
    assert batch is not None
    return str(batch.status)


async def test_a_frozen_holder_of_the_lease_writes_nothing_once_taken_over(
    platform: Platform,
) -> None:
    tenant_id, key = await new_tenant(platform)
    batch_id = await _finalizing_batch(platform, tenant_id)
    first = CeleryWorker(platform.settings, name="celery-a", **LEASE)
    second = CeleryWorker(platform.settings, name="celery-b", **LEASE)
    first.start()
    try:
        # Frozen as soon as it has begun writing the output (a page of it at most).
        deadline = time.monotonic() + 120
        while not _parts(platform, batch_id):
            assert time.monotonic() < deadline, first.output()
            await asyncio.sleep(0.002)
        assert first.proc is not None
        os.killpg(first.proc.pid, signal.SIGSTOP)
        frozen_with = _parts(platform, batch_id)
        assert await _status(platform, batch_id) == BatchStatus.FINALIZING

        second.start()  # takes the batch once the first one's lease has run out
        deadline = time.monotonic() + 120
        while await _status(platform, batch_id) != BatchStatus.COMPLETED:
            assert time.monotonic() < deadline, second.output()
            await asyncio.sleep(0.2)

        os.killpg(first.proc.pid, signal.SIGCONT)  # it goes on where it stopped
        deadline = time.monotonic() + 60
        while _parts(platform, batch_id) or "stopped advancing" not in first.output():
            assert time.monotonic() < deadline, (frozen_with, first.output())
            await asyncio.sleep(0.2)
        # Whatever it would still do with its copies: nothing marks that it has nothing
        # left to do, so a second for it to show.
        await asyncio.sleep(1)
    finally:
        for worker in (first, second):
            if worker.proc is not None and worker.proc.poll() is None:
                os.killpg(worker.proc.pid, signal.SIGCONT)
            worker.stop()

    async with platform.db.session() as s:
        batch = await batch_repo.get_batch(s, batch_id)
        kept = (
            await s.execute(
                text(
                    "SELECT id, bytes FROM files WHERE tenant_id = :t AND purpose = 'batch_output'"
                ),
                {"t": tenant_id},
            )
        ).all()
    assert batch is not None and batch.output_file_id is not None
    assert batch.error_file_id is None and batch.request_completed == LINES
    assert [row.id for row in kept] == [batch.output_file_id]  # one output, the winner's
    # Nothing else on the volume: no part, no copy of the frozen worker's.
    on_disk = sorted(p.name for p in platform.settings.resolved_files_dir.iterdir())
    assert on_disk == [batch.output_file_id], on_disk
    output = platform.settings.resolved_files_dir / batch.output_file_id
    assert output.stat().st_size == kept[0].bytes

    async with client(platform.url, key, timeout=60) as c:
        body = (await c.get(f"/v1/files/{batch.output_file_id}/content")).content
    lines = [json.loads(raw) for raw in body.decode().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"req-{g}" for g in range(LINES)]
    assert {x["response"]["body"]["choices"][0]["message"]["content"] for x in lines[:3]} == {
        "answer number 0",
        "answer number 1",
        "answer number 2",
    }
