"""spend_counters (a budget's spend without summing the ledger), batches' reservations,
and an index on jobs (tenant_id, status) for what unfinished jobs reserve

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 07:20:00.000000
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from decimal import Decimal

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def _period_keys(at: datetime) -> tuple[str, str, str]:
    # As models.spend.period_keys (a migration does not import the application's code).
    if at.tzinfo is not None:
        at = at.astimezone(UTC)
    return f"day:{at:%Y-%m-%d}", f"month:{at:%Y-%m}", "total"


def upgrade() -> None:
    op.create_table(
        "spend_counters",
        sa.Column(
            "tenant_id",
            sa.String(40),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("tier", sa.String(20), primary_key=True),
        sa.Column("period_key", sa.String(20), primary_key=True),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.String(40), nullable=False),
    )
    with op.batch_alter_table("batches") as batch:
        batch.add_column(
            sa.Column("reserved_tokens", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch.add_column(
            sa.Column("reserved_cost", sa.String(40), nullable=False, server_default="0")
        )
    op.create_index("ix_jobs_tenant_status", "jobs", ["tenant_id", "status"])

    # The counters of the ledger written so far (summed in Python: money stays Decimal).
    bind = op.get_bind()
    rows = bind.execute(
        sa.text(
            "SELECT tenant_id, tier, created_at, prompt_tokens + completion_tokens, cost "
            "FROM usage_records"
        )
    )
    totals: dict[tuple[str, str, str], list[object]] = defaultdict(lambda: [0, Decimal(0)])
    for tenant_id, tier, created_at, tokens, cost in rows:
        at = created_at
        if isinstance(at, str):  # SQLite hands back text
            at = datetime.fromisoformat(at)
        for key in _period_keys(at):
            entry = totals[(tenant_id, tier, key)]
            entry[0] = int(entry[0]) + int(tokens)  # type: ignore[call-overload]
            entry[1] = Decimal(str(entry[1])) + Decimal(cost)
    table = sa.table(
        "spend_counters",
        sa.column("tenant_id"),
        sa.column("tier"),
        sa.column("period_key"),
        sa.column("tokens"),
        sa.column("cost"),
    )
    if totals:
        op.bulk_insert(
            table,
            [
                {"tenant_id": t, "tier": tier, "period_key": k, "tokens": v[0], "cost": str(v[1])}
                for (t, tier, k), v in totals.items()
            ],
        )


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_status", table_name="jobs")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("reserved_cost")
        batch.drop_column("reserved_tokens")
    op.drop_table("spend_counters")
