"""The scheduling policy: which queued job goes to which worker slot, and what to preempt.

No I/O and no clock of its own: the dispatcher loop hands it the queues (per tier, per
tenant, each oldest first), the workers' free slots and the time, and carries out its
answer. Its only state is its own accounting (tokens served per tier over a sliding
window, a virtual token counter per tenant), so it is deterministic and unit-testable
with hand-built states.

The rules, in the order they apply to each free slot:

1. **Minimum shares.** A lower tier that is backlogged and has received less than its
   configured share of the tokens served over the window is served next (the most
   deprived first), so no backlogged tier starves. Otherwise:
2. **Strict priority** across tiers: interactive, then standard, then batch. When higher
   tiers are idle a lower tier may use every slot (work-conserving).
3. **Urgency within a tier.** A job that has waited longer than `urgency_fraction` of its
   tier's SLO goes before younger ones of its tier (oldest urgent first).
4. **Tenant fairness within a tier** (VTC, "Fairness in Serving Large Language Models",
   OSDI 2024): each tenant has a virtual counter of the tokens (prompt + generated) it was
   served, divided by its weight; the backlogged tenant with the smallest counter goes
   next. A tenant that becomes backlogged is lifted to the smallest counter of those
   already backlogged, so idle time earns no credit.
5. **Capacity.** A job goes only to a worker with a free slot; standard and batch work
   only below each worker's ceiling, so an arriving interactive job finds a slot at once.
   A worker whose engine preempts for priority advertises interactive-only slots beyond
   its engine's (the engine gives such a job a lower-tier request's slot, keeping that
   request's output); another keeps a reserve of its own slots free. The freest worker is
   chosen.

Preemption, where the engine cannot do it: when interactive jobs wait and no worker has
any free slot, the policy names running lower-tier jobs on workers whose engine does not
preempt for priority, to abort and re-queue at the head of their tier — batch before
standard, the most recently started first (the least work lost), never a job already
preempted `max_preemptions` times (no livelock).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierq.core.tiers import TIER_ORDER, Tier


@dataclass(frozen=True)
class QueuedJob:
    entry_id: str  # id of the stream entry (the dispatcher acknowledges it)
    job_id: str
    tier: Tier
    tenant_id: str
    enqueued_at: float
    cost: int = 1  # estimated tokens: prompt + max_tokens, corrected when the job finishes
    preemptions: int = 0
    prefix: str | None = None  # digest of its prompt's start: jobs sharing it share a cache
    stream: str = ""  # the stream it was read from (ids are unique within a stream only)


@dataclass(frozen=True)
class WorkerSlots:
    worker_id: str
    free: int  # slots free for any tier
    free_lower: int  # slots free for standard and batch (below the ceiling)
    engine_preempts: bool = False  # its engine preempts for priority: never abort its jobs
    capacity: int = 0  # its slots in all (0: unknown, taken as what is free)


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    tier: Tier
    worker_id: str
    started_at: float
    preemptions: int
    tenant_id: str = ""


@dataclass(frozen=True)
class Assignment:
    job: QueuedJob
    worker_id: str


@dataclass(frozen=True)
class PolicyConfig:
    min_share: Mapping[Tier, float] = field(
        default_factory=lambda: {Tier.STANDARD: 0.20, Tier.BATCH: 0.10}
    )
    window_s: float = 60.0
    slo_s: Mapping[Tier, float] = field(
        default_factory=lambda: {Tier.INTERACTIVE: 5.0, Tier.STANDARD: 300.0, Tier.BATCH: 86400.0}
    )
    urgency_fraction: float = 0.8
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    max_preemptions: int = 2
    # Cache-affine placement: a job goes to the worker its prefix hashes to first (among
    # those with a free slot) unless that worker would then run more than this share of
    # its slots beyond the least loaded worker; 0 places by free slots alone.
    affinity_slack: float = 0.25
    # When the job next in line would go to a worker that is not its own (its own are
    # full), one of its tenant's next `affinity_lookahead` jobs (same tier) whose own
    # worker that is goes first instead: a tenant's order bends by at most this many
    # places, tiers and tenants' shares not at all. 0: strict order within a tenant.
    affinity_lookahead: int = 8


class ServedWindow:
    """Tokens served per tier over the last `window_s` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, Tier, float]] = deque()
        self.totals: dict[Tier, float] = dict.fromkeys(TIER_ORDER, 0.0)

    def add(self, now: float, tier: Tier, tokens: float) -> None:
        self._events.append((now, tier, tokens))
        self.totals[tier] += tokens

    def expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._events and self._events[0][0] < horizon:
            _, tier, tokens = self._events.popleft()
            self.totals[tier] -= tokens

    def snapshot(self) -> list[list[Any]]:
        """The window's events summed per second and tier: [[second, tier, tokens], ...]."""
        summed: dict[tuple[int, str], float] = {}
        for at, tier, tokens in self._events:
            key = (int(at), tier.value)
            summed[key] = summed.get(key, 0.0) + tokens
        return [[at, tier, tokens] for (at, tier), tokens in summed.items()]

    def restore(self, events: list[list[Any]]) -> None:
        self._events.clear()
        self.totals = dict.fromkeys(TIER_ORDER, 0.0)
        for at, tier, tokens in sorted(events, key=lambda e: float(e[0])):
            self.add(float(at), Tier(tier), float(tokens))

    def shares(self) -> dict[Tier, float]:
        total = sum(max(0.0, v) for v in self.totals.values())
        if total <= 0:
            return dict.fromkeys(TIER_ORDER, 0.0)
        return {t: max(0.0, v) / total for t, v in self.totals.items()}


PASSED_OVER_KEPT = 1024  # past this many, the counts of jobs no longer queued are dropped
# Virtual counters kept per tier for tenants with nothing queued there. Once there are
# more than this many beyond the backlogged tenants' own number (the walk that forgets them
# looks at every counter, so it comes after as many tenants went idle as it costs), a
# counter at or below the backlogged tenants' smallest is forgotten (its tenant would be
# lifted to that floor on its return anyway), then, if still more than half this many, the
# smallest ones.
IDLE_COUNTERS_KEPT = 4096


def _forget_idle(counters: dict[str, float], backlogged: set[str], floor: float) -> None:
    """Bound the virtual counters of tenants with nothing queued (a dispatcher serves any
    number of tenants over its life, and its snapshot carries every counter). Those at or
    below `floor` lose nothing by going: a returning tenant is lifted to the floor. Past
    half of `IDLE_COUNTERS_KEPT` still, the smallest go first: the least credit forgiven."""
    idle = [(v, t) for t, v in counters.items() if t not in backlogged]
    for v, t in idle:
        if v <= floor:
            del counters[t]
    left = sorted((v, t) for v, t in idle if v > floor)
    for _, t in left[: max(0, len(left) - IDLE_COUNTERS_KEPT // 2)]:
        del counters[t]


class _TierIndex:
    """One tier's indexes, kept from round to round so that a round costs what changed,
    not every tenant with queued work: the backlogged tenants (those offered jobs at the
    round's start), a heap of (virtual counter, tenant) and one of (head's age key,
    tenant). Both heaps are lazy: every change of a counter or a head pushes a fresh
    entry, and a stale one is dropped when it surfaces."""

    def __init__(self) -> None:
        self.backlogged: set[str] = set()
        self.fair: list[tuple[float, str]] = []
        self.by_age: list[tuple[tuple[bool, float], str]] = []
        self.touched: set[str] = set()  # tenants the last round took jobs from
        self.stale = True  # rebuilt from the queues at the next round


class TierqPolicy:
    """Minimum shares, strict priority, urgency, VTC fairness, reserve and preemption."""

    name = "tierq"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.window = ServedWindow(self.config.window_s)
        self.counters: dict[Tier, dict[str, float]] = {t: {} for t in TIER_ORDER}
        self._index: dict[Tier, _TierIndex] = {t: _TierIndex() for t in TIER_ORDER}
        # Entry id -> times a job was passed over for a job at home where it would have
        # gone (AFFINITY_LOOKAHEAD bounds it); dropped when the job is placed.
        self.passed_over: dict[str, int] = {}
        self._passed_over_limit = PASSED_OVER_KEPT  # pruned past it (then it doubles)

    # --- accounting ---------------------------------------------------------------------
    def charge(self, tier: Tier, tenant_id: str, tokens: float, now: float) -> None:
        """Count tokens served (at dispatch, estimated; later the correction, +/-)."""
        self.window.add(now, tier, tokens)
        weight = self.config.tenant_weights.get(tenant_id, 1.0)
        counters = self.counters[tier]
        counters[tenant_id] = counters.get(tenant_id, 0.0) + tokens / weight
        index = self._index[tier]
        if tenant_id in index.backlogged:
            heapq.heappush(index.fair, (counters[tenant_id], tenant_id))

    def snapshot(self) -> dict[str, Any]:
        """What a failover must keep: served tokens per tier over the window (the minimum
        shares), each tier's tenants' virtual counters (fairness), and how often each queued
        job was passed over for placement (so the look-ahead's bound holds across leaders),
        as plain JSON."""
        return {
            "window": self.window.snapshot(),
            "counters": {t.value: dict(c) for t, c in self.counters.items()},
            "backlogged": {t.value: sorted(i.backlogged) for t, i in self._index.items()},
            "passed_over": dict(self.passed_over),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Carry on from a `snapshot` (the previous leader's); one of another policy's
        (an empty one) leaves this one's as it is."""
        if "window" not in state or "counters" not in state:
            return
        self.window.restore(list(state.get("window", [])))
        counters = state.get("counters", {})
        backlogged = state.get("backlogged", {})
        for tier in TIER_ORDER:
            self.counters[tier] = {k: float(v) for k, v in counters.get(tier.value, {}).items()}
            self._index[tier] = _TierIndex()
            self._index[tier].backlogged = set(backlogged.get(tier.value, []))
        self.passed_over = {k: int(v) for k, v in state.get("passed_over", {}).items()}

    # --- decisions ----------------------------------------------------------------------
    def assign(
        self,
        queues: Mapping[Tier, Mapping[str, Sequence[QueuedJob]]],
        workers: Sequence[WorkerSlots],
        now: float,
        changed: Mapping[Tier, Collection[str]] | None = None,
    ) -> list[Assignment]:
        """Jobs for free slots. `queues`: per tier, each tenant's offered jobs in dispatch
        order. `changed`: per tier, the tenants whose offered jobs changed since the last
        call other than by that call's own assignments all being handed out (jobs read,
        a hand-off that failed, a cap that moved); with it a round costs what changed, not
        every tenant. None: anything may have changed (every tenant is looked at)."""
        self.window.expire(now)
        if len(self.passed_over) > self._passed_over_limit:  # jobs gone meanwhile (cancelled)
            queued = {
                j.entry_id for tenants in queues.values() for q in tenants.values() for j in q
            }
            self.passed_over = {e: n for e, n in self.passed_over.items() if e in queued}
            self._passed_over_limit = max(PASSED_OVER_KEPT, 2 * len(self.passed_over))
        free = {w.worker_id: [max(0, w.free), max(0, min(w.free, w.free_lower))] for w in workers}
        placement = _Placement(workers, free, self.config.affinity_slack)
        any_heap = [(-f[0], wid) for wid, f in free.items() if f[0] > 0]
        lower_heap = [(-f[1], wid) for wid, f in free.items() if f[1] > 0]
        heapq.heapify(any_heap)
        heapq.heapify(lower_heap)

        pickers = {
            t: _TierPicker(
                t, queues.get(t, {}), self, now, None if changed is None else changed.get(t, ())
            )
            for t in TIER_ORDER
        }
        out: list[Assignment] = []
        while True:
            any_free = any(f[0] > 0 for f in free.values())
            lower_free = any(f[1] > 0 for f in free.values())
            tier = self._next_tier(pickers, any_free, lower_free)
            if tier is None:
                return out
            job = pickers[tier].pop()
            interactive = tier == Tier.INTERACTIVE
            worker_id = placement.affine(job.prefix, interactive)
            if worker_id is None:
                worker_id = _take_slot(free, any_heap, lower_heap, interactive)
            else:
                _use_slot(free, any_heap, lower_heap, worker_id, interactive)
            if job.prefix is not None and not placement.home(job.prefix, worker_id):
                # Its own worker is full: a job of the same tenant at home here goes first.
                job = pickers[tier].exchange(
                    job,
                    functools.partial(placement.at_home, worker_id),
                    self.config.affinity_lookahead,
                )
            out.append(Assignment(job, worker_id))
            self.passed_over.pop(job.entry_id, None)
            self.charge(tier, job.tenant_id, job.cost, now)

    def _next_tier(
        self, pickers: Mapping[Tier, _TierPicker], any_free: bool, lower_free: bool
    ) -> Tier | None:
        def placeable(t: Tier) -> bool:
            return bool(pickers[t]) and (any_free if t == Tier.INTERACTIVE else lower_free)

        candidates = [t for t in TIER_ORDER if placeable(t)]
        if not candidates:
            return None
        shares = self.window.shares()
        if not any(shares.values()):  # nothing served in the window yet: no share to defend
            return candidates[0]
        deprived = [
            (shares[t] / self.config.min_share[t], t)
            for t in candidates
            if self.config.min_share.get(t, 0) > 0 and shares[t] < self.config.min_share[t]
        ]
        if deprived:
            return min(deprived, key=lambda x: (x[0], TIER_ORDER.index(x[1])))[1]
        return candidates[0]

    def preempt(
        self,
        waiting_interactive: int,
        running: Sequence[RunningJob],
        workers: Sequence[WorkerSlots],
        in_progress: int,
    ) -> list[RunningJob]:
        """Lower-tier jobs to abort so that waiting interactive jobs get slots."""
        if waiting_interactive <= 0 or any(w.free > 0 for w in workers):
            return []
        wanted = waiting_interactive - in_progress
        if wanted <= 0:
            return []
        abortable = {w.worker_id for w in workers if not w.engine_preempts}
        victims = [
            r
            for r in running
            if r.tier != Tier.INTERACTIVE
            and r.preemptions < self.config.max_preemptions
            and r.worker_id in abortable
        ]
        victims.sort(key=lambda r: (-TIER_ORDER.index(r.tier), -r.started_at))
        return victims[:wanted]


class _TierPicker:
    """The next job of one tier: urgent first (oldest), else the tenant with the least service.

    It works on the tier's `_TierIndex`: rebuilt from every tenant's queue when `changed` is
    None (or the index is stale), else brought up to date from the tenants that changed
    and those the last round took jobs from."""

    def __init__(
        self,
        tier: Tier,
        tenants: Mapping[str, Sequence[QueuedJob]],
        policy: TierqPolicy,
        now: float,
        changed: Collection[str] | None,
    ) -> None:
        self.tier = tier
        self.queues = tenants
        self.heads: dict[str, int] = {}  # tenant -> position of its head this round
        self.counters = policy.counters[tier]
        self.policy = policy
        self.index = policy._index[tier]
        if changed is None or self.index.stale:
            self._rebuild()
        else:
            self._update(changed)
        self.index.touched = set()
        slo = policy.config.slo_s.get(tier)
        self.urgent_before = (
            now - slo * policy.config.urgency_fraction if slo is not None else float("-inf")
        )
        self.taken: dict[str, set[int]] = {}  # tenant -> positions taken out of turn
        self.last: dict[str, int] = {}  # tenant -> position of its job taken last in turn

    def _rebuild(self) -> None:
        index = self.index
        backlogged = {t for t, q in self.queues.items() if q}
        known = index.backlogged
        floor = min((self.counters.get(t, 0.0) for t in backlogged & known), default=None)
        if floor is None:
            floor = min((self.counters.get(t, 0.0) for t in backlogged), default=0.0)
        self._lift(backlogged - known, floor)
        index.backlogged = backlogged
        self._bound_counters(floor)
        self._build_heaps()
        index.stale = False

    def _build_heaps(self) -> None:
        """Both heaps anew, one live entry per backlogged tenant (no stale ones)."""
        index = self.index
        index.fair = [(self.counters.get(t, 0.0), t) for t in index.backlogged]
        heapq.heapify(index.fair)
        # Heads by (not preempted, age): a preempted job goes back to the head of its tier.
        index.by_age = [(_age_key(self.queues[t][0]), t) for t in index.backlogged]
        heapq.heapify(index.by_age)

    def _update(self, changed: Collection[str]) -> None:
        index = self.index
        looked = index.touched.union(changed)
        index.backlogged -= {t for t in looked if self._head(t) is None}
        new = {t for t in looked if t not in index.backlogged and self._head(t) is not None}
        for tenant in looked - new:  # still backlogged: their heads and counters as now
            if tenant in index.backlogged:
                self._push(tenant)
        top = self._fair_top()  # the smallest counter of those still backlogged
        if top is not None:
            floor = top[0]
        else:
            floor = min((self.counters.get(t, 0.0) for t in new), default=0.0)
        self._lift(new, floor)
        index.backlogged |= new
        for tenant in new:
            self._push(tenant)
        self._bound_counters(floor)
        if len(index.fair) + len(index.by_age) > 4 * len(index.backlogged) + 64:
            self._build_heaps()  # mostly stale entries: compacted

    def _push(self, tenant: str) -> None:
        head = self._head(tenant)
        if head is not None:
            heapq.heappush(self.index.fair, (self.counters.get(tenant, 0.0), tenant))
            heapq.heappush(self.index.by_age, (_age_key(head), tenant))

    def _lift(self, tenants: set[str], floor: float) -> None:
        """Newly backlogged tenants: no credit for idle time."""
        for tenant in tenants:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def _bound_counters(self, floor: float) -> None:
        if len(self.counters) > 2 * len(self.index.backlogged) + IDLE_COUNTERS_KEPT:
            _forget_idle(self.counters, self.index.backlogged, floor)

    def _fair_top(self) -> tuple[float, str] | None:
        """The fair heap's smallest live entry (stale ones above it dropped), or None."""
        index = self.index
        fair = index.fair
        while fair:
            counter, tenant = fair[0]
            if (
                tenant in index.backlogged
                and counter == self.counters.get(tenant, 0.0)
                and self._head(tenant) is not None
            ):
                return fair[0]
            heapq.heappop(fair)
        return None

    def __bool__(self) -> bool:
        return self._fair_top() is not None

    def _head(self, tenant: str) -> QueuedJob | None:
        i = self.heads.get(tenant, 0)
        q = self.queues.get(tenant) or ()
        return q[i] if i < len(q) else None

    def pop(self) -> QueuedJob:
        # Urgent: a preempted head, else the oldest head if it is past the urgency line.
        by_age = self.index.by_age
        while by_age:
            key, tenant = by_age[0]
            head = self._head(tenant)
            if head is None or _age_key(head) != key or tenant not in self.index.backlogged:
                heapq.heappop(by_age)  # stale
                if head is not None and tenant in self.index.backlogged:
                    heapq.heappush(by_age, (_age_key(head), tenant))
                continue
            if head.preemptions > 0 or head.enqueued_at <= self.urgent_before:
                return self._take(tenant)
            break
        # Fair: the tenant with the smallest virtual counter (charge() pushes its new one).
        top = self._fair_top()
        assert top is not None, "pop() with nothing left"
        return self._take(top[1])

    def _take(self, tenant: str) -> QueuedJob:
        at = self.heads.get(tenant, 0)
        self.last[tenant] = at
        job = self.queues[tenant][at]
        self._advance(tenant)
        self.index.touched.add(tenant)
        head = self._head(tenant)
        if head is not None:
            heapq.heappush(self.index.by_age, (_age_key(head), tenant))
        return job

    def _advance(self, tenant: str) -> None:
        """The head moves past the job just taken and any taken out of turn."""
        skipped = self.taken.get(tenant, ())
        at = self.heads.get(tenant, 0) + 1
        while at in skipped:
            at += 1
        self.heads[tenant] = at

    def exchange(
        self, job: QueuedJob, better: Callable[[QueuedJob], bool], lookahead: int
    ) -> QueuedJob:
        """`job`, just popped, or in its place one of its tenant's next `lookahead` jobs
        for which `better` holds — then `job` is the tenant's head again. A job is passed
        over `lookahead` times at most, over all rounds, and an urgent one (preempted, or
        past its urgency line) never."""
        passed = self.policy.passed_over
        if (
            lookahead <= 0
            or passed.get(job.entry_id, 0) >= lookahead
            or job.preemptions > 0
            or job.enqueued_at <= self.urgent_before
        ):
            return job
        tenant = job.tenant_id
        q = self.queues[tenant]
        skipped = self.taken.setdefault(tenant, set())
        at = self.last[tenant]  # `job`'s place
        for i in range(at + 1, min(len(q), at + 1 + lookahead)):
            if i in skipped or not better(q[i]):
                continue
            skipped.add(i)
            passed[job.entry_id] = passed.get(job.entry_id, 0) + 1
            self.heads[tenant] = at  # `job` is the head again
            heapq.heappush(self.index.by_age, (_age_key(job), tenant))
            return q[i]
        return job


def _age_key(job: QueuedJob) -> tuple[bool, float]:
    return (job.preemptions == 0, job.enqueued_at)


def _take_slot(
    free: dict[str, list[int]],
    any_heap: list[tuple[int, str]],
    lower_heap: list[tuple[int, str]],
    interactive: bool,
) -> str:
    """Take one slot on the freest suitable worker. `free[w]` is [any tier, lower tiers]."""
    heap, col = (any_heap, 0) if interactive else (lower_heap, 1)
    while True:
        neg, worker_id = heapq.heappop(heap)
        current = free[worker_id][col]
        if current > 0 and -neg == current:
            break
        if current > 0:  # a stale entry: put the worker back with its true count
            heapq.heappush(heap, (-current, worker_id))
    _use_slot(free, any_heap, lower_heap, worker_id, interactive)
    return worker_id


def _use_slot(
    free: dict[str, list[int]],
    any_heap: list[tuple[int, str]],
    lower_heap: list[tuple[int, str]],
    worker_id: str,
    interactive: bool,
) -> None:
    """One slot of `worker_id` taken (the heaps' older entries for it go stale: popping
    finds them so and puts the worker back with its true count)."""
    slots = free[worker_id]
    slots[0] -= 1
    slots[1] = min(slots[1] - (0 if interactive else 1), slots[0])
    if slots[0] > 0:
        heapq.heappush(any_heap, (-slots[0], worker_id))
    if slots[1] > 0:
        heapq.heappush(lower_heap, (-slots[1], worker_id))


class _Placement:
    """Cache-affine placement with bounded load (rendezvous hashing): a prefix ranks the
    workers in an order of its own, the same every round and on every dispatcher; a job
    goes to the first of them with a free slot for its tier whose load, with it, stays
    within `slack` of its slots above the least loaded worker's. The tier policy decides
    which job goes next; this decides only where."""

    def __init__(
        self, workers: Sequence[WorkerSlots], free: dict[str, list[int]], slack: float
    ) -> None:
        self.free = free
        self.slack = slack
        # Load: slots in use (any tier). Capacity unknown: what is free now.
        self.capacity = {w.worker_id: max(w.capacity, w.free, 0) for w in workers}
        self.margin = {w: max(1, math.ceil(slack * c)) for w, c in self.capacity.items()}
        self._ranked: dict[str, list[str]] = {}

    def affine(self, prefix: str | None, interactive: bool) -> str | None:
        if prefix is None or self.slack <= 0 or len(self.free) < 2:
            return None
        ranked = self._ranked.get(prefix)
        if ranked is None:
            ranked = sorted(self.free, key=lambda w: _weight(prefix, w), reverse=True)
            self._ranked[prefix] = ranked
        load = {w: self.capacity[w] - f[0] for w, f in self.free.items()}
        least = min(load.values())
        col = 0 if interactive else 1
        for worker_id in ranked:
            if self.free[worker_id][col] <= 0:
                continue
            if load[worker_id] + 1 - least <= self.margin[worker_id]:
                return worker_id
        return None

    def at_home(self, worker_id: str, job: QueuedJob) -> bool:
        """The job has a prefix, and the worker is its own."""
        return job.prefix is not None and self.home(job.prefix, worker_id)

    def home(self, prefix: str | None, worker_id: str) -> bool:
        """Whether the worker is the prefix's own: first in its ranking of all workers."""
        if prefix is None or self.slack <= 0 or len(self.free) < 2:
            return True  # no affinity: every worker is as good
        ranked = self._ranked.get(prefix)
        if ranked is None:
            ranked = sorted(self.free, key=lambda w: _weight(prefix, w), reverse=True)
            self._ranked[prefix] = ranked
        return ranked[0] == worker_id


def _weight(prefix: str, worker_id: str) -> int:
    digest = hashlib.blake2b(f"{prefix}|{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class FcfsPolicy:
    """Baseline: one queue, first come first served, no reserve, no preemption."""

    name = "fcfs"

    def charge(self, tier: Tier, tenant_id: str, tokens: float, now: float) -> None:
        """FCFS keeps no accounting."""

    def snapshot(self) -> dict[str, Any]:
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Nothing to carry on from."""

    def assign(
        self,
        queues: Mapping[Tier, Mapping[str, Sequence[QueuedJob]]],
        workers: Sequence[WorkerSlots],
        now: float,
    ) -> list[Assignment]:
        jobs = [j for tenants in queues.values() for q in tenants.values() for j in q]
        jobs.sort(key=lambda j: (j.enqueued_at, j.entry_id))
        heap = [(-w.free, w.worker_id) for w in workers if w.free > 0]
        heapq.heapify(heap)
        out: list[Assignment] = []
        for job in jobs:
            if not heap:
                break
            neg, worker_id = heapq.heappop(heap)
            out.append(Assignment(job, worker_id))
            if neg + 1 < 0:
                heapq.heappush(heap, (neg + 1, worker_id))
        return out

    def preempt(
        self,
        waiting_interactive: int,
        running: Sequence[RunningJob],
        workers: Sequence[WorkerSlots],
        in_progress: int,
    ) -> list[RunningJob]:
        return []


class EnginePriorityPolicy(FcfsPolicy):
    """Baseline: everything straight into the engine, which orders by vLLM priority.

    This is what `vllm serve --scheduling-policy priority` gives: the dispatcher hands
    every job on at once (the workers advertise unbounded capacity for it), and the
    engine admits by priority number when a slot frees; nothing is ever preempted.
    """

    name = "engine-priority"


Policy = TierqPolicy | FcfsPolicy
