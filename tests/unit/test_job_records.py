"""The record every admission answers with (tierq/models/jobs.py `new_record`) is the one the
ORM reads back for the same row: the fast paths build it without an ORM row."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from tierq.core.tiers import Tier
from tierq.models.jobs import NewJob, new_record, new_row
from tierq.models.records import JobRecord

_JOBS = [
    NewJob(
        tenant_id="ten_a",
        tier=Tier.INTERACTIVE,
        model="m",
        messages=[{"role": "user", "content": "Hi."}],
        prompt=None,
        params={"max_tokens": 8, "temperature": 0.0, "stop": ["\n"]},
        metadata={"k": "v"},
        idempotency_key="key-1",
        request_hash="abc",
        reserved_tokens=17,
        input_price=Decimal("0.50"),
        output_price=Decimal("2.000000"),
    ),
    NewJob(
        tenant_id="ten_b",
        tier=Tier.BATCH,
        model="m",
        messages=None,
        prompt="Once",
        params={"max_tokens": 1},
    ),
]


@pytest.mark.parametrize("new", _JOBS)
@pytest.mark.parametrize(
    "now", [datetime(2026, 12, 2, 6, 0, tzinfo=UTC), datetime(2026, 12, 2, 6, 0)]
)
def test_a_new_record_is_what_the_orm_reads_back(new: NewJob, now: datetime) -> None:
    built = new_record(new, "job_1", now)
    assert built == JobRecord.from_row(new_row(new, "job_1", now))
    assert built.created_at.tzinfo is not None
    # Every field is set as the ORM's read sets it, not left at a default by chance.
    read = dataclasses.asdict(JobRecord.from_row(new_row(new, "job_1", now)))
    assert dataclasses.asdict(built) == read
    # The record does not share the request's params: a later change to one is not in
    # the other.
    assert built.params is not new.params
