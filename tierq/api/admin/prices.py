"""`/admin/prices`: the price of a model on a tier, per million input and output tokens."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from tierq.api.admin.schemas import Price, PriceList, PriceSet
from tierq.api.deps import PartsDep
from tierq.api.schemas import answered
from tierq.models import prices as price_repo

router = APIRouter()


@router.put("/prices", response_model=None, responses=answered(Price))
async def set_price(body: PriceSet, parts: PartsDep) -> dict[str, Any]:
    """Applies to jobs admitted from now on; admitted jobs keep their price."""
    async with parts.db.transaction() as s:
        price = await price_repo.set_price(
            s, body.model, body.tier.value, body.input_per_million, body.output_per_million
        )
    return price.to_api()


@router.get("/prices", response_model=None, responses=answered(PriceList))
async def list_prices(parts: PartsDep) -> dict[str, Any]:
    async with parts.db.session() as s:
        prices = await price_repo.current_prices(s)
    return {"object": "list", "data": [p.to_api() for p in prices]}
