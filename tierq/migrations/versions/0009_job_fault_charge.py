"""jobs.fault_charge: the share of failed deliveries held against a job, in thousandths

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 13:40:00.000000

A job is dead-lettered once its charge reaches MAX_DELIVERIES x 1000. Only a delivery the
job itself may have caused is charged: an error of the engine on its request (1000), a
dead engine or a vanished worker (1000 shared among the jobs that may have caused it,
rounded up), a run held by nothing that the reconciler puts back (1000); a drain, a
preemption or Redis losing a queued job is charged nothing. Until now every delivery
that did not end in a preemption counted (`deliveries - preemptions`): existing rows start
from that count, so no job gets more deliveries than it was promised.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("fault_charge", sa.Integer(), nullable=False, server_default="0")
        )
    # A running job's current delivery has not ended: it is not a failure (yet).
    op.execute(
        "UPDATE jobs SET fault_charge = 1000 * (deliveries - preemptions"
        " - CASE WHEN status = 'running' THEN 1 ELSE 0 END)"
        " WHERE status IN ('queued', 'running') AND deliveries - preemptions > 0"
    )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("fault_charge")
