"""jobs.progress: what a preempted or handed-back run generated, for the next to resume

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30 19:20:00.000000

JSON: {"token_ids": [...], "text": "...", "prompt_tokens": n}. Written with the running ->
queued transition of a run that stopped unfinished (fenced by its delivery, as the
transition is); read by the next delivery, which continues after those tokens; cleared
when the job ends.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("progress", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("progress")
