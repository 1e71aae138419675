"""batches.lease_fence: the fencing token of the Celery worker advancing a batch

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 17:30:00.000000

A Celery worker that takes a batch's lease (a Redis key) then raises the batch's fence in
the database and writes the batch only in transactions that find the fence still its own
(tierq/workers/batches.py): a holder that lost its lease without knowing it — its renewer
stopped, its process frozen past the lease — cannot write after another has taken over.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(
            sa.Column("lease_fence", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("lease_fence")
