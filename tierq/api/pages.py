"""OpenAI's list object, for every paginated route: `after` takes `last_id`."""

from __future__ import annotations

from typing import Any


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
