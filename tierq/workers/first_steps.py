"""Which runs in the engine have not come through their first step yet, and when a suspect
may start.

When an engine dies, any job it ran may have caused it. Engines fail as a request is
scheduled (its prefill, a parameter the engine cannot take) or at one of its tokens: a job
that resumes after what it generated meets that token again at its first step. So the jobs
still in their first step when the engine dies are the suspects, and the jobs generating
fine beside them are not charged for the crash; only when none was in its first step do
all share it (tierq/workers/worker.py, tierq/core/messages.py `fault_share`).

A job already charged for a crash (a suspect) starts only once every other run in the
engine has passed its first step, one suspect at a time (for at most `wait_s`): should it
bring the engine down again, it stands alone in its first step and is charged the whole
fault, and the jobs beside it nothing. Everything else starts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection


class FirstSteps:
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._fresh: set[str] = set()  # job ids whose run has had no chunk yet
        self._none_fresh = asyncio.Event()
        self._none_fresh.set()
        self._gate = asyncio.Lock()  # held by the suspect in its first step
        self._gated: str | None = None

    async def begin(self, job_id: str, suspect: bool) -> None:
        """A run of `job_id` is about to enter the engine (a suspect waits its turn)."""
        if suspect:
            await self._gate.acquire()
            self._gated = job_id
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.wait_s):
                        while self._fresh:
                            self._none_fresh.clear()
                            await self._none_fresh.wait()
            except BaseException:
                self._release(job_id)
                raise
        self._fresh.add(job_id)

    def passed(self, job_id: str) -> None:
        """The run had its first chunk, or ended (idempotent)."""
        self._fresh.discard(job_id)
        if not self._fresh:
            self._none_fresh.set()
        self._release(job_id)

    def suspects(self, running: Collection[str]) -> set[str]:
        """Of the jobs that ran when the engine died, those that may have caused it."""
        fresh = self._fresh.intersection(running)
        return fresh or set(running)

    def _release(self, job_id: str) -> None:
        if self._gated == job_id:
            self._gated = None
            self._gate.release()
