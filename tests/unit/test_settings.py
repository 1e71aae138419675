"""Settings: normalisation, the embedded default, and the reference's table of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierq.core.settings import Settings


def make(**kw: object) -> Settings:
    return Settings(_env_file=None, **kw)  # type: ignore[call-arg, arg-type]


def test_embedded_default_uses_sqlite_and_a_unix_socket(tmp_path: Path) -> None:
    s = make(state_dir=tmp_path, database_url="", redis_url=None)
    assert s.embedded
    assert s.resolved_database_url == f"sqlite+aiosqlite:///{tmp_path / 'tierq.db'}"
    assert s.resolved_redis_url == f"unix://{tmp_path / 'redis.sock'}"
    assert s.celery_broker_url == f"redis+socket://{tmp_path / 'redis.sock'}"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgres://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgresql://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("sqlite:////tmp/x.db", "sqlite+aiosqlite:////tmp/x.db"),
    ],
)
def test_database_urls_get_async_drivers(given: str, expected: str) -> None:
    s = make(database_url=given, redis_url="redis://h:6379/0")
    assert s.resolved_database_url == expected and not s.embedded
    assert s.celery_broker_url == "redis://h:6379/0"


def test_every_setting_is_in_the_reference() -> None:
    """One spelling for each setting: every Settings field has its row in the settings
    reference (docs/reference/settings.md; the variable is the field's name in capitals)."""
    import re

    table = (Path(__file__).resolve().parents[2] / "docs/reference/settings.md").read_text()
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", table))
    missing = [f.upper() for f in Settings.model_fields if f.upper() not in documented]
    assert not missing, missing
