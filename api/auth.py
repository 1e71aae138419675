"""Who owns an API key, remembered for a few seconds by each API process.

Every request is authenticated; looking the key up in PostgreSQL each time made
authentication the API's largest single cost under a flood of requests. An entry lives
AUTH_CACHE_TTL_S at most, and goes at once when its key is revoked or its tenant
suspended, deleted or changed: the admin API publishes that on the access channel, which
every API process's EventHub reads (and the process that made the change forgets it
before answering). Admission never relies on the cache: it reads the tenant's and the
key's state again under the tenant's lock, in the transaction that writes the job.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict

from models.tenants import KeyOwner

MAX_ENTRIES = 10_000


class KeyCache:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[float, KeyOwner]] = OrderedDict()
        _caches.add(self)

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

    def forget(self, what: str) -> None:
        """An access message: "key:<id>" (revoked), "tenant:<id>" (suspended or deleted)
        or "changed:<id>" (its tiers, weight or quotas changed)."""
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
