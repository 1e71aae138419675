"""jobs.result_choices, and unfinished jobs of n choices holding n x max_tokens

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05 17:00:00.000000

A job asked for `n` > 1 choices (params "n") keeps its first choice where every job keeps
its result (result_text, finish_reason, result_logprobs) and the others in
`result_choices`: [{"index", "text", "finish_reason", "logprobs"}], in order.

It may generate max_tokens for each choice, so what an unfinished job holds against a
spend budget counts max_tokens x n at the output price. The admission function of
migration 0007 is replaced with that one change: its reading of a job's params max_tokens
becomes max_tokens x n (n absent: 1). Its text is 0007's, so the two cannot drift apart.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_ONE = "coalesce((params->>'max_tokens')::bigint, 0)"
_EACH = "coalesce((params->>'max_tokens')::bigint * coalesce((params->>'n')::bigint, 1), 0)"


def _function_of_0007() -> str:
    path = Path(__file__).with_name("0007_admission_function.py")
    spec = importlib.util.spec_from_file_location("tierq_migration_0007", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.FUNCTION)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("result_choices", sa.JSON(), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        text = _function_of_0007()
        assert text.count(_ONE) == 2, "migration 0007's function changed: revisit 0014"
        op.execute(text.replace(_ONE, _EACH))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_function_of_0007())
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("result_choices")
