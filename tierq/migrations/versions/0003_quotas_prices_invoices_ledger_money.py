"""quotas, prices, invoices, ledger money (amounts are exact decimal strings)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 12:00:58.960743
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "prices",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("tier", sa.String(length=20), nullable=False),
        sa.Column("input_per_million", sa.String(length=40), nullable=False),
        sa.Column("output_per_million", sa.String(length=40), nullable=False),
        sa.Column("effective_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("prices", schema=None) as batch_op:
        batch_op.create_index(
            "ix_prices_model_tier_effective", ["model", "tier", "effective_at"], unique=False
        )

    op.create_table(
        "invoices",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("period", sa.String(length=7), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.String(length=40), nullable=False),
        sa.Column("lines", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "period", name="uq_invoices_tenant_period"),
    )
    op.create_table(
        "quotas",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("tier", sa.String(length=20), nullable=False),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("max_running", sa.Integer(), nullable=True),
        sa.Column("max_queued", sa.Integer(), nullable=True),
        sa.Column("token_budget", sa.BigInteger(), nullable=True),
        sa.Column("spend_budget", sa.String(length=40), nullable=True),
        sa.Column("budget_period", sa.String(length=10), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "tier", name="uq_quotas_tenant_tier"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("reserved_tokens", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column("input_price", sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column("output_price", sa.String(length=40), nullable=True))

    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("weight", sa.Float(), nullable=False, server_default="1"))

    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("input_price", sa.String(length=40), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column("output_price", sa.String(length=40), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column("cost", sa.String(length=40), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.drop_column("cost")
        batch_op.drop_column("output_price")
        batch_op.drop_column("input_price")

    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("weight")

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("output_price")
        batch_op.drop_column("input_price")
        batch_op.drop_column("reserved_tokens")

    op.drop_table("quotas")
    op.drop_table("invoices")
    with op.batch_alter_table("prices", schema=None) as batch_op:
        batch_op.drop_index("ix_prices_model_tier_effective")

    op.drop_table("prices")
