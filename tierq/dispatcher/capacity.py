"""How many workers the work needs: the autoscaling signal (`tierq_desired_workers`).

Pure: the dispatcher (tierq/dispatcher/loop.py) feeds it what it sees each second — each tier's
waiting jobs and their estimated tokens, the jobs running, the slots of a worker, and the
tokens a worker served per second lately — and exports the answer per model. The rule:

- what runs, and every interactive job that waits, needs a slot now;
- the work arriving must be kept up with: the jobs admitted per second times the tokens
  a finished job cost lately, over one worker's measured rate — the larger of this and
  the slots term, since what runs is serving what arrives;
- the work waiting in the other tiers must be served within its tier's SLO: its tokens
  over the SLO is a rate, in workers at the measured rate of one (before any measurement,
  each waiting job counts as a slot);
- the sum, rounded up; 0 with nothing running or waiting, else at least 1.

Every term only grows with the work, so the signal never asks for fewer workers when more
work arrives (tests/unit/test_capacity.py checks it over random inputs).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tierq.core.tiers import Tier


@dataclass(frozen=True)
class Waiting:
    tier: Tier
    jobs: int
    tokens: float  # their estimated work: prompt and output tokens


def desired_workers(
    waiting: Sequence[Waiting],
    running: int,
    slots_per_worker: int,
    tokens_per_s_per_worker: float | None,
    slo_s: Mapping[Tier, float],
    arriving_tokens_per_s: float = 0.0,
) -> int:
    if running <= 0 and all(w.jobs <= 0 for w in waiting):
        return 0
    slots = max(1, slots_per_worker)
    now = running + sum(w.jobs for w in waiting if w.tier == Tier.INTERACTIVE)
    workers = now / slots
    if tokens_per_s_per_worker and tokens_per_s_per_worker > 0:
        workers = max(workers, max(0.0, arriving_tokens_per_s) / tokens_per_s_per_worker)
    for w in waiting:
        if w.tier == Tier.INTERACTIVE or w.jobs <= 0:
            continue
        if tokens_per_s_per_worker and tokens_per_s_per_worker > 0:
            workers += w.tokens / max(slo_s.get(w.tier, 1.0), 1e-3) / tokens_per_s_per_worker
        else:
            workers += w.jobs / slots
    return max(1, math.ceil(workers - 1e-9))


class ServedRate:
    """What one worker serves per second at capacity: tokens served while work waited
    (an idle spell measures demand, not capacity, and is left out), each report divided
    by the workers alive then, over the seconds of the last `window_s` that had any."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._total = 0.0

    def add(self, now: float, tokens: int, workers: int) -> None:
        if workers <= 0:
            return
        share = tokens / workers
        self._events.append((now, share))
        self._total += share

    def per_worker(self, now: float) -> float | None:
        """None until a first report while work waited: nothing measured yet."""
        horizon = now - self.window_s
        while self._events and self._events[0][0] < horizon:
            self._total -= self._events.popleft()[1]
        if not self._events:
            return None
        seconds = len({int(at) for at, _ in self._events})
        return self._total / seconds


class ArrivalRate:
    """Jobs arriving per second over the last `window_s`, from a counter of arrivals
    (`RedisNames.arrivals`, counted where jobs are admitted; jobs put back are not
    arrivals): each tick adds the counter's growth since the one before."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._ticks: deque[tuple[float, int]] = deque()  # (at, arrivals since the last)
        self._last: int | None = None

    def tick(self, now: float, total: int) -> None:
        if self._last is not None:
            # A counter that went back (Redis restarted empty) counts nothing this tick.
            self._ticks.append((now, max(0, total - self._last)))
        self._last = total
        while self._ticks and self._ticks[0][0] < now - self.window_s:
            self._ticks.popleft()

    def per_second(self) -> float:
        if len(self._ticks) < 2:
            return 0.0
        span = self._ticks[-1][0] - self._ticks[0][0]
        # The first tick's arrivals came before the span starts: leave them out.
        return sum(n for _, n in list(self._ticks)[1:]) / span if span > 0 else 0.0


class TokensPerJob:
    """The tokens a finished job cost (prompt and output, as served), on average over the
    last `window_s`: what an arriving job will ask of the workers."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._jobs: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, now: float, tokens: int) -> None:
        self._jobs.append((now, tokens))
        self._total += tokens

    def mean(self, now: float) -> float | None:
        while self._jobs and self._jobs[0][0] < now - self.window_s:
            self._total -= self._jobs.popleft()[1]
        return self._total / len(self._jobs) if self._jobs else None
