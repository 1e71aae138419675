"""What the fleet serves, as its workers announce it, for the hosts that admit work.

A worker's heartbeat names its model and the context length its engine was built with; a
worker that has the model's folder also publishes the model's tokenizer files to Redis.
An API or Celery process — which may run on a host with neither the worker's settings
nor the model's folder — refreshes its view from them (`refresh`, at most every
REFRESH_S): admission then validates `max_tokens` and prompts against the context length
the fleet's live workers serve (the smallest, if they differ; while none is alive, what
they last announced; its own MAX_MODEL_LEN only until a worker has said), and counts
prompts with the model's own tokenizer, fetched into its state folder, exactly as on a
host with the folder (tierq.core.token_count).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from tierq.core import token_count
from tierq.core.aio import raise_if_cancelled
from tierq.core.messages import Heartbeat
from tierq.core.queue import live_workers
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings

log = logging.getLogger(__name__)

REFRESH_S = 2.0
# What counting a prompt needs of a model's folder (tierq.core.token_count.PromptCounter).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DIGEST = "sha256"  # the hash field that names the published files' version

# Per deployment (its Redis prefix): model -> the context length its live workers serve,
# and when it was last read.
_context: dict[str, dict[str, int]] = {}
_refreshed_at: dict[str, float] = {}
_loaded: dict[str, str] = {}  # the tokenizer version this process counts with


def max_model_len(settings: Settings) -> int:
    """The served model's context length: the fleet's, else this process's setting."""
    served = _context.get(settings.redis_prefix, {})
    return served.get(settings.served_model_name, settings.max_model_len)


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def _files_of(folder: Path) -> tuple[dict[str, str], str] | None:
    """The folder's tokenizer files and their digest; None without a tokenizer.json."""
    files = {n: (folder / n).read_bytes() for n in TOKENIZER_FILES if (folder / n).is_file()}
    if "tokenizer.json" not in files:
        return None
    return {n: data.decode() for n, data in files.items()}, _digest(files)


async def publish_tokenizer(r: Any, names: RedisNames, model: str, folder: Path) -> bool:
    """A worker's: put its model folder's tokenizer files in Redis (if it has them and they
    are not there already, as after a Redis flush). Whether it wrote them."""
    found = await asyncio.to_thread(_files_of, folder)  # megabytes: off the event loop
    if found is None:
        return False
    files, digest = found
    key = names.model_tokenizer(model)
    if await r.hget(key, DIGEST) == digest:
        return False
    await r.hset(key, mapping={**files, DIGEST: digest})
    log.info("published the tokenizer of %s (%s)", model, digest[:12])
    return True


async def refresh(r: Any, names: RedisNames, settings: Settings) -> None:
    """Read the fleet's view again if REFRESH_S old. Errors keep the last view: Redis is
    away, and the caller's own calls will say so."""
    last = _refreshed_at.get(names.prefix)
    if last is not None and time.monotonic() - last < REFRESH_S:
        return
    _refreshed_at[names.prefix] = time.monotonic()
    try:
        await _read(r, names, settings)
    except Exception as exc:
        raise_if_cancelled(exc)
        log.warning("could not read the fleet's models: %s", exc)


def _served(heartbeats: list[Heartbeat]) -> dict[str, int]:
    served: dict[str, int] = {}
    for hb in heartbeats:
        if hb.model and hb.max_model_len > 0:
            served[hb.model] = min(served.get(hb.model, hb.max_model_len), hb.max_model_len)
    return served


async def _read(r: Any, names: RedisNames, settings: Settings) -> None:
    alive, dead = await live_workers(r, names, settings.worker_dead_after_s)
    # While no worker is alive (scaled to zero, a restart) the fleet still serves what it
    # served: the last heartbeats left, else the last view; never this host's setting
    # again once the fleet has said otherwise.
    served = _served(alive) or _served(dead)
    view = {**_context.get(names.prefix, {}), **served}
    if view != _context.get(names.prefix):
        log.info("the fleet serves %s", view)
        _context[names.prefix] = view
    if token_count.has_own_tokenizer(settings):
        return
    key = names.model_tokenizer(settings.served_model_name)
    published = await r.hget(key, DIGEST)
    if not published or _loaded.get(names.prefix) == published:
        return
    # One folder per version: processes sharing this host's state folder (uvicorn's
    # workers, Celery's pool) each write it whole or find it written, never half.
    folder = token_count.fleet_folder(settings) / str(published)[:32]
    if not (folder / DIGEST).is_file():
        files = await r.hgetall(key)
        if files.get(DIGEST) != published:
            return  # published again meanwhile: the next refresh takes that one
        wanted = {n: files[n] for n in TOKENIZER_FILES if n in files}
        await asyncio.to_thread(_write, folder, wanted, published)
    token_count.use_fleet_folder(settings, folder)
    _loaded[names.prefix] = published
    log.info("using the fleet's tokenizer of %s (%s)", settings.served_model_name, published[:12])


def _write(folder: Path, files: dict[str, str], digest: str) -> None:
    """The files, then their digest, in a folder that appears whole (renamed into place;
    if another process got there first, its folder is the same)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    fresh = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fresh.mkdir()
    try:
        for name, text in files.items():
            (fresh / name).write_text(text, encoding="utf-8")
        (fresh / DIGEST).write_text(digest, encoding="utf-8")
        os.rename(fresh, folder)
    except OSError:
        if not (folder / DIGEST).is_file():
            raise
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
