"""`/admin/prices`: the price of a model on a tier, per million input and output tokens."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.admin.schemas import PriceSet
from api.deps import DbDep
from models import prices as price_repo

router = APIRouter()


@router.put("/prices")
async def set_price(body: PriceSet, db: DbDep) -> dict[str, Any]:
    """Applies to jobs admitted from now on; admitted jobs keep their price."""
    async with db.transaction() as s:
        price = await price_repo.set_price(
            s, body.model, body.tier.value, body.input_per_million, body.output_per_million
        )
    return price.to_api()


@router.get("/prices")
async def list_prices(db: DbDep) -> dict[str, Any]:
    async with db.session() as s:
        prices = await price_repo.current_prices(s)
    return {"object": "list", "data": [p.to_api() for p in prices]}
