"""A worker's id is its inbox and its heartbeat: two live processes under one id would read
one inbox and overwrite one heartbeat. A worker starting under an id whose heartbeat is
live takes it only from a predecessor that is gone: its own host's process that no longer
runs (a supervisor's restart after a crash: at once), or a heartbeat that stops moving
(another host's, or a frozen one: once WORKER_DEAD_AFTER_S passes without a refresh). A
heartbeat refreshed meanwhile has a live holder, and the new worker refuses to start —
unless it is draining (a rolling restart): then it waits for it to retire or go stale."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tierq.core import scripts
from tierq.core.messages import Heartbeat
from tierq.core.redis_conn import redis_now
from tierq.core.redis_names import RedisNames


class WorkerIdTaken(RuntimeError):
    """Another live worker holds this worker id."""


# Holders of this process's running workers (an in-process worker that ended is gone).
_LIVE: set[str] = set()


def _machine() -> str:
    """This kernel's boot and pid namespace: a pid means the same process only where both
    match (containers sharing a host name, with host networking, have pid namespaces of
    their own; a reboot starts pids again). "?" for what cannot be read."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "?"
    try:
        namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        namespace = "?"
    return f"{boot}.{namespace}"


def holder_token() -> str:
    """This process, as its heartbeats name it: host, pid, boot and pid namespace, and a
    nonce (pids are reused)."""
    return f"{os.uname().nodename}:{os.getpid()}:{_machine()}:{secrets.token_hex(4)}"


def hold(holder: str) -> None:
    _LIVE.add(holder)


def release(holder: str) -> None:
    _LIVE.discard(holder)


def _gone_from_this_host(holder: str) -> bool:
    """The holder ran on this machine (same host name, boot and pid namespace), in a
    process that has ended or a worker of this process that is no longer running."""
    fields = holder.split(":")
    if len(fields) != 4 or fields[0] != os.uname().nodename or not fields[1].isdigit():
        return False
    if fields[2] != _machine() or "?" in fields[2]:
        return False
    pid = int(fields[1])
    if pid == os.getpid():
        return holder not in _LIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


async def claim(
    r: aioredis.Redis,
    names: RedisNames,
    worker_id: str,
    holder: str,
    dead_after_s: float,
    poll_s: float,
) -> None:
    """Return once this process holds `worker_id` (its heartbeat names `holder`, draining
    and empty until the worker's first real one); raise WorkerIdTaken if another live
    process holds it (its heartbeat moved while this waited)."""
    take = r.register_script(scripts.source("take_worker_id"))
    while True:
        raw = await _judged(r, names, worker_id, holder, dead_after_s, poll_s)
        mine = Heartbeat(worker_id, 0, 0, await redis_now(r), draining=True, holder=holder)
        if await take(keys=[names.workers], args=[worker_id, raw or "", mine.encode()]):
            return


async def check(
    r: aioredis.Redis, names: RedisNames, worker_id: str, dead_after_s: float, poll_s: float
) -> None:
    """`claim`'s judgment without taking the id: raise WorkerIdTaken now if a live worker
    holds it (before an engine spends a minute loading a model for nothing)."""
    await _judged(r, names, worker_id, None, dead_after_s, poll_s)


async def _judged(
    r: aioredis.Redis,
    names: RedisNames,
    worker_id: str,
    holder: str | None,
    dead_after_s: float,
    poll_s: float,
) -> str | None:
    """The id's heartbeat as read, once its holder — unless it is `holder`, this
    process's own claim — is gone; WorkerIdTaken when that holder lives."""
    raw: Any = await r.hget(names.workers, worker_id)  # str: decoded responses
    if raw is not None:
        last = Heartbeat.decode(raw)
        if last.holder != holder:
            await _wait_out(r, names, worker_id, last, dead_after_s, poll_s)
    return raw


async def _wait_out(
    r: aioredis.Redis,
    names: RedisNames,
    worker_id: str,
    last: Heartbeat,
    dead_after_s: float,
    poll_s: float,
) -> None:
    """Return when `last`'s holder is gone; raise WorkerIdTaken when it lives."""
    if last.holder and _gone_from_this_host(last.holder):
        return
    while True:
        if await redis_now(r) - last.ts > dead_after_s:
            return  # not refreshed for longer than a live worker ever waits
        await asyncio.sleep(poll_s)
        raw = await r.hget(names.workers, worker_id)
        if raw is None:
            return  # retired meanwhile
        now = Heartbeat.decode(raw)
        if now.ts != last.ts and now.draining and now.holder == last.holder:
            last = now  # a predecessor draining (a rolling restart): wait for it to retire
            continue
        if now.ts != last.ts:
            raise WorkerIdTaken(
                f"worker id {worker_id!r} is held by a live worker ({now.holder or 'unknown'}"
                f" refreshed its heartbeat); give each worker its own WORKER_ID"
            )
