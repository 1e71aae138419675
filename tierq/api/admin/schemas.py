"""Request bodies of the admin API."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from tierq.api.schemas import Body, Page
from tierq.core.tiers import Tier
from tierq.services.requests import INT64_DOCUMENTED

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


# --- response bodies (see tierq/api/schemas.py for how they are used) ----------------------------
class Tenant(Body):
    id: str
    object: Literal["tenant"]
    name: str
    status: str
    allowed_tiers: list[str]
    default_tier: str
    weight: float
    created_at: int


class TenantList(Page):
    data: list[Tenant]


class ApiKey(Body):
    """A key as listed: its prefix alone (the whole key is shown once, when made)."""

    id: str
    object: Literal["api_key"]
    prefix: str
    created_at: int
    last_used_at: int | None = None
    revoked_at: int | None = None
    key: str | None = None  # when made only
    revoked: bool | None = None  # when revoked


class ApiKeyList(Page):
    data: list[ApiKey]


class Quota(Body):
    tier: str | None  # None: every tier
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_running: int | None
    max_queued: int | None
    token_budget: int | None
    spend_budget: str | None  # a decimal string
    budget_period: str | None


class QuotaSetResult(Quota):
    object: Literal["quota"]
    tenant_id: str


class QuotaUsage(Body):
    requests_last_minute: int
    tokens_last_minute: int
    running: int
    queued: int
    period_start: int | None
    tokens_this_period: int
    spend_this_period: str


class QuotaWithUsage(Quota):
    usage: QuotaUsage


class QuotaList(Body):
    object: Literal["list"]
    tenant_id: str
    data: list[QuotaWithUsage]


class Price(Body):
    object: Literal["price"]
    model: str
    tier: str
    input_per_million: str
    output_per_million: str
    effective_at: int | None
    derived_from_standard: bool


class PriceList(Body):
    object: Literal["list"]
    data: list[Price]


class Invoice(Body):
    id: str
    object: Literal["invoice"]
    tenant_id: str
    period: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost: str
    lines: list[dict[str, Any]]
    updated_at: int | None


class InvoiceList(Body):
    object: Literal["list"]
    data: list[Invoice]


class InvoiceRollup(InvoiceList):
    period: str
    tenants: list[str]  # the tenants whose invoices it wrote


class Overview(Body):
    """What the console shows: each tier, worker, tenant and batch now, and failures."""

    object: Literal["overview"]
    at: float
    share_window_s: float
    dispatcher_leader: str | None
    tiers: list[dict[str, Any]]
    workers: list[dict[str, Any]]
    tenants: dict[str, Any]
    batches: list[dict[str, Any]]
    failures: dict[str, Any]
    webhooks: dict[str, Any]
