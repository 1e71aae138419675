"""Who owns an API key, remembered for a few seconds by each API process.

Every request is authenticated; looking the key up in PostgreSQL each time made
authentication the API's largest single cost under a flood of requests. Requests that
miss the cache for the same key at once share one lookup (`lookup`): a cold burst of N
requests from a new key took N pooled connections for N identical reads. An entry lives
AUTH_CACHE_TTL_S at most, and goes at once when its key is revoked or its tenant
suspended, deleted or changed: the admin API publishes that on the access channel, which
every API process's stream hub reads (tierq/api/streams/; the process that made the change
forgets it before answering). Admission never relies on the cache: it reads the tenant's and the
key's state again under the tenant's lock, in the transaction that writes the job.

Requests with a wrong key must not cost the others: a secret that cannot be a key (not
"tq-" and 43 URL-safe characters, as every key is issued) is refused without a lookup; a
key found to own nothing is remembered as such for the TTL (a misconfigured client
retrying costs one lookup, not one a request); and at most AUTH_LOOKUP_CONCURRENCY
lookups run at once in a process, with at most AUTH_LOOKUP_QUEUE waiting (beyond, 503
with Retry-After, without a lookup). A flood of random well-formed keys thus holds a few
of the pool's connections, and requests with a known key, answered from the cache, do not
wait behind it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

from tierq.models.tenants import KEY_PREFIX, KeyOwner

MAX_ENTRIES = 10_000
# What tierq/models/tenants.py `issue_key` issues: the prefix and secrets.token_urlsafe(32).
_KEY_SHAPE = re.compile(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{43}")


def well_formed(secret: str) -> bool:
    """Whether `secret` could be a key tierq issued (else no lookup is worth making)."""
    return _KEY_SHAPE.fullmatch(secret) is not None


class LookupsOverloaded(Exception):
    """Too many key lookups wait in this process: the request is refused unanswered."""


class KeyCache:
    def __init__(self, ttl_s: float, lookup_concurrency: int = 4, lookup_queue: int = 256) -> None:
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[float, KeyOwner]] = OrderedDict()
        self._misses: OrderedDict[str, float] = OrderedDict()  # key hash -> expiry
        self._lookups = asyncio.Semaphore(max(1, lookup_concurrency))
        self.lookup_queue = lookup_queue
        self._waiting = 0
        self._loading: dict[str, asyncio.Future[KeyOwner | None]] = {}
        self._generation = 0  # moves on with every forget(): a load begun before it is stale
        _caches.add(self)

    async def lookup(
        self, key_hash: str, load: Callable[[], Awaitable[KeyOwner | None]]
    ) -> KeyOwner | None:
        """The cached owner, else `load()`'s — one load per key at a time, which every
        request that misses meanwhile awaits. What a load began before a revocation (a
        `forget`) found is answered to its waiters but not kept."""
        owner = self.get(key_hash)
        if owner is not None:
            return owner
        if self._known_miss(key_hash):
            return None
        pending = self._loading.get(key_hash)
        if pending is None:
            if self._waiting >= self.lookup_queue:
                raise LookupsOverloaded
            pending = asyncio.ensure_future(self._load(key_hash, load))
            self._loading[key_hash] = pending
            pending.add_done_callback(lambda done: self._loaded(key_hash, done))
        # Shielded: a waiter that goes away (its client hung up) does not end the others'.
        return await asyncio.shield(pending)

    async def _load(
        self, key_hash: str, load: Callable[[], Awaitable[KeyOwner | None]]
    ) -> KeyOwner | None:
        generation = self._generation
        self._waiting += 1
        entered = False
        try:
            async with self._lookups:
                self._waiting -= 1
                entered = True
                owner = await load()
        finally:
            if not entered:  # cancelled while it waited
                self._waiting -= 1
        if generation == self._generation:
            if owner is not None:
                self.put(key_hash, owner)
            else:
                self._miss(key_hash)
        return owner

    def _known_miss(self, key_hash: str) -> bool:
        expires = self._misses.get(key_hash)
        if expires is None:
            return False
        if time.monotonic() >= expires:
            del self._misses[key_hash]
            return False
        return True

    def _miss(self, key_hash: str) -> None:
        if self.ttl_s <= 0:
            return
        self._misses[key_hash] = time.monotonic() + self.ttl_s
        self._misses.move_to_end(key_hash)
        while len(self._misses) > MAX_ENTRIES:
            self._misses.popitem(last=False)

    def _loaded(self, key_hash: str, done: asyncio.Future[KeyOwner | None]) -> None:
        if self._loading.get(key_hash) is done:
            del self._loading[key_hash]
        if not done.cancelled():
            done.exception()  # seen, if every waiter went away before it ended

    def get(self, key_hash: str) -> KeyOwner | None:
        found = self._entries.get(key_hash)
        if found is None:
            return None
        expires, owner = found
        if time.monotonic() >= expires:
            del self._entries[key_hash]
            return None
        return owner

    def put(self, key_hash: str, owner: KeyOwner) -> None:
        if self.ttl_s <= 0:
            return
        self._entries[key_hash] = (time.monotonic() + self.ttl_s, owner)
        self._entries.move_to_end(key_hash)
        while len(self._entries) > MAX_ENTRIES:
            self._entries.popitem(last=False)

    def claim_touch(
        self, key_hash: str, owner: KeyOwner, now: datetime, resolution: timedelta
    ) -> bool:
        """Whether this request should record the key's use (its `last_used_at` is older
        than `resolution`); the first to ask is told yes and the cached entry moves on at
        once, so a burst records it once, not once per request."""
        current = self.get(key_hash) or owner
        if current.last_used_at is not None and current.last_used_at >= now - resolution:
            return False
        self.put(key_hash, dataclasses.replace(current, last_used_at=now))
        return True

    def forget(self, what: str) -> None:
        """An access message: "key:<id>" (revoked), "tenant:<id>" (suspended or deleted)
        or "changed:<id>" (its tiers, weight or quotas changed)."""
        self._generation += 1
        # A tenant let back in, or anything else: a key that owned nothing may own now.
        self._misses.clear()
        kind, _, ident = what.partition(":")
        if kind == "key":
            stale = [h for h, (_, o) in self._entries.items() if o.key_id == ident]
        else:
            stale = [h for h, (_, o) in self._entries.items() if o.tenant.id == ident]
        for key_hash in stale:
            del self._entries[key_hash]


_caches: weakref.WeakSet[KeyCache] = weakref.WeakSet()


def forget_in_process(what: str) -> None:
    """Forget at once in this process (the admin API's own change is in effect before it
    answers); other processes hear it on the access channel."""
    for cache in list(_caches):
        cache.forget(what)
