"""Closing the streams of a suspended tenant or a revoked key, in every API process.

An admin change is told at once on the access channel, which the hub reads on its one
connection (`heard`); a message lost on the way is made good by the recheck's periodic
look at the followed keys (`unusable`). Either closes the matching followers: each ends
its stream with the reason, after what had already arrived for it."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tierq.api.streams.hub import Follower, StreamClosed


def suspended() -> StreamClosed:
    return StreamClosed("tenant_suspended", "The tenant was suspended.")


def revoked() -> StreamClosed:
    return StreamClosed("invalid_api_key", "The stream's API key was revoked.")


def unusable() -> StreamClosed:
    return StreamClosed("invalid_api_key", "The stream's API key is no longer valid.")


class Access:
    """`followers`: every follower of the process (the hub's); `listeners`: told every
    access message first (the process's cache of keys forgets what it names)."""

    def __init__(
        self,
        followers: Callable[[], Iterable[Follower]],
        listeners: list[Callable[[str], None]],
    ) -> None:
        self._followers = followers
        self._listeners = listeners

    def heard(self, what: str) -> None:
        """An access message: `tenant:<id>` (suspended or deleted), `key:<id>` (revoked),
        or another change (`changed:<id>`) that closes nothing but that the listeners hear."""
        for listener in self._listeners:
            listener(what)
        kind, _, ident = what.partition(":")
        for follower in self._followers():
            if kind == "tenant" and follower.tenant_id == ident:
                follower.close(suspended())
            elif kind == "key" and follower.key_id == ident:
                follower.close(revoked())

    def unusable(self, keys: set[str]) -> None:
        """The keys the database no longer accepts: their streams are closed."""
        for follower in self._followers():
            if follower.key_id in keys:
                follower.close(unusable())
