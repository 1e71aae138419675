"""First-start helpers: a tenant and its key for the embedded default (and operators)."""

from __future__ import annotations

import os
from pathlib import Path

from tierq.core.settings import Settings
from tierq.models import tenants
from tierq.models.db import Database


def write_secret(path: Path, secret: str) -> None:
    """Write a secret readable by its owner only (mode 0600 from the first byte)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)


def _read_secret(path: Path | None) -> str | None:
    if path is None or not path.is_file():
        return None
    return path.read_text().strip() or None


async def ensure_tenant_key(settings: Settings, name: str, key_file: Path | None) -> str:
    """The tenant's key: the one in `key_file` if it still works, else a newly issued one.

    Creates the tenant when it does not exist. A new key is written to `key_file`.
    """
    db = Database.for_settings(settings)
    try:
        secret = _read_secret(key_file)
        if secret:
            async with db.session() as s:
                owner = await tenants.tenant_for_key(s, secret)
            if owner is not None and owner.name == name:
                return secret
        async with db.transaction() as s:
            tenant = await tenants.get_tenant_by_name(s, name) or await tenants.create_tenant(
                s, name
            )
            issued = await tenants.issue_key(s, tenant.id)
        if key_file is not None:
            write_secret(key_file, issued.key)
        return issued.key
    finally:
        await db.close()
