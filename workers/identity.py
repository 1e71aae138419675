"""A worker's id is its inbox and its heartbeat: two live processes under one id would read
one inbox and overwrite one heartbeat. A worker starting under an id whose heartbeat is
live takes it only from a predecessor that is gone: its own host's process that no longer
runs (a supervisor's restart after a crash: at once), or a heartbeat that stops moving
(another host's, or a frozen one: once WORKER_DEAD_AFTER_S passes without a refresh). A
heartbeat refreshed meanwhile has a live holder, and the new worker refuses to start."""

from __future__ import annotations

import asyncio
import os
import secrets

import redis.asyncio as aioredis

from tierq.messages import Heartbeat
from tierq.redis_conn import redis_now
from tierq.redis_names import RedisNames


class WorkerIdTaken(RuntimeError):
    """Another live worker holds this worker id."""


def holder_token() -> str:
    """This process, as its heartbeats name it: host, pid and a nonce (pids are reused)."""
    return f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(4)}"


def _gone_from_this_host(holder: str) -> bool:
    """The holder ran on this host, in another process that has ended."""
    host, _, rest = holder.partition(":")
    pid_text = rest.partition(":")[0]
    if host != os.uname().nodename or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():  # an earlier worker of this process (its tasks are gone)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


# Take the id only if its heartbeat is still the one judged (none: ARGV[2] is ''): of two
# workers starting at once under one id, one takes it and the other judges the winner.
_TAKE = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if (current or '') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


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
    take = r.register_script(_TAKE)
    while True:
        raw = await r.hget(names.workers, worker_id)
        if raw is not None:
            await _wait_out(r, names, worker_id, Heartbeat.decode(raw), dead_after_s, poll_s)
        mine = Heartbeat(worker_id, 0, 0, await redis_now(r), draining=True, holder=holder)
        if await take(keys=[names.workers], args=[worker_id, raw or "", mine.encode()]):
            return


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
        if now.ts != last.ts:
            raise WorkerIdTaken(
                f"worker id {worker_id!r} is held by a live worker ({now.holder or 'unknown'}"
                f" refreshed its heartbeat); give each worker its own WORKER_ID"
            )
