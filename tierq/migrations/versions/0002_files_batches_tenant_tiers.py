"""files, batches, tenant tiers

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 11:41:29.233007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("endpoint", sa.String(length=40), nullable=False),
        sa.Column("input_file_id", sa.String(length=40), nullable=False),
        sa.Column("completion_window", sa.String(length=10), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(length=40), nullable=True),
        sa.Column("error_file_id", sa.String(length=40), nullable=True),
        sa.Column("request_total", sa.Integer(), nullable=False),
        sa.Column("request_completed", sa.Integer(), nullable=False),
        sa.Column("request_failed", sa.Integer(), nullable=False),
        sa.Column("next_line", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("in_progress_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finalizing_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancelling_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.create_index("ix_batches_status", ["status"], unique=False)
        batch_op.create_index(
            "ix_batches_tenant_created", ["tenant_id", "created_at"], unique=False
        )

    op.create_table(
        "files",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("purpose", sa.String(length=40), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.create_index("ix_files_tenant_created", ["tenant_id", "created_at"], unique=False)

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("batch_id", sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column("batch_line", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("custom_id", sa.String(length=512), nullable=True))
        batch_op.create_index("ix_jobs_batch_status", ["batch_id", "status"], unique=False)
        batch_op.create_unique_constraint("uq_jobs_batch_line", ["batch_id", "batch_line"])
        batch_op.create_foreign_key(
            "fk_jobs_batch_id_batches", "batches", ["batch_id"], ["id"], ondelete="CASCADE"
        )

    with op.batch_alter_table("tenants", schema=None) as batch_op:
        # Existing tenants keep what they had: every tier, standard by default.
        batch_op.add_column(
            sa.Column(
                "allowed_tiers",
                sa.JSON(),
                nullable=False,
                server_default=sa.text('\'["interactive", "standard", "batch"]\''),
            )
        )
        batch_op.add_column(
            sa.Column(
                "default_tier", sa.String(length=20), nullable=False, server_default="standard"
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("default_tier")
        batch_op.drop_column("allowed_tiers")

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_constraint("fk_jobs_batch_id_batches", type_="foreignkey")
        batch_op.drop_constraint("uq_jobs_batch_line", type_="unique")
        batch_op.drop_index("ix_jobs_batch_status")
        batch_op.drop_column("custom_id")
        batch_op.drop_column("batch_line")
        batch_op.drop_column("batch_id")

    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_index("ix_files_tenant_created")

    op.drop_table("files")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_index("ix_batches_tenant_created")
        batch_op.drop_index("ix_batches_status")

    op.drop_table("batches")
