"""held_reservations: what queued and running jobs hold against budgets, as running sums
kept by triggers on jobs; tierq_admit reads them instead of summing a tenant's backlog

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 13:30:00.000000

The triggers are tierq/migrations/sql/0017_held_reservations.<dialect>.sql, which say what
they keep; the admission function is tierq/migrations/sql/0017_tierq_admit.sql. The sums of
the jobs queued or running now are taken here, after the triggers exist and in the same
transaction: on PostgreSQL, creating a trigger locks out writes to jobs until the commit,
so no job is counted twice or missed; an SQLite database has one writer.

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
TRIGGERS = ("jobs_hold_inserted", "jobs_hold_resumed", "jobs_hold_ended", "jobs_hold_deleted")
HELD = ("queued", "running")

# The sums of the jobs held now, grouped as the triggers keep them; `bound` is each
# dialect's output bound of a job's params.
_FILL = """
INSERT INTO held_reservations (tenant_id, tier, input_price, output_price, slot, jobs,
    reserved_tokens, prompt_tokens, output_tokens)
SELECT tenant_id, tier, coalesce(input_price, ''), coalesce(output_price, ''), 0, count(*),
    sum(reserved_tokens), sum({greatest}(reserved_tokens - bound, 0)), sum(bound)
FROM (SELECT tenant_id, tier, input_price, output_price, reserved_tokens, {bound} AS bound
      FROM jobs WHERE status IN ('queued', 'running')) held
GROUP BY 1, 2, 3, 4
"""
_BOUND = {
    "postgresql": "tierq_output_bound(params)",
    "sqlite": "coalesce(json_extract(params, '$.max_tokens'), 0)"
    " * coalesce(nullif(json_extract(params, '$.n'), 0), 1)",
}
_GREATEST = {"postgresql": "greatest", "sqlite": "max"}


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
    op.create_index(
        "ix_jobs_unbilled_cancel",
        "jobs",
        ["tenant_id", "finished_at"],
        postgresql_where=sa.text(
            "status = 'cancelled' AND started_at IS NOT NULL AND prompt_tokens IS NULL"
        ),
        sqlite_where=sa.text(
            "status = 'cancelled' AND started_at IS NOT NULL AND prompt_tokens IS NULL"
        ),
    )
    dialect = op.get_bind().dialect.name
    for statement in held_trigger_statements(dialect):
        op.execute(statement)
    op.execute(_FILL.format(bound=_BOUND[dialect], greatest=_GREATEST[dialect]))
    if dialect == "postgresql":
        for body in sql_statements(ADMIT):
            op.execute(body)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        for body in sql_statements(SQL_DIR / "0016_tierq_admit.sql"):
            op.execute(body)
    for name in TRIGGERS:
        on = " ON jobs" if dialect == "postgresql" else ""
        op.execute(f"DROP TRIGGER IF EXISTS {name}{on}")
    if dialect == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS tierq_jobs_hold()")
        op.execute("DROP FUNCTION IF EXISTS tierq_jobs_release()")
        op.execute("DROP FUNCTION IF EXISTS tierq_output_bound(json)")
    op.drop_index("ix_jobs_unbilled_cancel", table_name="jobs")
    op.drop_table("held_reservations")
