"""Redis's server-side scripts. Each is a file of its own, `tierq/core/lua/<name>.lua` (its
KEYS and ARGV described at its top), read once per process by `source`; a caller
registers it on its client once (`r.register_script(scripts.source(name))`), and
redis-py then runs it by EVALSHA and loads it again where the server lacks it (after a
restart, a failover or SCRIPT FLUSH).

They live in the core beside `redis_names.py`, whose keys they work on, whichever layer
runs them: a script is data sent to Redis, not code any layer imports.
"""

from __future__ import annotations

import functools
from importlib import resources


@functools.cache
def source(name: str) -> str:
    """The text of `tierq/core/lua/<name>.lua`."""
    return (resources.files(__package__) / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def names() -> list[str]:
    """Every script's name."""
    folder = resources.files(__package__) / "lua"
    return sorted(p.name.removesuffix(".lua") for p in folder.iterdir() if p.name.endswith(".lua"))
