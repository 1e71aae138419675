"""The operator console's data (`GET /admin/overview`), its admin actions, the console page
and `tierq top`, against the in-process platform (simulated engine, real PostgreSQL and
Redis). The page in a real browser: test_console_browser.py."""

from __future__ import annotations

import asyncio
import io
import time
import uuid

import httpx
import pytest
from rich.console import Console

from tests.conftest import Platform
from tests.helpers import admin, assert_openai_error, client, new_tenant, wait_for
from tests.integration.batch_helpers import jsonl, line, sdk, submit
from tierq.cli.top import fetch, render
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "Say hello."}]


async def test_a_tenant_key_sees_nothing(platform: Platform) -> None:
    name = f"secret-name-{uuid.uuid4().hex[:8]}"
    tenant_id_marker, key = await new_tenant(platform, name=name)
    async with client(platform.url, key) as c:
        assert_openai_error(await c.get("/admin/overview"), 403, "permission_denied")
        assert_openai_error(await c.post("/admin/batches/batch_x/cancel"), 403, "permission_denied")
    async with client(platform.url, None) as c:
        assert_openai_error(await c.get("/admin/overview"), 401, "missing_api_key")
        page = await c.get("/console")  # the page is a shell: no data in it, for anyone
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert name not in page.text and tenant_id_marker not in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    async with admin(platform) as a:
        assert name in (await a.get("/admin/overview")).text  # where the data is


async def test_the_overview_reports_what_the_platform_did(platform: Platform) -> None:
    # The worker's engine takes a shorter context (1,024) than the API admits (2,048): a
    # prompt between the two is admitted, then refused by the engine — a job that fails.
    running = platform
    running.start_dispatcher()
    short = CostModel(slots=running.settings.max_num_seqs, max_model_len=1024).scaled(20)
    await running.start_worker("w1", cost=short)
    tenant_id, key = await new_tenant(platform=running, name=f"busy-{uuid.uuid4().hex[:8]}")
    async with admin(running) as a:
        quota = {"tier": "standard", "requests_per_minute": 10}
        resp = await a.put(f"/admin/tenants/{tenant_id}/quota", json=quota)
        assert resp.status_code == 200, resp.text
    async with client(running.url, key) as c:
        ids = []
        for tier in ("interactive", "standard", "standard", "standard"):
            body = {"tier": tier, "messages": CHAT, "max_tokens": 8}
            ids.append((await c.post("/v1/jobs", json=body)).json()["id"])
        # Fails in the engine: too many prompt tokens for its context (1,024).
        bad = {"tier": "interactive", "prompt": "word " * 1500, "max_tokens": 8}
        bad_id = (await c.post("/v1/jobs", json=bad)).json()["id"]
        finals = [await wait_for(c, i) for i in ids]
        failed = await wait_for(c, bad_id)
    assert {f["status"] for f in finals} == {"succeeded"}
    assert failed["error"]["code"] == "context_length_exceeded"
    tokens = sum(f["usage"]["total_tokens"] for f in finals)
    tokens += (failed["usage"] or {}).get("total_tokens", 0)

    async with admin(running) as a:
        deadline = time.monotonic() + 10
        while True:
            # The workers hand their latency samples over with their heartbeats, the
            # dispatcher saves its accounting once a second.
            o = (await a.get("/admin/overview")).json()
            tiers = {t["tier"]: t for t in o["tiers"]}
            sampled = tiers["standard"]["ttft_s"]["samples"] >= 3
            if (sampled and tiers["standard"]["share"]) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    assert o["object"] == "overview"
    assert [t["tier"] for t in o["tiers"]] == ["interactive", "standard", "batch"]
    assert tiers["standard"]["wait_s"]["samples"] == 3
    assert tiers["standard"]["ttft_s"]["samples"] == 3
    assert tiers["interactive"]["wait_s"]["samples"] == 2  # the failed one started too
    assert tiers["interactive"]["ttft_s"]["samples"] == 1  # it never produced a token
    p = tiers["standard"]["ttft_s"]
    assert 0 < p["p50"] <= p["p95"] <= p["p99"] < 30
    assert all(t["queued"] == 0 and t["running"] == 0 for t in o["tiers"])
    assert tiers["standard"]["min_share"] == running.settings.min_share_standard
    assert tiers["interactive"]["min_share"] is None
    # Shares come from the dispatcher's saved accounting (saved once a second).
    shares = [t["share"] for t in o["tiers"] if t["share"] is not None]
    assert shares and abs(sum(shares) - 1) < 0.01
    assert tiers["standard"]["served_tokens"] > 0

    [w] = o["workers"]
    assert w["id"] == "w1" and w["capacity"] == running.workers["w1"][0].capacity > 0
    assert w["alive"] and w["engine_ok"] and w["inbox"] == 0 and w["load"] == 0
    assert 0 <= w["heartbeat_age_s"] < 2
    assert o["dispatcher_leader"]

    [t] = [t for t in o["tenants"]["data"] if t["id"] == tenant_id]
    assert t["status"] == "active" and t["month_tokens"] == tokens
    assert (t["queued"], t["running"]) == (0, 0)
    assert t["tightest"] == {
        "limit_name": "requests_per_minute",
        "tier": "standard",
        "limit": 10,
        "used": 3,
        "headroom": 0.7,
    }
    assert o["failures"]["last_hour_by_code"] == {"context_length_exceeded": 1}
    [f] = o["failures"]["latest"]
    assert (f["job_id"], f["tenant_id"], f["tier"]) == (bad_id, tenant_id, "interactive")

    # tierq top: one frame of the same endpoint, rendered to text.
    # (in a thread: the platform answers from this event loop)
    with httpx.Client(timeout=10) as http:
        key = running.settings.admin_api_key or ""
        frame = render(await asyncio.to_thread(fetch, http, running.url, key))
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(frame)
    text = console.export_text()
    for expected in ("Tiers", "interactive", "standard", "batch", "Workers", "w1", "Batches"):
        assert expected in text, text
    assert "context_length_exceeded: 1" in text


async def test_an_operator_cancels_any_tenants_batch(platform: Platform, tenant_key: str) -> None:
    # No Celery here: the batch stays `validating` until cancelled.
    batch = await submit(sdk(platform, tenant_key), jsonl([line("a"), line("b")]))
    async with client(platform.url, tenant_key) as c:
        assert_openai_error(await c.post(f"/admin/batches/{batch.id}/cancel"), 403)
    async with admin(platform) as a:
        resp = await a.post(f"/admin/batches/{batch.id}/cancel")
        assert resp.status_code == 200, resp.text
        assert resp.json()["status"] == "cancelling"
        again = await a.post(f"/admin/batches/{batch.id}/cancel")  # harmless twice
        assert again.status_code == 200 and again.json()["status"] == "cancelling"
        assert_openai_error(
            await a.post("/admin/batches/batch_nope/cancel"), 404, "batch_not_found"
        )
        o = (await a.get("/admin/overview")).json()
    [b] = o["batches"]
    assert (b["id"], b["status"], b["total"]) == (batch.id, "cancelling", 0)
    assert (await sdk(platform, tenant_key).batches.retrieve(batch.id)).status == "cancelling"


async def test_docs_and_console_assets_are_served_here(platform: Platform) -> None:
    async with client(platform.url, None) as c:
        docs = (await c.get("/docs")).text
        redoc = (await c.get("/redoc")).text
        assert "cdn." not in docs and "https://" not in docs and "http://" not in docs
        assert "https://" not in redoc and "fonts.googleapis" not in redoc
        for path in (
            "/static/docs/swagger-ui-bundle.js",
            "/static/docs/swagger-ui.css",
            "/static/docs/redoc.standalone.js",
            "/static/docs/favicon.png",
            "/console/static/console.js",
            "/console/static/console.css",
        ):
            resp = await c.get(path)
            assert resp.status_code == 200 and len(resp.content) > 500, path
        assert_openai_error(await c.get("/static/docs/../../etc/passwd"), 404)
        assert_openai_error(await c.get("/static/docs/core.py"), 404)
        assert_openai_error(await c.get("/console/static/console.html"), 404)
