"""held_reservations: what queued and running jobs hold against budgets, as running sums
kept by triggers on jobs; tierq_admit reads them instead of summing a tenant's backlog

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 13:30:00.000000

The triggers are tierq/migrations/sql/0017_held_reservations.<dialect>.sql, which say what
they keep; the admission function is tierq/migrations/sql/0017_tierq_admit.sql. Jobs gain
`held_counted` (whether the sums count the job) and tenants `counts_held` (whether their
jobs are counted: they have a budget). Here, after the triggers exist and in the same
transaction, the tenants with a budget are flagged and their unfinished jobs marked, which
the triggers sum: on PostgreSQL creating a trigger locks out writes to jobs until the
commit, so no job is missed or counted twice; an SQLite database has one writer.

A partial index finds the jobs cancelled while they ran whose usage is not recorded yet
(they hold their reservation for a grace after the cancel), without reading the others.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from tierq.models.tables import SQL_DIR, held_trigger_statements, sql_statements

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

ADMIT = SQL_DIR / "0017_tierq_admit.sql"
# (trigger, its table, the dialects that have it)
TRIGGERS = (
    ("jobs_hold_inserted", "jobs", ("postgresql", "sqlite")),
    ("jobs_hold_resumed", "jobs", ("postgresql", "sqlite")),
    ("jobs_hold_marked", "jobs", ("postgresql", "sqlite")),
    ("jobs_hold_ended", "jobs", ("postgresql", "sqlite")),
    ("jobs_hold_deleted", "jobs", ("postgresql", "sqlite")),
    ("jobs_batch_counted", "jobs", ("postgresql",)),
    ("quotas_count_held", "quotas", ("postgresql",)),
    ("quotas_count_held_inserted", "quotas", ("sqlite",)),
    ("quotas_count_held_updated", "quotas", ("sqlite",)),
)
FUNCTIONS = (
    "tierq_jobs_held()",
    "tierq_jobs_batch_counted()",
    "tierq_quotas_count_held()",
    "tierq_output_bound(json)",
)
# A frozen copy of tables.UNBILLED_CANCEL.
UNBILLED_CANCEL = "status = 'cancelled' AND started_at IS NOT NULL AND prompt_tokens IS NULL"


def upgrade() -> None:
    op.create_table(
        "held_reservations",
        sa.Column(
            "tenant_id",
            sa.String(40),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("tier", sa.String(20), primary_key=True),
        sa.Column("input_price", sa.String(40), primary_key=True),
        sa.Column("output_price", sa.String(40), primary_key=True),
        sa.Column("slot", sa.SmallInteger(), primary_key=True),
        sa.Column("jobs", sa.BigInteger(), nullable=False),
        sa.Column("reserved_tokens", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
    )
    op.add_column(
        "jobs",
        sa.Column("held_counted", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.add_column(
        "tenants",
        sa.Column("counts_held", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    predicate = sa.text(UNBILLED_CANCEL)
    op.create_index(
        "ix_jobs_unbilled_cancel",
        "jobs",
        ["tenant_id", "finished_at"],
        postgresql_where=predicate,
        sqlite_where=predicate,
    )
    dialect = op.get_bind().dialect.name
    for statement in held_trigger_statements(dialect):
        op.execute(statement)
    op.execute(
        "UPDATE tenants SET counts_held = true WHERE id IN (SELECT tenant_id FROM quotas "
        "WHERE token_budget IS NOT NULL OR spend_budget IS NOT NULL)"
    )
    op.execute(
        "UPDATE jobs SET held_counted = true WHERE status IN ('queued', 'running') "
        "AND tenant_id IN (SELECT id FROM tenants WHERE counts_held)"
    )
    if dialect == "postgresql":
        for body in sql_statements(ADMIT):
            op.execute(body)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        for body in sql_statements(SQL_DIR / "0016_tierq_admit.sql"):
            op.execute(body)
    for name, table, dialects in TRIGGERS:
        if dialect in dialects:
            on = f" ON {table}" if dialect == "postgresql" else ""
            op.execute(f"DROP TRIGGER IF EXISTS {name}{on}")
    if dialect == "postgresql":
        for function in FUNCTIONS:
            op.execute(f"DROP FUNCTION IF EXISTS {function}")
    op.drop_index("ix_jobs_unbilled_cancel", table_name="jobs")
    # Not batch_alter_table: on SQLite it copies a table and drops the old one, and with
    # foreign keys on, dropping tenants would cascade to every tenant's rows elsewhere.
    op.execute("ALTER TABLE jobs DROP COLUMN held_counted")
    op.execute("ALTER TABLE tenants DROP COLUMN counts_held")
    op.drop_table("held_reservations")
