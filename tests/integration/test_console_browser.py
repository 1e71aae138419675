"""The operator console and `/docs` in a real headless browser: Debian's Chromium and
chromedriver (tests/browser.py) driven by Selenium, against the in-process platform
(real uvicorn, PostgreSQL and Redis, the simulated engine) and a real Celery worker.

The browser reaches nothing but 127.0.0.1 (`--host-resolver-rules`): a page that needs
the internet fails here as on an air-gapped cluster. Every Selenium call runs in a thread:
the platform answers from this test's event loop. Screenshots are left in the test's
tmp_path (`console-*.png`, `docs.png`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.browser import (
    click_twice,
    errors_in,
    follow_batch,
    off_loop,
    requested_urls,
    rows,
    sign_in,
    text_of,
    until,
)
from tests.conftest import Platform
from tests.helpers import admin, new_tenant, until_async
from tests.integration.batch_helpers import jsonl, line, sdk, submit
from tests.integration.celery_proc import CeleryWorker
from tierq.workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration


async def test_the_console_shows_the_platform_and_suspends_a_tenant(
    platform: Platform, browser: WebDriver, tmp_path: Path
) -> None:
    platform.start_dispatcher()
    # Unscaled simulated steps (30 ms) and 4 lines outstanding: the batch takes seconds.
    await platform.start_worker("w1", CostModel(slots=platform.settings.max_num_seqs))
    # Webhooks: one attempt each, sent when a batch ends (no tick sends them again).
    celery = CeleryWorker(
        platform.settings,
        BATCH_MAX_OUTSTANDING="4",
        WEBHOOK_MAX_ATTEMPTS="1",
        WEBHOOK_TICK_S="3600",
        WEBHOOK_TIMEOUT_S="2",
    )
    celery.start()
    try:
        await _console_scenario(platform, browser, tmp_path)
    finally:
        celery.stop()


async def _console_scenario(platform: Platform, driver: WebDriver, tmp_path: Path) -> None:
    tenant_id, key = await new_tenant(platform, name="acme-browser")
    url = f"{platform.url}/console"

    # A tenant's key: refused, and the page shows nothing of the platform.
    await off_loop(driver.get, url)
    await off_loop(sign_in, driver, key)
    refusal = await off_loop(until, driver, lambda d: d.find_element(By.ID, "error").text)
    assert "tenant's API key" in refusal and "permission_denied" in refusal
    assert not await off_loop(lambda: driver.find_element(By.ID, "board").is_displayed())
    assert "acme-browser" not in await off_loop(lambda: driver.page_source)
    await off_loop(driver.save_screenshot, str(tmp_path / "console-refused.png"))
    refused_log = errors_in(await off_loop(driver.get_log, "browser"))
    # The one error: the browser's own note of the refused request (403).
    assert len(refused_log) == 1, refused_log
    assert "/admin/overview" in refused_log[0]["message"] and "403" in refused_log[0]["message"]

    # The admin key: tiers, the worker, the tenant.
    await off_loop(sign_in, driver, platform.settings.admin_api_key)
    await off_loop(until, driver, lambda d: d.find_element(By.ID, "board").is_displayed())
    tiers = await off_loop(
        until, driver, lambda d: [r.get_attribute("data-tier") for r in rows(d, "tiers")] or None
    )
    assert tiers == ["interactive", "standard", "batch"]
    await off_loop(until, driver, lambda d: "w1" in text_of(d, "#workers tbody"))
    await off_loop(until, driver, lambda d: "acme-browser" in text_of(d, "#tenants tbody"))

    # A webhook endpoint that will not take the batch's event (no receiver there).
    async with admin(platform) as a:
        hook = await a.post(
            f"/admin/tenants/{tenant_id}/webhook_endpoints",
            json={"name": "ops", "url": "https://8.8.8.8/hook", "event_types": ["batch.completed"]},
        )
        assert hook.status_code == 200, hook.text

    # A batch: its progress bar advances while the page polls, to its end.
    batch = await submit(
        sdk(platform, key), jsonl([line(f"l-{i}", max_tokens=16) for i in range(48)])
    )
    done = await follow_batch(driver, batch.id, 48, 90, tmp_path / "console-batch.png")
    assert len([d for d in done if 0 < d < 48]) >= 2, done  # seen part-way, more than once

    # Its event's delivery failed: the page shows it, and sends it again.
    async with admin(platform) as a:
        found: list[dict[str, Any]] = []

        async def delivery_failed() -> bool:
            found[:] = (await a.get("/admin/webhook_deliveries")).json()["data"]
            return bool(found) and found[0]["status"] == "failed"

        await until_async(delivery_failed, "the batch's webhook delivery failed", 20)
    [delivery] = found
    assert delivery["status"] == "failed" and delivery["data"]["id"] == batch.id
    # (The page shows it at its next poll: until then it may still show it pending.)
    await off_loop(until, driver, lambda d: "failed: 1" in text_of(d, "#webhook-counts"))
    await off_loop(
        until, driver, lambda d: d.find_elements(By.ID, f"redeliver-{delivery['id']}") or None
    )
    assert batch.id in await off_loop(text_of, driver, "#webhooks tbody")
    await off_loop(click_twice, driver, f"redeliver-{delivery['id']}")
    async with admin(platform) as a:
        again: dict[str, Any] = {}

        async def pending_again() -> bool:
            again.update((await a.get("/admin/webhook_deliveries")).json()["data"][0])
            return bool(again["status"] == "pending")

        await until_async(pending_again, "the delivery is pending again", 5)
    assert again["attempts"] == 1  # numbers go on
    await off_loop(until, driver, lambda d: "retrying" in text_of(d, "#webhooks tbody"))

    # Set a quota from the page's form; the admin API has it, the page shows its headroom.
    await off_loop(fill_quota, driver, tenant_id, {"requests_per_minute": "100"})
    async with admin(platform) as a:
        quotas: list[dict[str, Any]] = []

        async def quota_set() -> bool:
            quotas[:] = (await a.get(f"/admin/tenants/{tenant_id}/quota")).json()["data"]
            return bool(quotas)

        await until_async(quota_set, "the form's quota reached the admin API", 5)
    assert [(q["tier"], q["requests_per_minute"], q["max_running"]) for q in quotas] == [
        (None, 100, None)
    ]
    await off_loop(
        until, driver, lambda d: "requests_per_minute: 0 / 100" in text_of(d, "#tenants tbody")
    )

    # Cancel a second batch from the page while it runs.
    lines = [line(f"m-{i}", max_tokens=16) for i in range(400)]
    second = await submit(sdk(platform, key), jsonl(lines))
    await off_loop(click_twice, driver, f"cancel-{second.id}")

    async def batch_cancelled() -> bool:
        status = (await sdk(platform, key).batches.retrieve(second.id)).status
        return status in ("cancelling", "cancelled")

    await until_async(batch_cancelled, "the page's cancel reached the batch", 10)

    # Suspend the tenant from the page; the admin API says it is suspended.
    await off_loop(click_twice, driver, f"suspend-{tenant_id}")
    async with admin(platform) as a:

        async def suspended() -> bool:
            return bool(
                (await a.get(f"/admin/tenants/{tenant_id}")).json()["status"] == "suspended"
            )

        await until_async(suspended, "the page's suspension reached the admin API", 5)
    await off_loop(
        until, driver, lambda d: d.find_element(By.ID, f"resume-{tenant_id}").is_displayed()
    )
    await off_loop(driver.save_screenshot, str(tmp_path / "console-suspended.png"))
    assert errors_in(await off_loop(driver.get_log, "browser")) == []
    urls = await off_loop(requested_urls, driver)
    assert f"{platform.url}/admin/overview" in urls
    assert all(u.startswith(platform.url + "/") for u in urls), urls


async def test_docs_render_with_the_network_cut_off(
    platform: Platform, browser: WebDriver, tmp_path: Path
) -> None:
    await off_loop(browser.get, f"{platform.url}/docs")
    title = await off_loop(
        until, browser, lambda d: d.find_element(By.CSS_SELECTOR, ".swagger-ui .info .title").text
    )
    assert "tierq" in title
    # Swagger UI drew the operations of the OpenAPI document.
    await off_loop(until, browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".opblock")) > 20)
    await off_loop(browser.save_screenshot, str(tmp_path / "docs.png"))
    urls = await off_loop(requested_urls, browser)
    assert f"{platform.url}/openapi.json" in urls
    assert all(u.startswith(platform.url + "/") for u in urls), urls
    sources = await off_loop(
        browser.execute_script,
        "return [...document.querySelectorAll('script[src], link[href]')]"
        ".map(e => e.src || e.href)",
    )
    assert sources and all(s.startswith(platform.url) for s in sources), sources
    assert errors_in(await off_loop(browser.get_log, "browser")) == []


def fill_quota(driver: WebDriver, tenant_id: str, limits: dict[str, str]) -> None:
    until(driver, lambda d: d.find_element(By.ID, f"quota-{tenant_id}").click() or True)
    form = until(driver, lambda d: d.find_element(By.ID, "quota-form"))
    until(driver, lambda d: form.is_displayed())
    for name, value in limits.items():
        field = form.find_element(By.NAME, name)
        field.clear()
        field.send_keys(value)
    form.find_element(By.ID, "quota-save").click()
    until(driver, lambda d: not form.is_displayed())
