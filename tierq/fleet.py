"""What the fleet serves, as its workers announce it, for the hosts that admit work.

A worker's heartbeat names its model and the context length its engine was built with; a
worker that has the model's folder also publishes the model's tokenizer files to Redis.
An API or Celery process — which may run on a host with neither the worker's settings
nor the model's folder — refreshes its view from them (`refresh`, at most every
REFRESH_S): admission then validates `max_tokens` and prompts against the context length
the fleet's live workers serve (the smallest, if they differ; its own MAX_MODEL_LEN only
while no live worker says), and counts prompts with the model's own tokenizer, fetched
into its state folder, exactly as on a host with the folder (tierq.token_count).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from tierq import token_count
from tierq.aio import raise_if_cancelled
from tierq.queue import live_workers
from tierq.redis_names import RedisNames
from tierq.settings import Settings

log = logging.getLogger(__name__)

REFRESH_S = 2.0
# What counting a prompt needs of a model's folder (tierq.token_count.PromptCounter).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DIGEST = "sha256"  # the hash field that names the published files' version

# Per deployment (its Redis prefix): model -> the context length its live workers serve,
# and when it was last read.
_context: dict[str, dict[str, int]] = {}
_refreshed_at: dict[str, float] = {}


def max_model_len(settings: Settings) -> int:
    """The served model's context length: the fleet's, else this process's setting."""
    served = _context.get(settings.redis_prefix, {})
    return served.get(settings.served_model_name, settings.max_model_len)


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


async def publish_tokenizer(r: Any, names: RedisNames, model: str, folder: Path) -> bool:
    """A worker's: put its model folder's tokenizer files in Redis (if it has them and they
    are not there already, as after a Redis flush). Whether it wrote them."""
    files = {n: (folder / n).read_bytes() for n in TOKENIZER_FILES if (folder / n).is_file()}
    if "tokenizer.json" not in files:
        return False
    digest = _digest(files)
    key = names.model_tokenizer(model)
    if await r.hget(key, DIGEST) == digest:
        return False
    await r.hset(key, mapping={**{n: data.decode() for n, data in files.items()}, DIGEST: digest})
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


async def _read(r: Any, names: RedisNames, settings: Settings) -> None:

    alive, _ = await live_workers(r, names, settings.worker_dead_after_s)
    served: dict[str, int] = {}
    for hb in alive:
        if hb.model and hb.max_model_len > 0:
            served[hb.model] = min(served.get(hb.model, hb.max_model_len), hb.max_model_len)
    if served != _context.get(names.prefix):
        log.info("the fleet serves %s", served or "nothing yet")
        _context[names.prefix] = served
    if token_count.has_own_tokenizer(settings):
        return
    key = names.model_tokenizer(settings.served_model_name)
    published = await r.hget(key, DIGEST)
    folder = token_count.fleet_folder(settings)
    kept = folder / DIGEST
    if not published or (kept.is_file() and kept.read_text() == published):
        return
    files = await r.hgetall(key)
    _write(folder, {n: files[n] for n in TOKENIZER_FILES if n in files}, published)
    token_count.forget(folder)
    log.info("using the fleet's tokenizer of %s (%s)", settings.served_model_name, published[:12])


def _write(folder: Path, files: dict[str, str], digest: str) -> None:
    """The files, then their digest, in a folder that appears whole (renamed into place)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    fresh = folder.with_name(f".{folder.name}.{os.getpid()}")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir()
    for name, text in files.items():
        (fresh / name).write_text(text)
    (fresh / DIGEST).write_text(digest)
    old = folder.with_name(f".{folder.name}.old.{os.getpid()}")
    if folder.exists():
        folder.rename(old)
    fresh.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
