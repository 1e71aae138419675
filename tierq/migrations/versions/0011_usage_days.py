"""usage_days: the ledger summed per tenant, UTC day, tier and model (reports' whole days
and invoices read it instead of every record), and an index on usage_records.created_at
(every tenant's records of a report's partial days)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 00:10:00.000000

The sums of the ledger written so far are taken here: on PostgreSQL in one aggregate
(`numeric`, exact), on SQLite in Python (Decimal, exact).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from decimal import Context, Decimal, localcontext

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_days",
        sa.Column(
            "tenant_id",
            sa.String(40),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("day", sa.String(10), primary_key=True),
        sa.Column("tier", sa.String(20), primary_key=True),
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.Text(), nullable=False),
    )
    op.create_index("ix_usage_days_day", "usage_days", ["day"])
    op.create_index("ix_usage_created", "usage_records", ["created_at"])
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute(
            """
            INSERT INTO usage_days (tenant_id, day, tier, model, requests, prompt_tokens,
                completion_tokens, cost)
            SELECT tenant_id, to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD'), tier,
                model, count(*), sum(prompt_tokens), sum(completion_tokens),
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
            entry = sums[(tenant_id, at.date().isoformat(), tier, model)]
            entry[0] = int(str(entry[0])) + 1
            entry[1] = int(str(entry[1])) + int(prompt)
            entry[2] = int(str(entry[2])) + int(completion)
            entry[3] = Decimal(str(entry[3])) + Decimal(cost)
    table = sa.table(
        "usage_days",
        *(
            sa.column(name)
            for name in (
                "tenant_id",
                "day",
                "tier",
                "model",
                "requests",
                "prompt_tokens",
                "completion_tokens",
                "cost",
            )
        ),
    )
    if sums:
        op.bulk_insert(
            table,
            [
                {
                    "tenant_id": key[0],
                    "day": key[1],
                    "tier": key[2],
                    "model": key[3],
                    "requests": v[0],
                    "prompt_tokens": v[1],
                    "completion_tokens": v[2],
                    "cost": str(v[3]),
                }
                for key, v in sums.items()
            ],
        )


def downgrade() -> None:
    op.drop_index("ix_usage_created", table_name="usage_records")
    op.drop_index("ix_usage_days_day", table_name="usage_days")
    op.drop_table("usage_days")
