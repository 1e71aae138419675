"""`tierq admin ...`: the admin API for operators at a terminal (plain HTTP calls)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from tierq.cli.options import URL_OPTION, platform_url
from tierq.client.http import error_message
from tierq.core.settings import get_settings

admin_app = typer.Typer(no_args_is_help=True, help="Tenants, keys, quotas and usage.")
tenant_app = typer.Typer(no_args_is_help=True, help="Create, list and suspend tenants.")
key_app = typer.Typer(no_args_is_help=True, help="Issue and revoke API keys.")
quota_app = typer.Typer(no_args_is_help=True, help="Set a tenant's quota.")
admin_app.add_typer(tenant_app, name="tenant")
admin_app.add_typer(key_app, name="key")
admin_app.add_typer(quota_app, name="quota")

ADMIN_KEY = typer.Option(
    None, help="Admin key (default: ADMIN_API_KEY, else STATE_DIR/admin-api-key)."
)


def admin_key_of(given: str | None) -> str:
    """--admin-key, else ADMIN_API_KEY, else the key file `make run` wrote."""
    settings = get_settings()
    key = given or settings.admin_api_key
    if not key and settings.admin_key_file.exists():
        key = settings.admin_key_file.read_text().strip()
    if not key:
        raise typer.BadParameter("no admin key: pass --admin-key or set ADMIN_API_KEY")
    return key


def _call(url: str | None, key: str | None, method: str, path: str, **kwargs: Any) -> Any:
    resp = httpx.request(
        method,
        platform_url(url).rstrip("/") + path,
        headers={"Authorization": f"Bearer {admin_key_of(key)}"},
        timeout=60,
        **kwargs,
    )
    if resp.status_code >= 400:
        typer.echo(f"error {resp.status_code}: {error_message(resp)}", err=True)
        raise typer.Exit(1)
    return resp.json()


def _print(body: Any) -> None:
    typer.echo(json.dumps(body, indent=2))


@tenant_app.command("create")
def tenant_create(
    name: str,
    tiers: str = typer.Option("interactive,standard,batch", help="Allowed tiers, comma-separated."),
    default_tier: str = typer.Option("standard"),
    weight: float = typer.Option(1.0, help="Share within a tier relative to other tenants."),
    with_key: bool = typer.Option(True, help="Also issue an API key (printed once)."),
    url: str | None = URL_OPTION,
    admin_key: str | None = ADMIN_KEY,
) -> None:
    """Create a tenant (and, by default, its first API key)."""
    body = {
        "name": name,
        "allowed_tiers": [t.strip() for t in tiers.split(",") if t.strip()],
        "default_tier": default_tier,
        "weight": weight,
    }
    tenant = _call(url, admin_key, "POST", "/admin/tenants", json=body)
    if with_key:
        tenant["key"] = _call(url, admin_key, "POST", f"/admin/tenants/{tenant['id']}/keys")
    _print(tenant)


@tenant_app.command("list")
def tenant_list(url: str | None = URL_OPTION, admin_key: str | None = ADMIN_KEY) -> None:
    table = Table("id", "name", "status", "tiers", "default", "weight")
    after: str | None = None
    while True:
        page = _call(
            url, admin_key, "GET", "/admin/tenants", params={"after": after} if after else {}
        )
        for t in page["data"]:
            table.add_row(
                t["id"],
                t["name"],
                t["status"],
                ",".join(t["allowed_tiers"]),
                t["default_tier"],
                f"{t['weight']:g}",
            )
        if not page["has_more"]:
            break
        after = page["last_id"]
    Console().print(table)


@tenant_app.command("suspend")
def tenant_suspend(
    tenant_id: str, url: str | None = URL_OPTION, admin_key: str | None = ADMIN_KEY
) -> None:
    """Its keys stop working at once; its queued and running work is cancelled."""
    _print(_call(url, admin_key, "POST", f"/admin/tenants/{tenant_id}/suspend"))


@tenant_app.command("resume")
def tenant_resume(
    tenant_id: str, url: str | None = URL_OPTION, admin_key: str | None = ADMIN_KEY
) -> None:
    _print(_call(url, admin_key, "POST", f"/admin/tenants/{tenant_id}/resume"))


@key_app.command("create")
def key_create(
    tenant_id: str, url: str | None = URL_OPTION, admin_key: str | None = ADMIN_KEY
) -> None:
    """Issue a key; the secret is shown this once."""
    _print(_call(url, admin_key, "POST", f"/admin/tenants/{tenant_id}/keys"))


@key_app.command("revoke")
def key_revoke(
    key_id: str, url: str | None = URL_OPTION, admin_key: str | None = ADMIN_KEY
) -> None:
    _print(_call(url, admin_key, "DELETE", f"/admin/keys/{key_id}"))


@quota_app.command("set")
def quota_set(
    tenant_id: str,
    tier: str | None = typer.Option(None, help="Only this tier (default: all tiers)."),
    rpm: int | None = typer.Option(None, help="Requests per minute."),
    tpm: int | None = typer.Option(None, help="Tokens per minute."),
    max_running: int | None = typer.Option(None),
    max_queued: int | None = typer.Option(None),
    token_budget: int | None = typer.Option(None),
    spend_budget: str | None = typer.Option(None, help="A decimal amount, e.g. 25.00"),
    period: str = typer.Option("month", help="day, month or total"),
    url: str | None = URL_OPTION,
    admin_key: str | None = ADMIN_KEY,
) -> None:
    """Replace the quota (all tiers, or --tier's): a limit not given is no limit."""
    body = {
        "tier": tier,
        "requests_per_minute": rpm,
        "tokens_per_minute": tpm,
        "max_running": max_running,
        "max_queued": max_queued,
        "token_budget": token_budget,
        "spend_budget": spend_budget,
        "budget_period": period,
    }
    _print(_call(url, admin_key, "PUT", f"/admin/tenants/{tenant_id}/quota", json=body))


@admin_app.command("usage")
def usage(
    tenant_id: str,
    start: str | None = typer.Option(None, "--from", help="ISO date or Unix seconds."),
    end: str | None = typer.Option(None, "--to"),
    group_by: str = typer.Option("day", help="day, tier, model (comma-separated)"),
    url: str | None = URL_OPTION,
    admin_key: str | None = ADMIN_KEY,
) -> None:
    """A tenant's tokens and cost, as a table."""
    params = {k: v for k, v in {"from": start, "to": end, "group_by": group_by}.items() if v}
    report = _call(url, admin_key, "GET", f"/admin/tenants/{tenant_id}/usage", params=params)
    groups = report["group_by"]
    table = Table(*groups, "requests", "prompt", "completion", "cost")
    for row in report["data"]:
        table.add_row(
            *[row[g] for g in groups],
            str(row["requests"]),
            str(row["prompt_tokens"]),
            str(row["completion_tokens"]),
            row["cost"],
        )
    total = report["total"]
    table.add_row(
        *(["total"] + [""] * (len(groups) - 1)),
        str(total["requests"]),
        str(total["prompt_tokens"]),
        str(total["completion_tokens"]),
        total["cost"],
    )
    Console().print(table)
