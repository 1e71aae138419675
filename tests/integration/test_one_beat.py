"""One beat across hosts (tierq/workers/beat.py): real `celery beat` processes, as each host of a
fleet starts one, of which only the lease holder sends the periodic tasks; SIGKILL of the
holder, a planned stop and the lease lost with a Redis flush each leave one beat sending."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.helpers import until
from tests.integration.celery_proc import child_env
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings

pytestmark = pytest.mark.integration

LEASE_S = 6.0  # a standby asks every 2 s
SENT = "Scheduler: Sending due task"


class Beat:
    def __init__(self, settings: Settings, name: str, lease_s: float = LEASE_S) -> None:
        self.log = Path(settings.state_dir) / f"{name}.log"
        schedule = Path(settings.state_dir) / f"{name}-schedule"
        env = child_env(settings, BEAT_LEASE_S=str(lease_s), BATCH_TICK_S="0.3")
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "celery", "-A", "tierq.workers.celery_app", "beat"),
                    *("--loglevel=INFO", "-s", str(schedule)),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def sent(self) -> int:
        """Tasks it has sent so far."""
        return self.log.read_text(errors="replace").count(SENT) if self.log.exists() else 0

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        self.proc.wait(20)


@pytest.fixture
async def beats(settings: Settings, redis_client: aioredis.Redis) -> AsyncIterator[list[Beat]]:
    started: list[Beat] = []
    yield started
    for beat in started:
        beat.signal(signal.SIGKILL)
    names = RedisNames(settings.redis_prefix)
    await redis_client.delete(names.celery_queue, names.reconcile_queue)  # nobody consumed them


async def _one_sender(beats: list[Beat], seconds: float = 3.0) -> Beat:
    """The one of `beats` that sends tasks over `seconds`: exactly one does."""
    before = [b.sent() for b in beats]
    await asyncio.sleep(seconds)
    sending = [b for b, n in zip(beats, before, strict=True) if b.sent() > n]
    assert len(sending) == 1, [b.output() for b in beats]
    return sending[0]


async def test_of_several_beats_one_sends_and_a_standby_takes_over(
    settings: Settings, redis_client: aioredis.Redis, beats: list[Beat]
) -> None:
    a = Beat(settings, "beat-a")
    beats.append(a)
    await until(lambda: a.sent() > 0, f"beat a sends:\n{a.output()}")
    b, c = Beat(settings, "beat-b"), Beat(settings, "beat-c")
    beats += [b, c]
    await until(lambda: "stands by" in b.output() and "stands by" in c.output(), "standbys")
    assert await _one_sender([a, b, c]) is a

    # The holder killed: one of the others takes over once its lease lapses.
    a.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    await until(lambda: b.sent() + c.sent() > 0, "a standby takes over", LEASE_S * 3)
    assert time.monotonic() - killed_at < LEASE_S * 1.5
    await _one_sender([b, c])

    # The lease lost as in a Redis flush: one beat takes it again and goes on sending.
    await redis_client.delete(RedisNames(settings.redis_prefix).beat_lease)
    holder = await _one_sender([b, c])
    other = c if holder is b else b

    # A planned stop lets the lease go: the standby takes over at its next ask (a third
    # of the lease), well before the lease would have lapsed.
    holder.signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    sent = other.sent()
    await until(lambda: other.sent() > sent, "the standby takes over", LEASE_S * 3)
    assert time.monotonic() - stopped_at < LEASE_S * 0.6, other.output()


async def test_a_beat_restarted_after_sigkill_takes_its_lease_back_at_once(
    settings: Settings, beats: list[Beat]
) -> None:
    """A supervisor restarts a killed beat with the same schedule file on the same host:
    it is the same holder, and sends again without waiting for its old lease to lapse
    (30 s here: 20 s or more after the kill)."""
    first = Beat(settings, "beat-a", lease_s=30)
    beats.append(first)
    await until(lambda: first.sent() > 0, f"beat a sends:\n{first.output()}")
    first.signal(signal.SIGKILL)
    again = Beat(settings, "beat-a", lease_s=30)  # its log goes on in the same file
    beats.append(again)
    sent = again.sent()
    restarted_at = time.monotonic()
    await until(lambda: again.sent() > sent, "the restarted beat sends", 60)
    assert time.monotonic() - restarted_at < 15, again.output()
