"""jobs.result_logprobs: each generated token's log probability, for jobs that ask

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05 16:00:00.000000

Written with the result when a job asked for `logprobs` (null otherwise): the chosen
token's and the most likely ones at each place, in OpenAI's chat shape.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("result_logprobs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("result_logprobs")
