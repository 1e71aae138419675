"""usage_hours: the ledger summed per tenant, UTC hour, tier and model (a report whose
bound falls inside a day reads that day's whole hours instead of its records)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05 21:45:00.000000

The sums of the ledger written so far are taken here: on PostgreSQL in one aggregate
(`numeric`, exact), on SQLite in Python (Decimal, exact).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from decimal import Context, Decimal, localcontext

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

COLUMNS = (
    "tenant_id",
    "hour",
    "tier",
    "model",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cost",
)


def upgrade() -> None:
    op.create_table(
        "usage_hours",
        sa.Column(
            "tenant_id",
            sa.String(40),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("hour", sa.String(13), primary_key=True),
        sa.Column("tier", sa.String(20), primary_key=True),
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.Text(), nullable=False),
    )
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute(
            """
            INSERT INTO usage_hours (tenant_id, hour, tier, model, requests, prompt_tokens,
                completion_tokens, cost)
            SELECT tenant_id, to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24'),
                tier, model, count(*), sum(prompt_tokens), sum(completion_tokens),
                sum(cost::numeric)::text
            FROM usage_records
            GROUP BY 1, 2, 3, 4
            """
        )
        return
    rows = bind.execute(
        sa.text(
            "SELECT tenant_id, created_at, tier, model, prompt_tokens, completion_tokens, cost "
            "FROM usage_records"
        )
    )
    sums: dict[tuple[str, str, str, str], list[object]] = defaultdict(lambda: [0, 0, 0, Decimal(0)])
    with localcontext(Context(prec=200)):
        for tenant_id, created_at, tier, model, prompt, completion, cost in rows:
            at = datetime.fromisoformat(created_at) if isinstance(created_at, str) else created_at
            if at.tzinfo is not None:
                at = at.astimezone(UTC)
            hour = f"{at.date().isoformat()}T{at.hour:02d}"
            entry = sums[(tenant_id, hour, tier, model)]
            entry[0] = int(str(entry[0])) + 1
            entry[1] = int(str(entry[1])) + int(prompt)
            entry[2] = int(str(entry[2])) + int(completion)
            entry[3] = Decimal(str(entry[3])) + Decimal(cost)
    if sums:
        table = sa.table("usage_hours", *(sa.column(name) for name in COLUMNS))
        op.bulk_insert(
            table,
            [
                dict(zip(COLUMNS, (*key, v[0], v[1], v[2], str(v[3])), strict=True))
                for key, v in sums.items()
            ],
        )


def downgrade() -> None:
    op.drop_table("usage_hours")
