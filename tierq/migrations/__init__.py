"""Alembic migrations, and the helpers that run them from code (`tierq migrate`, tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent


def alembic_config(url: str, transaction_pooling: bool = False) -> Config:
    """`transaction_pooling`: `url` reaches PostgreSQL through a pooler in transaction mode
    (DATABASE_TRANSACTION_POOLING; tierq/models/db.py)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["database_url"] = url
    cfg.attributes["transaction_pooling"] = transaction_pooling
    return cfg


def upgrade(url: str, revision: str = "head", transaction_pooling: bool = False) -> None:
    command.upgrade(alembic_config(url, transaction_pooling), revision)


def downgrade(url: str, revision: str = "base", transaction_pooling: bool = False) -> None:
    command.downgrade(alembic_config(url, transaction_pooling), revision)
