"""Request bodies of the admin API."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tierq.tiers import Tier


def _decimal(value: object, name: str) -> Decimal | None:
    """Money comes as a decimal string ("0.15"); a JSON number would have gone through a
    binary float on the way, so it is refused."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"'{name}' must be a decimal string such as \"0.15\", not a number")
    try:
        amount = Decimal(value)
    except InvalidOperation:
        raise ValueError(f"'{name}' is not a decimal number") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"'{name}' must be a non-negative decimal")
    return amount


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    allowed_tiers: list[Tier] = Field(
        default_factory=lambda: [Tier.INTERACTIVE, Tier.STANDARD, Tier.BATCH], min_length=1
    )
    default_tier: Tier = Tier.STANDARD
    weight: float = Field(default=1.0, gt=0, le=1000)

    @model_validator(mode="after")
    def _default_is_allowed(self) -> TenantCreate:
        if self.default_tier not in self.allowed_tiers:
            raise ValueError("'default_tier' must be one of 'allowed_tiers'")
        return self


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, min_length=1, max_length=200)
    allowed_tiers: list[Tier] | None = Field(default=None, min_length=1)
    default_tier: Tier | None = None
    weight: float | None = Field(default=None, gt=0, le=1000)
    status: Literal["active", "suspended"] | None = None


INT32_MAX = 2**31 - 1  # the quota columns' INTEGER
INT64_MAX = 2**63 - 1  # BIGINT


class QuotaSet(BaseModel):
    """Each limit nullable (null: no limit); `tier` makes it a per-tier quota."""

    model_config = ConfigDict(extra="forbid")

    tier: Tier | None = None
    requests_per_minute: int | None = Field(default=None, ge=0, le=INT32_MAX)
    tokens_per_minute: int | None = Field(default=None, ge=0, le=INT32_MAX)
    max_running: int | None = Field(default=None, ge=0, le=INT32_MAX)
    max_queued: int | None = Field(default=None, ge=0, le=INT32_MAX)
    token_budget: int | None = Field(default=None, ge=0, le=INT64_MAX)
    spend_budget: Decimal | None = None
    budget_period: Literal["day", "month", "total"] = "month"

    @field_validator("spend_budget", mode="before")
    @classmethod
    def _money(cls, v: object) -> Decimal | None:
        return _decimal(v, "spend_budget")


class PriceSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    tier: Tier
    input_per_million: Decimal
    output_per_million: Decimal

    @field_validator("input_per_million", "output_per_million", mode="before")
    @classmethod
    def _money(cls, v: object) -> Decimal | None:
        return _decimal(v, "price")
