"""`tierq bench curves`, small: every part runs on its own real servers (a redis-server, a
scratch PostgreSQL database, the real API process and dispatcher) and prints its curves.
Growth is reported, not asserted here: two sizes on a busy machine say little; what is
checked is that each figure was measured, that the ledger's reports read what was
loaded, and that nothing failed."""

from __future__ import annotations

import pytest

from tests.integration.bench_proc import run_bench

pytestmark = pytest.mark.integration


def test_the_curves_of_every_part_at_two_sizes() -> None:
    result = run_bench(
        "curves",
        "--ledger-sizes", "1e3,1e4",
        "--jobs-cap", "5000",
        "--admission-n", "100",
        "--tenant-counts", "10,100",
        "--tenants-queue", "1000",
        "--queue-lengths", "1e3,1e4",
        "--backlog-sizes", "100,2000",
        "--streams", "20",
    )  # fmt: skip
    ledger = result["ledger"]
    assert [r["ledger_records"] for r in ledger["rows"]] == [1000, 10_000]
    assert [r["jobs_rows"] for r in ledger["rows"]] == [1000, 5000]
    assert all(r["admission_errors"] == 0 for r in ledger["rows"])
    assert ledger["rows"][1]["usage_records_mb"] > ledger["rows"][0]["usage_records_mb"]
    for name, fitted in ledger["curves"].items():
        assert len(fitted["points"]) == 2 and fitted["exponent"] is not None, name
    assert ledger["usage_within_1s_at_largest"] is True
    backlog = result["backlog"]
    # The budgets' check read the whole backlog each size was given: each row's held
    # tokens are its jobs' reservations (the template's, copied), none lost or doubled.
    rows = backlog["rows"]
    assert [r["queued_jobs"] for r in rows] == [100, 2000]
    assert [r["queued_seen"] for r in rows] == [100, 2000]
    assert all(r["admission_errors"] == 0 for r in rows)
    per_job = rows[0]["held_tokens"] / 100
    assert per_job > 16 and rows[1]["held_tokens"] == 2000 * per_job
    for name, fitted in backlog["curves"].items():
        assert len(fitted["points"]) == 2 and fitted["exponent"] is not None, name
    dispatch = result["dispatch"]
    by_tenants = dispatch["by_tenants"]["rows"]
    assert [(r["tenants"], r["queued_jobs"]) for r in by_tenants] == [(10, 1000), (100, 1000)]
    # the read-ahead: 32 entries per tenant's shard, or all it has
    assert [r["buffered"] for r in by_tenants] == [320, 1000]
    by_length = dispatch["by_queue_length"]["rows"]
    assert [r["queued_jobs"] for r in by_length] == [1000, 10_000]
    assert all(0 < r["redis_bytes_per_job"] < 4096 for r in by_tenants + by_length)
    assert all(r["decision_p99_ms"] > 0 and r["read_round_ms"] > 0 for r in by_length)
    # 100 jobs a shard: once every shard gave up half its read-ahead, each is read again,
    # a whole read-ahead (XREADGROUP's COUNT is per stream) while the stream has that many
    assert by_length[1]["read_round_all_entries"] == 100 * 32
    assert by_length[1]["read_round_entries"] == 0  # 256 jobs leave no shard at half
    streams = result["streams"]
    assert streams["streams"] == 20 and streams["api_bytes_per_stream"] > 0
