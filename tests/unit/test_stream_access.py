"""Closing the streams of a suspended tenant or a revoked key (tierq/api/streams/access.py):
which followers an access message closes, and with what reason."""

from __future__ import annotations

import pytest

from tierq.api.streams.access import Access
from tierq.api.streams.hub import Follower, StreamClosed


def _followers() -> list[Follower]:
    return [
        Follower("job_1", "t1", "k1", "c1"),
        Follower("job_2", "t1", "k2", "c2"),
        Follower("job_3", "t2", "k3", "c3"),
    ]


async def test_a_suspended_tenant_closes_its_streams_only_after_what_they_had() -> None:
    followers = _followers()
    heard: list[str] = []
    access = Access(lambda: followers, [heard.append])
    followers[0].push("an event before the suspension")
    access.heard("tenant:t1")
    assert heard == ["tenant:t1"]
    assert [f.closed is not None for f in followers] == [True, True, False]
    assert await followers[0].next(0.01) == "an event before the suspension"
    with pytest.raises(StreamClosed) as closed:
        await followers[0].next(0.01)
    assert closed.value.code == "tenant_suspended" and closed.value.status == 403
    assert await followers[2].next(0.01) is None  # still open, nothing to say


async def test_a_revoked_key_closes_the_streams_it_opened() -> None:
    followers = _followers()
    access = Access(lambda: followers, [])
    access.heard("key:k2")
    assert [f.closed is not None for f in followers] == [False, True, False]
    with pytest.raises(StreamClosed) as closed:
        await followers[1].next(0.01)
    assert closed.value.code == "invalid_api_key" and closed.value.status == 401


async def test_a_change_closes_nothing_but_the_listeners_hear_it() -> None:
    followers = _followers()
    heard: list[str] = []
    access = Access(lambda: followers, [heard.append])
    access.heard("changed:t1")
    assert heard == ["changed:t1"]
    assert all(f.closed is None for f in followers)


async def test_keys_the_database_no_longer_accepts_close_their_streams() -> None:
    followers = _followers()
    access = Access(lambda: followers, [])
    access.unusable({"k1", "k3"})
    assert [f.closed is not None for f in followers] == [True, False, True]
    assert followers[0].closed is not None
    assert followers[0].closed.message == "The stream's API key is no longer valid."
