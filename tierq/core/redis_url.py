"""REDIS_URL's forms beside redis-py's own (`redis://`, `rediss://`, `unix://`): Redis under
Sentinel, `redis+sentinel://[:password@]host:port[,host:port...]/<primary name>[/<db>]` —
the sentinels to ask, the name of the primary they watch, and the database. The password
is the data nodes' (the sentinels are asked without one). Clients made from it find the
primary through the sentinels and find it again after a failover (tierq.core.redis_conn)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: tuple[tuple[str, int], ...]
    primary: str
    db: int
    password: str | None

    @classmethod
    def parse(cls, url: str) -> SentinelTarget | None:
        """The target of a `redis+sentinel://` URL; None for another scheme; ValueError for
        a malformed one."""
        parts = urlsplit(url)
        if parts.scheme != SENTINEL_SCHEME:
            return None
        where = parts.netloc.rpartition("@")
        password = unquote(where[0].partition(":")[2]) or None if where[0] else None
        sentinels = []
        for node in where[2].split(","):
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"a sentinel is host:port, not {node!r} (in {url!r})")
            sentinels.append((host, int(port)))
        path = [p for p in parts.path.split("/") if p]
        if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise ValueError(
                f"{url!r}: expected redis+sentinel://host:port[,host:port]/<primary>[/<db>]"
            )
        return cls(tuple(sentinels), path[0], int(path[1]) if len(path) == 2 else 0, password)

    def kombu_url(self) -> str:
        """The same for Celery's broker and result backend (kombu's `sentinel://` form; the
        primary's name goes in their transport options)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return ";".join(f"sentinel://{auth}{h}:{p}/{self.db}" for h, p in self.sentinels)
