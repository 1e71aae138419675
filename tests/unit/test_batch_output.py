"""The batch output writer (tierq/workers/batch_output.py), on hand-made jobs: which file each
outcome goes to, and the shape of its line."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from tierq.core.states import JobStatus
from tierq.core.tiers import Tier
from tierq.models.records import JobRecord
from tierq.services.openai_compat import CHAT_ENDPOINT
from tierq.workers.batch_output import write_results

NOW = datetime(2026, 1, 1, tzinfo=UTC)
JOB = JobRecord(
    id="job_1",
    tenant_id="ten_1",
    tier=Tier.BATCH,
    model="m",
    status=JobStatus.SUCCEEDED,
    messages=[{"role": "user", "content": "hi"}],
    prompt=None,
    params={"max_tokens": 8},
    metadata=None,
    request_hash=None,
    created_at=NOW,
    started_at=NOW,
    finished_at=NOW,
    result_text="hello",
    finish_reason="stop",
    prompt_tokens=3,
    completion_tokens=2,
    error_code=None,
    error_message=None,
    deliveries=1,
    worker_id="w",
    batch_id="batch_1",
    batch_line=0,
    custom_id="a",
)


def _write(*jobs: JobRecord) -> tuple[tuple[int, int], list[dict[str, Any]], list[dict[str, Any]]]:
    out, err = io.StringIO(), io.StringIO()
    counts = write_results(jobs, CHAT_ENDPOINT, out, err)
    lines = [[json.loads(x) for x in f.getvalue().splitlines()] for f in (out, err)]
    return counts, lines[0], lines[1]


def test_a_succeeded_job_is_an_output_line_with_its_completion() -> None:
    counts, out, err = _write(JOB)
    assert counts == (1, 0) and err == []
    assert out[0]["id"] == "batch_req_1" and out[0]["custom_id"] == "a"
    assert out[0]["error"] is None
    response = out[0]["response"]
    assert response["status_code"] == 200 and response["request_id"] == "job_1"
    assert response["body"]["choices"][0]["message"]["content"] == "hello"
    assert response["body"]["usage"]["completion_tokens"] == 2


def test_a_failed_job_is_an_error_line_with_its_status() -> None:
    refused = replace(
        JOB,
        id="job_2",
        custom_id="b",
        status=JobStatus.FAILED,
        result_text=None,
        error_code="context_length_exceeded",
        error_message="too long",
    )
    counts, out, err = _write(refused)
    assert counts == (0, 1) and out == []
    assert err[0]["custom_id"] == "b"
    assert err[0]["error"] == {"code": "context_length_exceeded", "message": "too long"}
    body = err[0]["response"]["body"]["error"]
    assert err[0]["response"]["status_code"] == 400
    assert body["type"] == "invalid_request_error" and body["code"] == "context_length_exceeded"


def test_an_expired_job_is_an_error_line_without_a_response_and_a_cancelled_one_is_nothing() -> (
    None
):
    expired = replace(
        JOB,
        status=JobStatus.CANCELLED,
        error_code="batch_expired",
        error_message="the batch expired",
    )
    cancelled = replace(JOB, id="job_3", status=JobStatus.CANCELLED, error_code="batch_cancelled")
    counts, out, err = _write(expired, cancelled)
    assert counts == (0, 1) and out == []
    assert len(err) == 1 and err[0]["response"] is None
    assert err[0]["error"]["code"] == "batch_expired"


def test_lines_keep_the_order_they_are_given_in() -> None:
    jobs = [replace(JOB, id=f"job_{i}", custom_id=str(i), batch_line=i) for i in range(5)]
    counts, out, _err = _write(*jobs)
    assert counts == (5, 0)
    assert [line["custom_id"] for line in out] == ["0", "1", "2", "3", "4"]
