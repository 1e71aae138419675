"""The per-tenant admission gate (tierq/api/gate.py): a bound per tenant, better tiers let
in first, and nothing held or kept by a caller that goes away."""

from __future__ import annotations

import asyncio

import pytest

from tierq.api.gate import OLDEST_EVERY, TenantGate
from tierq.core.tiers import Tier, vllm_priority

INTERACTIVE, STANDARD, BATCH = (
    vllm_priority(t) for t in (Tier.INTERACTIVE, Tier.STANDARD, Tier.BATCH)
)


class Admissions:
    """Tasks passing the gate, each held inside until released; the order they got in."""

    def __init__(self, gate: TenantGate) -> None:
        self.gate = gate
        self.order: list[str] = []
        self.inside: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, rank: int, tenant: str = "t") -> asyncio.Task[None]:
        self.inside[name] = release = asyncio.Event()

        async def admit() -> None:
            async with self.gate.enter(tenant, rank):
                self.order.append(name)
                await release.wait()

        self.tasks[name] = task = asyncio.create_task(admit())
        return task

    async def release(self, name: str) -> None:
        self.inside[name].set()
        await self.tasks[name]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_tenant_has_at_most_its_limit_inside_and_other_tenants_are_not_held() -> None:
    gate = TenantGate(2)
    a = Admissions(gate)
    for i in range(5):
        a.start(f"b{i}", BATCH)
    a.start("other", BATCH, tenant="u")
    await settle()
    assert a.order == ["b0", "b1", "other"]
    assert gate.waiting("t") == 3 and gate.waiting("u") == 0
    await a.release("b0")
    await settle()
    assert a.order == ["b0", "b1", "other", "b2"]
    for name in ("b1", "b2", "b3", "b4", "other"):
        await settle()
        await a.release(name)
    assert a.order == ["b0", "b1", "other", "b2", "b3", "b4"]
    assert gate._tenants == {}  # no state kept for idle tenants


async def test_waiting_admissions_go_in_by_tier_then_by_arrival() -> None:
    # A tenant's backlog of batch jobs fills the gate and its queue; a chat and a standard
    # job sent after them wait only for the admission under way.
    gate = TenantGate(1)
    a = Admissions(gate)
    a.start("b0", BATCH)
    await settle()
    for name, rank in (("b1", BATCH), ("b2", BATCH), ("s", STANDARD), ("c1", INTERACTIVE)):
        a.start(name, rank)
        await settle()
    a.start("c2", INTERACTIVE)
    await settle()
    while len(a.order) < 6 or not all(t.done() for t in a.tasks.values()):
        await a.release(a.order[-1])  # whoever got in last leaves
        await settle()
    assert a.order == ["b0", "c1", "c2", "s", "b1", "b2"]
    assert gate._tenants == {}


async def held_by_one(waiter: str, behind: str) -> tuple[TenantGate, Admissions]:
    """A gate of one held by "b0", with an interactive `waiter` and a batch `behind` it."""
    gate = TenantGate(1)
    a = Admissions(gate)
    a.start("b0", BATCH)
    await settle()
    a.start(waiter, INTERACTIVE)
    a.start(behind, BATCH)
    await settle()
    return gate, a


async def test_a_waiter_that_goes_away_holds_nothing() -> None:
    gate, a = await held_by_one("gone", "b1")
    a.tasks["gone"].cancel()
    await settle()
    assert a.tasks["gone"].cancelled() and gate.waiting("t") == 1
    await a.release("b0")
    await settle()
    assert a.order == ["b0", "b1"]
    await a.release("b1")
    # The gate empty again: a newcomer goes straight in.
    a.start("y", BATCH)
    await settle()
    assert a.order == ["b0", "b1", "y"]
    await a.release("y")
    assert gate._tenants == {}


async def test_a_waiter_let_in_and_cancelled_before_it_ran_passes_its_turn_on() -> None:
    gate, a = await held_by_one("chosen", "next")
    # The holder leaves (which lets "chosen" in) and "chosen" is cancelled before it runs.
    a.inside["b0"].set()
    while not a.tasks["b0"].done():
        await asyncio.sleep(0)
        if gate._tenants["t"].live == 1:  # "chosen" was let in, not yet running
            a.tasks["chosen"].cancel()
            break
    await settle()
    assert a.tasks["chosen"].cancelled()
    assert a.order == ["b0", "next"]
    await a.release("next")
    assert gate._tenants == {}


async def test_a_slot_freed_as_a_cancelled_waiter_leaves_goes_to_the_next() -> None:
    # The holder leaves in the very step a waiter is cancelled (its cleanup still to run)
    # and a newcomer arrives between the two: the newcomer must not wait for ever.
    gate = TenantGate(1)
    holder = gate.enter("t", BATCH)
    await holder.__aenter__()
    a = Admissions(gate)
    a.start("cancelled", INTERACTIVE)
    await settle()
    newcomer = a.start("newcomer", BATCH)  # its first step comes before the cleanup's
    a.tasks["cancelled"].cancel()
    await holder.__aexit__(None, None, None)  # frees the slot in this step
    async with asyncio.timeout(1):
        while a.order != ["newcomer"]:
            await asyncio.sleep(0)
    await a.release("newcomer")
    assert newcomer.done() and gate._tenants == {}


async def test_a_slot_comes_back_when_an_admission_fails_or_is_cancelled_inside() -> None:
    gate = TenantGate(1)
    with pytest.raises(RuntimeError):
        async with gate.enter("t", BATCH):
            raise RuntimeError("the admission failed")
    a = Admissions(gate)
    inside = a.start("inside", BATCH)
    await settle()
    assert a.order == ["inside"]
    inside.cancel()
    await settle()
    async with asyncio.timeout(1), gate.enter("t", BATCH):
        pass
    assert gate._tenants == {}


async def test_a_stream_of_chats_slows_a_tenants_batch_admissions_and_never_stops_them() -> None:
    gate = TenantGate(1)
    a = Admissions(gate)
    a.start("chat0", INTERACTIVE)
    await settle()
    a.start("batch", BATCH)
    for i in range(1, 4 * OLDEST_EVERY):
        a.start(f"chat{i}", INTERACTIVE)  # chats keep waiting, more than one at a time
    await settle()
    while "batch" not in a.order:
        await a.release(a.order[-1])
        await settle()
    # Every chat that was waiting was ahead of it, yet it got one turn in OLDEST_EVERY.
    assert 1 < a.order.index("batch") <= OLDEST_EVERY, a.order
    while not all(t.done() for t in a.tasks.values()):
        await a.release(a.order[-1])
        await settle()
    assert gate._tenants == {}


async def test_waiters_that_give_up_behind_a_stuck_admission_are_not_kept() -> None:
    # The admission inside is stuck (on the tenant's row lock, say) while clients wait,
    # give up and retry: what the queues keep follows the live waiters, not every try.
    gate = TenantGate(1)
    a = Admissions(gate)
    a.start("stuck", BATCH)
    a.start("patient", BATCH)
    await settle()
    for i in range(500):
        a.start(f"try{i}", INTERACTIVE if i % 2 else BATCH)
        await settle()
        a.tasks[f"try{i}"].cancel()
        await settle()
    tenant = gate._tenants["t"]
    assert tenant.live == 1
    assert len(tenant.by_rank) + len(tenant.by_age) <= 4 * tenant.live + 32
    await a.release("stuck")
    await settle()
    assert a.order == ["stuck", "patient"]
    await a.release("patient")
    assert gate._tenants == {}


@pytest.mark.parametrize("limit", [1, 3])
async def test_many_callers_cancelled_at_random_leave_the_gate_consistent(limit: int) -> None:
    import random

    rng = random.Random(limit)
    gate = TenantGate(limit)
    inside = most = cancelled_inside = 0
    holders: list[asyncio.Task[None]] = []

    async def admit(rank: int) -> None:
        nonlocal inside, most, cancelled_inside
        async with gate.enter("t", rank):
            inside += 1
            most = max(most, inside)
            holders.append(asyncio.current_task())  # type: ignore[arg-type]
            try:
                await asyncio.sleep(rng.random() / 200)
            except asyncio.CancelledError:
                cancelled_inside += 1
                raise
            finally:
                inside -= 1

    tasks = [asyncio.create_task(admit(rng.choice([INTERACTIVE, BATCH]))) for _ in range(200)]
    for i in range(60):
        await asyncio.sleep(rng.random() / 500)
        # Every other one cancels an admission inside the gate (if it still runs).
        rng.choice(holders if i % 2 and holders else tasks).cancel()
    async with asyncio.timeout(10):  # nobody left waiting with a slot free
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert most == limit and inside == 0
    cancelled = sum(isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert 0 < cancelled_inside < cancelled, (cancelled_inside, cancelled)  # both ways
    assert gate._tenants == {}
