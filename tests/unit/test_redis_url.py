"""REDIS_URL's Sentinel form (tierq/core/redis_url.py) and what Celery is given for it."""

from __future__ import annotations

import pytest

from tierq.core.redis_url import SentinelTarget
from tierq.core.settings import Settings


def test_a_sentinel_url_names_its_sentinels_primary_database_and_password() -> None:
    target = SentinelTarget.parse("redis+sentinel://:s%40cret@10.0.0.1:26379,sent-2:26380/main/3")
    assert target == SentinelTarget((("10.0.0.1", 26379), ("sent-2", 26380)), "main", 3, "s@cret")
    assert target.kombu_url() == (
        "sentinel://:s%40cret@10.0.0.1:26379/3;sentinel://:s%40cret@sent-2:26380/3"
    )
    plain = SentinelTarget.parse("redis+sentinel://h:1/p")
    assert plain == SentinelTarget((("h", 1),), "p", 0, None)
    assert SentinelTarget.parse("redis://localhost:6379/0") is None


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://h/p",  # no port
        "redis+sentinel://h:1",  # no primary
        "redis+sentinel://h:1/p/x",  # a database that is not a number
        "redis+sentinel://h:1/p/0/more",
    ],
)
def test_a_malformed_sentinel_url_is_refused_at_start(url: str) -> None:
    with pytest.raises(ValueError):
        Settings(redis_url=url, _env_file=None)  # type: ignore[call-arg]


def test_celery_is_given_kombus_sentinel_urls() -> None:
    settings = Settings(redis_url="redis+sentinel://a:1,b:2/tierq/0", _env_file=None)  # type: ignore[call-arg]
    assert settings.celery_broker_url == "sentinel://a:1/0;sentinel://b:2/0"
