"""The scheduling policy: a pure function of the queue state and the workers' free slots.

No I/O, no clock of its own: the loop builds a `QueueState`, asks `assign()`, and carries
out the answer. Today: strict priority across tiers (interactive, then standard, then
batch), first come first served inside a tier, and each job to the worker with the most
free slots (spreading load). Minimum shares, tenant fairness and the interactive reserve
build on this same signature.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tierq.tiers import TIER_ORDER, Tier


@dataclass(frozen=True)
class QueuedJob:
    entry_id: str  # id of the tier-stream entry (the dispatcher acknowledges it)
    job_id: str
    tier: Tier
    tenant_id: str
    enqueued_at: float


@dataclass(frozen=True)
class WorkerSlots:
    worker_id: str
    free: int  # slots the worker advertised, less the jobs already in its inbox


@dataclass(frozen=True)
class Assignment:
    job: QueuedJob
    worker_id: str


def assign(
    queues: Mapping[Tier, Sequence[QueuedJob]], workers: Sequence[WorkerSlots]
) -> list[Assignment]:
    """Hand queued jobs to free worker slots, highest tier first, oldest first within a tier."""
    # Max-heap on free slots (ties by worker id, so the answer is deterministic).
    heap = [(-w.free, w.worker_id) for w in workers if w.free > 0]
    heapq.heapify(heap)
    out: list[Assignment] = []
    for tier in TIER_ORDER:
        for job in sorted(queues.get(tier, ()), key=lambda j: (j.enqueued_at, j.entry_id)):
            if not heap:
                return out
            neg_free, worker_id = heapq.heappop(heap)
            out.append(Assignment(job, worker_id))
            if neg_free + 1 < 0:
                heapq.heappush(heap, (neg_free + 1, worker_id))
    return out
