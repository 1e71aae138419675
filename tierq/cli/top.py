"""`tierq top`: the operator console's tiers, workers and batches in a terminal, refreshing.

It reads `GET /admin/overview` (tierq/services/overview.py), the one endpoint the web console
polls too, with the admin key; `render` draws one frame of it and is all a test needs.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tierq.cli.admin import ADMIN_KEY, admin_key_of
from tierq.cli.options import URL_OPTION, platform_url
from tierq.client.http import error_message


def _secs(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 1:
        return f"{v * 1000:.0f} ms"
    if v < 120:
        return f"{v:.2f} s" if v < 10 else f"{v:.1f} s"
    if v < 7200:
        return f"{v / 60:.1f} min"
    return f"{v / 3600:.1f} h"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _triple(p: dict[str, Any]) -> str:
    if not p.get("samples"):
        return "no samples"
    return f"{_secs(p['p50'])} / {_secs(p['p95'])} / {_secs(p['p99'])} ({p['samples']})"


def _bar(fraction: float | None, width: int = 20) -> str:
    if fraction is None:
        return " " * width
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def render(o: dict[str, Any]) -> RenderableType:
    """One frame: tiers, workers, batches, and the failures of the last hour by code."""
    tiers = Table(title="Tiers", expand=True, title_justify="left")
    for col in ("tier", "queued", "running", "oldest wait", "wait p50/p95/p99"):
        tiers.add_column(col)
    for col in ("TTFT p50/p95/p99", "share (min)", "SLO"):
        tiers.add_column(col)
    for t in o["tiers"]:
        share = _pct(t["share"]) + (f" (min {_pct(t['min_share'])})" if t["min_share"] else "")
        behind = t["min_share"] and t["share"] is not None and t["share"] < t["min_share"]
        tiers.add_row(
            t["tier"],
            str(t["queued"]),
            str(t["running"]),
            _secs(t["oldest_wait_s"]),
            _triple(t["wait_s"]),
            _triple(t["ttft_s"]),
            Text(share, style="bold red" if behind and t["queued"] else ""),
            _secs(t["slo_s"]),
        )
    leader = o.get("dispatcher_leader") or "none"
    workers = Table(
        title=f"Workers (dispatcher leader: {leader})", expand=True, title_justify="left"
    )
    for col in ("worker", "slots", "running", "inbox", "load", "heartbeat", "state"):
        workers.add_column(col)
    for w in o["workers"]:
        state = (
            "dead"
            if not w["alive"]
            else "engine down"
            if not w["engine_ok"]
            else "draining"
            if w["draining"]
            else "ok"
        )
        workers.add_row(
            w["id"],
            str(w["capacity"]),
            str(w["running"]),
            str(w["inbox"]),
            f"{_bar(w['load'], 10)} {_pct(w['load'])}",
            f"{_secs(w['heartbeat_age_s'])} ago",
            Text(state, style="" if state == "ok" else "bold red"),
        )
    if not o["workers"]:
        workers.add_row("no worker has sent a heartbeat", "", "", "", "", "", "")
    batches = Table(title="Batches", expand=True, title_justify="left")
    for col in ("batch", "tenant", "status", "progress", "completed/failed/total", "ETA"):
        batches.add_column(col)
    for b in o["batches"]:
        done = b["completed"] + b["failed"]
        batches.add_row(
            b["id"],
            b["tenant_id"],
            b["status"],
            f"{_bar(b['progress'])} {done}/{b['total']}",
            f"{b['completed']}/{b['failed']}/{b['total']}",
            _secs(b["eta_s"]),
        )
    if not o["batches"]:
        batches.add_row("no batch unfinished or finished within the hour", "", "", "", "", "")
    codes = o["failures"]["last_hour_by_code"]
    failures = Text(
        "failures, last hour: "
        + (", ".join(f"{code}: {n}" for code, n in sorted(codes.items())) or "none")
    )
    tenants = o["tenants"]
    suspended = sum(1 for t in tenants["data"] if t["status"] == "suspended")
    summary = Text(
        f"tenants: {tenants['total']} ({suspended} suspended among the {len(tenants['data'])} "
        f"busiest)   updated {time.strftime('%H:%M:%S', time.localtime(o['at']))}",
        style="dim",
    )
    return Group(tiers, workers, batches, failures, summary)


def fetch(client: httpx.Client, url: str, key: str) -> dict[str, Any]:
    """The overview, or an error in OpenAI's shape raised as a message."""
    resp = client.get(
        url.rstrip("/") + "/admin/overview", headers={"Authorization": f"Bearer {key}"}
    )
    if resp.status_code >= 400:
        raise RuntimeError(f"error {resp.status_code}: {error_message(resp)}")
    body: dict[str, Any] = resp.json()
    return body


def top(
    interval: float = typer.Option(2.0, help="Seconds between refreshes."),
    once: bool = typer.Option(False, "--once", help="Print one frame and exit."),
    url: str | None = URL_OPTION,
    admin_key: str | None = ADMIN_KEY,
) -> None:
    """A live view of the tiers, workers and batches (GET /admin/overview), refreshing."""
    base, key = platform_url(url), admin_key_of(admin_key)
    with httpx.Client(timeout=30) as client:
        if once:
            try:
                frame = render(fetch(client, base, key))
            except (RuntimeError, httpx.HTTPError) as exc:
                typer.echo(str(exc), err=True)
                raise typer.Exit(1) from None
            Console().print(frame)
            return
        stop, restore = _stop_on_ctrl_c()
        try:
            with Live(Text("loading..."), auto_refresh=False, screen=False) as live:
                while not stop.is_set():
                    try:
                        live.update(render(fetch(client, base, key)), refresh=True)
                    except (RuntimeError, httpx.HTTPError) as exc:
                        live.update(Text(str(exc), style="bold red"), refresh=True)
                    stop.wait(interval)
        except KeyboardInterrupt:  # a second Ctrl-C
            return
        finally:
            restore()


def _stop_on_ctrl_c() -> tuple[threading.Event, Callable[[], None]]:
    """An event Ctrl-C sets, instead of raising KeyboardInterrupt wherever the main thread
    is; and how to put the previous handler back. Raised inside httpx, between the acquire
    of httpcore's connection-pool lock (a plain threading.Lock) and the block it guards,
    the interrupt leaves that lock held, and the pool's own clean-up then waits on it for
    ever: `tierq top` hung after Ctrl-C once in a full test run. A second Ctrl-C raises as
    usual."""
    stop = threading.Event()

    def on_ctrl_c(_signum: int, _frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, on_ctrl_c)

    def restore() -> None:
        signal.signal(signal.SIGINT, previous)

    return stop, restore
