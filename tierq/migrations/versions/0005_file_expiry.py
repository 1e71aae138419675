"""files.expires_at: when a file expires (OpenAI's expires_after); None: never

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 07:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_index("ix_files_expires_at", ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_index("ix_files_expires_at")
        batch.drop_column("expires_at")
