"""What the tenant API's response models share (tierq/api/openai/protocol.py, tierq/api/jobs/
schemas.py). They document; they do not build: the records and tierq/services/openai_compat.py
build the bodies (the same ones batch output files carry), and a route declares its model
with `responses=answered(Model, *errors)`: the document shows it, and the body goes out as
it was built (nothing is validated, dropped or added on the hot path). The schema fuzz
(tests/integration/test_openapi_fuzz.py) checks real answers against the models, and
tests/unit/test_openapi_document.py that no JSON answer is left without one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tierq.api.errors import documented


def answered(
    model: type[BaseModel], *errors: int, status: int = 200
) -> dict[int | str, dict[str, Any]]:
    """A route's `responses`: its answer's model at `status`, and its documented errors."""
    return {status: {"model": model}, **documented(*errors)}


class Body(BaseModel):
    """A body: it may carry fields beyond those named (none is dropped on its way out)."""

    model_config = ConfigDict(extra="allow")


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Body):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Body):
    """One generated token's log probability and the most likely tokens at its place
    (vLLM's raw log probabilities; -inf is written -9999.0)."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class Deleted(Body):
    id: str
    object: str
    deleted: Literal[True]


class Page(Body):
    object: Literal["list"]
    first_id: str | None
    last_id: str | None
    has_more: bool


class UsageTotals(Body):
    """Requests, tokens and their cost (a decimal string) of a group, or of the whole."""

    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cost: str


class UsageReport(Body):
    """A usage report: a row a group (its keys, `day`, `tier` or `model`, beside its
    totals), and the totals of all."""

    object: Literal["list"]
    tenant_id: str
    from_: str | None = Field(alias="from")
    to: str | None
    group_by: list[str]
    data: list[UsageTotals]
    total: UsageTotals
