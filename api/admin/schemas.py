"""Request bodies of the admin API."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from services.requests import INT64_DOCUMENTED
from tierq.tiers import Tier

# A money column holds the amount's string (models.tables.Money).
MONEY_CHARS = 40
# What the document promises is taken as money: a plain non-negative decimal string.
MONEY_SCHEMA: dict[str, Any] = {
    "type": "string",
    "pattern": r"^[0-9]{1,20}(\.[0-9]{1,12})?$",
    "examples": ["0.15"],
    "description": "A non-negative decimal string (a JSON number is refused).",
}
Money = Annotated[Decimal, WithJsonSchema(MONEY_SCHEMA)]
MaybeMoney = Annotated[
    Decimal | None, WithJsonSchema({"anyOf": [MONEY_SCHEMA, {"type": "null"}], "default": None})
]


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
    if len(str(amount)) > MONEY_CHARS:  # the column could not hold it
        raise ValueError(f"'{name}' has more digits than an amount may ({MONEY_CHARS})")
    return amount


def _default_is_allowed() -> dict[str, Any]:
    """JSON Schema of TenantCreate's rule: `default_tier` is one of `allowed_tiers` (each
    defaulting as the model does: all tiers, and the standard tier)."""
    branches: list[dict[str, Any]] = [{"not": {"required": ["allowed_tiers"]}}]
    for tier in Tier:
        default: dict[str, Any] = {"properties": {"default_tier": {"const": tier.value}}}
        if tier is Tier.STANDARD:
            default = {"anyOf": [{"not": {"required": ["default_tier"]}}, default]}
        else:
            default["required"] = ["default_tier"]
        branches.append(
            {
                "allOf": [
                    default,
                    {"properties": {"allowed_tiers": {"contains": {"const": tier.value}}}},
                ]
            }
        )
    return {"anyOf": branches}


class TenantCreate(BaseModel):
    """`default_tier` is one of `allowed_tiers`."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_default_is_allowed())

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
    """`default_tier` must be one of `allowed_tiers`, as they are after the update (400)."""

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
    token_budget: int | None = Field(
        default=None, ge=0, le=INT64_MAX, json_schema_extra={"maximum": INT64_DOCUMENTED}
    )
    spend_budget: MaybeMoney = None
    budget_period: Literal["day", "month", "total"] = "month"

    @field_validator("spend_budget", mode="before")
    @classmethod
    def _money(cls, v: object) -> Decimal | None:
        return _decimal(v, "spend_budget")


class PriceSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    tier: Tier
    input_per_million: Money
    output_per_million: Money

    @field_validator("input_per_million", "output_per_million", mode="before")
    @classmethod
    def _money(cls, v: object) -> Decimal | None:
        return _decimal(v, "price")
