"""Settings normalisation and request validation (no services needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.requests import JobCreate
from tierq.settings import Settings


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


def test_job_defaults_and_params() -> None:
    body = JobCreate.model_validate({"prompt": "hi"})
    assert body.tier is None and body.max_tokens == 256  # None: the tenant's default tier
    assert body.params() == {
        "max_tokens": 256,
        "temperature": 1.0,
        "top_p": 1.0,
        "stop": None,
        "seed": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
        "ignore_eos": False,
    }
    assert JobCreate.model_validate({"prompt": "x", "stop": "END"}).stop == ["END"]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": ""},
        {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"prompt": "a", "tier": "gold"},
        {"prompt": "a", "seed": "x"},
        {"prompt": "a", "stop": [""]},
        {"prompt": "a", "max_tokens": 4, "min_tokens": 5},
        {"prompt": "a", "metadata": {str(i): "v" for i in range(17)}},
    ],
)
def test_invalid_job_bodies(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        JobCreate.model_validate(body)


def test_blank_is_the_documents_whitespace_not_pythons() -> None:
    """NOT_BLANK is read by JSON Schema's (ECMA-262) regular expressions, whose `\\s` is not
    Python's: a prompt of U+001E conforms to the document, so it must be accepted; one of
    U+FEFF does not, so it must be refused."""
    from services.requests import blank

    for text in ("\x1c", "\x1d", "\x1e", "\x1f", "\x85", "a"):
        assert not blank(text)
        assert JobCreate(prompt=text).prompt == text
    for text in (" ", "\t\n\r\x0b\x0c", "\xa0", "\u2000\u200a", "\u3000", "\ufeff"):
        assert blank(text)
        with pytest.raises(ValidationError):
            JobCreate(prompt=text)
        with pytest.raises(ValidationError):
            JobCreate(messages=[{"role": "user", "content": text}])


def test_every_setting_is_in_the_readme() -> None:
    """One spelling for each setting: every Settings field has its row in the README's
    configuration table (the variable is the field's name in capitals)."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("## Configuration")
    table = readme[start : readme.index("\n## ", start + 1)]
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", table))
    missing = [f.upper() for f in Settings.model_fields if f.upper() not in documented]
    assert not missing, missing
