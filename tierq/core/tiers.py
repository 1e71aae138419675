"""The tier table: which tiers exist, in which order they are served, and their vLLM priority."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Tier(StrEnum):
    INTERACTIVE = "interactive"  # chat and streaming; judged on time to first token
    STANDARD = "standard"  # async jobs that are polled; judged on completion time
    BATCH = "batch"  # bulk JSONL work with a 24 h window, discounted


@dataclass(frozen=True)
class TierSpec:
    tier: Tier
    vllm_priority: int  # lower runs first inside the engine


# Served in this order: higher tiers first.
TIERS: tuple[TierSpec, ...] = (
    TierSpec(Tier.INTERACTIVE, vllm_priority=0),
    TierSpec(Tier.STANDARD, vllm_priority=10),
    TierSpec(Tier.BATCH, vllm_priority=100),
)
TIER_ORDER: tuple[Tier, ...] = tuple(spec.tier for spec in TIERS)
DEFAULT_TIER = Tier.STANDARD


def vllm_priority(tier: Tier) -> int:
    for spec in TIERS:
        if spec.tier == tier:
            return spec.vllm_priority
    raise KeyError(tier)
