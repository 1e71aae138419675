"""Keyset pagination by (created_at, id): a page after an anchor row, newest or oldest first."""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_

T = TypeVar("T")


def after_anchor(
    stmt: Select[T],
    created: Any,
    ident: Any,
    anchor: tuple[datetime, str] | None,
    limit: int,
    newest_first: bool = True,
) -> Select[T]:
    """`stmt` ordered by (created, id), past `anchor` (the previous page's last row), with
    one row more than `limit` so that the caller knows whether there is a next page."""
    if anchor is not None:
        at, key = anchor
        if newest_first:
            stmt = stmt.where(or_(created < at, and_(created == at, ident < key)))
        else:
            stmt = stmt.where(or_(created > at, and_(created == at, ident > key)))
    order = (created.desc(), ident.desc()) if newest_first else (created, ident)
    return stmt.order_by(*order).limit(limit + 1)
