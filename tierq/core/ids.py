"""Ids of every object the platform makes: `<kind>_<24 hex digits>` (job, batch, file, ten,
key, inv), random, so that they reveal neither order nor count."""

from __future__ import annotations

import secrets


def new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(12)}"
