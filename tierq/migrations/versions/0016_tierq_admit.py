"""tierq_admit(): admission on PostgreSQL in one function (replays, quotas, the fast case)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 07:30:00.000000

The function's SQL is tierq/migrations/sql/0016_tierq_admit.sql, which says what it does.
It states the admission rule once on PostgreSQL, where three ways stated it before: a
statement for a tenant without quotas, `tierq_admit_with_quotas` (migration 0007) for one
with, and the ORM for a replayed Idempotency-Key. `tierq_admit_with_quotas` stays for the
API processes of the release before, which a rolling upgrade runs beside this one's.
"""

from __future__ import annotations

from pathlib import Path

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

SQL = Path(__file__).resolve().parent.parent / "sql" / "0016_tierq_admit.sql"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # One statement at a time (a driver's prepared statement takes one): each function
        # definition ends its body's `$fn$;`.
        for body in SQL.read_text().split("$fn$;")[:-1]:
            op.execute(body + "$fn$;")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "DROP FUNCTION IF EXISTS tierq_admit("
            "text, text, text, integer, text, numeric, text, json, text, json, json, text, "
            "text, timestamptz, bigint, bigint, text, text, interval, boolean)"
        )
        op.execute("DROP FUNCTION IF EXISTS tierq_admit_replay(text, text, text)")
