"""Which buffered jobs the dispatcher may offer the policy: each tenant's `max_running`.

A tenant's quotas may cap how many of its jobs run at once, for all its tiers (scope
`"*"`) and per tier (scope: the tier's name). The dispatcher offers the policy only as
many of a capped tenant's jobs as it may still start, so the cap holds whichever of the
offered jobs the policy picks — it may pick them all. Pure, like the policy: the caps,
the running jobs and the buffered queues in, the queues to offer out.

What it keeps, for every tenant and scope: running + offered <= cap (nothing offered
where the running jobs already fill it); a tenant without a cap for a tier is offered
all its queued jobs there; what is offered is a prefix of the tenant's queue in dispatch
order (`dispatch_order`); and a tenant with queued work in a tier below both its caps there
is offered at least one of its jobs.

Tiers are visited in the order the queues come in (the dispatcher's: `TIER_ORDER`), and
the first of them with queued work and room sets the tenant's whole `"*"` room aside,
even where its queue there is shorter — conservative: its other tiers wait for a later
round.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from tierq.core.tiers import Tier
from tierq.dispatcher.policy import QueuedJob, RunningJob

ALL_TIERS = "*"  # the scope of a cap that counts the tenant's jobs of every tier

Caps = Mapping[str, Mapping[str, int]]  # tenant -> scope ("*" or a tier's name) -> cap


def dispatch_order(jobs: Iterable[QueuedJob]) -> list[QueuedJob]:
    """Preempted jobs first (back at the head of their tier), then in arrival order."""
    return sorted(jobs, key=lambda j: (j.preemptions == 0, j.enqueued_at))


def offer(
    buffered: Mapping[Tier, Mapping[str, Iterable[QueuedJob]]],
    running: Iterable[RunningJob],
    caps: Caps,
) -> dict[Tier, dict[str, list[QueuedJob]]]:
    """The queues to hand the policy: per tier, per tenant with jobs to offer, in
    dispatch order and cut to what each capped tenant may still start."""
    left = allowance(caps, running)
    queues: dict[Tier, dict[str, list[QueuedJob]]] = {}
    for tier, tenants in buffered.items():
        per: dict[str, list[QueuedJob]] = {}
        for tenant, jobs in tenants.items():
            ordered = dispatch_order(jobs)
            if not ordered:
                continue
            room = left(tenant, tier)
            if room is not None:
                ordered = ordered[:room]  # its max_running: the rest wait
            if ordered:
                per[tenant] = ordered
        queues[tier] = per
    return queues


class Offered(Mapping[str, Sequence[QueuedJob]]):
    """One tier's queues as offered: each tenant's own queue (already in dispatch order),
    or a capped tenant's cut of it; a tenant with nothing to offer is absent. Looking a
    tenant up costs nothing more; walking them all (`offer`'s whole answer) is what a
    policy does only when it must look at every tenant."""

    def __init__(
        self, queues: Mapping[str, Sequence[QueuedJob]], cut: Mapping[str, Sequence[QueuedJob]]
    ) -> None:
        self.queues = queues
        self.cut = cut

    def __getitem__(self, tenant: str) -> Sequence[QueuedJob]:
        got = self.cut[tenant] if tenant in self.cut else self.queues[tenant]
        if not got:
            raise KeyError(tenant)
        return got

    def __iter__(self) -> Iterator[str]:
        return (t for t, q in self.queues.items() if self.cut.get(t, q))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def offered(
    ordered: Mapping[Tier, Mapping[str, Sequence[QueuedJob]]],
    running: Iterable[RunningJob],
    caps: Caps,
) -> tuple[dict[Tier, Offered], dict[Tier, set[str]]]:
    """`offer` for queues kept in dispatch order, at the cost of the capped tenants alone:
    per tier the queues to hand the policy, and the capped tenants with queued work there
    (what is offered of theirs moves with what runs, so they count as changed each round)."""
    left = allowance(caps, running)
    cuts: dict[Tier, dict[str, Sequence[QueuedJob]]] = {tier: {} for tier in ordered}
    for tenant in caps:
        for tier, tenants in ordered.items():
            queue = tenants.get(tenant)
            if not queue:
                continue
            room = left(tenant, tier)
            if room is not None:
                cuts[tier][tenant] = queue[:room]  # its max_running: the rest wait
    views = {tier: Offered(tenants, cuts[tier]) for tier, tenants in ordered.items()}
    return views, {tier: set(cut) for tier, cut in cuts.items()}


def allowance(caps: Caps, running: Iterable[RunningJob]) -> Callable[[str, Tier], int | None]:
    """How many more jobs of a tenant's tier may start now; None where no cap applies.
    Each call sets its answer aside from the tenant's `"*"` room: ask once per tier
    with queued work."""
    if not caps:
        return lambda _tenant, _tier: None
    counts: Counter[tuple[str, str]] = Counter()
    for job in running:
        counts[(job.tenant_id, ALL_TIERS)] += 1
        counts[(job.tenant_id, job.tier.value)] += 1
    offered: Counter[str] = Counter()

    def left(tenant: str, tier: Tier) -> int | None:
        scopes = caps.get(tenant)
        if not scopes:
            return None
        room: int | None = None
        for scope in (ALL_TIERS, tier.value):
            if scope in scopes:
                free = scopes[scope] - counts[(tenant, scope)]
                if scope == ALL_TIERS:
                    free -= offered[tenant]
                room = free if room is None else min(room, free)
        if room is None:
            return None
        room = max(0, room)
        offered[tenant] += room
        return room

    return left
