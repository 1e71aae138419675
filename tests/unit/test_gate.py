"""The per-tenant admission gate (tierq/api/gate.py): a bound per tenant, better tiers let
in first, and nothing held or kept by a caller that goes away."""

from __future__ import annotations

import asyncio

import pytest

from tierq.api.gate import TenantGate
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


@pytest.mark.parametrize("limit", [1, 3])
async def test_many_callers_cancelled_at_random_leave_the_gate_consistent(limit: int) -> None:
    import random

    rng = random.Random(limit)
    gate = TenantGate(limit)
    inside = 0
    most = 0

    async def admit(rank: int) -> None:
        nonlocal inside, most
        async with gate.enter("t", rank):
            inside += 1
            most = max(most, inside)
            try:
                await asyncio.sleep(rng.random() / 1000)
            finally:  # cancelled inside, too
                inside -= 1

    tasks = [asyncio.create_task(admit(rng.choice([INTERACTIVE, BATCH]))) for _ in range(200)]
    for _ in range(60):
        await asyncio.sleep(rng.random() / 2000)
        rng.choice(tasks).cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert most == limit and inside == 0
    assert gate._tenants == {}
