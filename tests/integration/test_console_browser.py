"""The operator console and `/docs` in a real headless browser: Debian's Chromium and
chromedriver (`.ci/run` installs them) driven by Selenium, against the in-process platform
(real uvicorn, PostgreSQL and Redis, the simulated engine) and a real Celery worker.

The browser reaches nothing but 127.0.0.1 (`--host-resolver-rules`): a page that needs
the internet fails here as on an air-gapped cluster. Every Selenium call runs in a thread:
the platform answers from this test's event loop. Screenshots are left in the test's
tmp_path (`console-*.png`, `docs.png`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import Platform
from tests.helpers import admin, new_tenant
from tests.integration.batch_helpers import jsonl, line, sdk, submit
from tests.integration.celery_proc import CeleryWorker
from workers.engine.simulated_engine import CostModel

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
T = TypeVar("T")


def chrome(tmp_path: Path) -> WebDriver:
    if not (shutil.which(CHROMEDRIVER) and shutil.which(CHROMIUM)):
        pytest.fail(
            "Chromium and chromedriver are missing: `.ci/run` installs them "
            "(apt-get install -y chromium chromium-driver)"
        )
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1700",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        # The network cut off: every host name but 127.0.0.1 fails to resolve.
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[WebDriver]:
    driver = await asyncio.to_thread(chrome, tmp_path)
    yield driver
    await asyncio.to_thread(driver.quit)


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(fn, *args)


def until(driver: WebDriver, check: Callable[[WebDriver], Any], timeout: float = 20) -> Any:
    """WebDriverWait, with rows the page redraws under it (every poll) tolerated."""
    wait = WebDriverWait(
        driver, timeout, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
    )
    return wait.until(check)


def errors_in(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in log if e.get("level") == "SEVERE"]


def requested_urls(driver: WebDriver) -> list[str]:
    """Every URL the browser asked the network for since the last call (the performance
    log): http(s) and websockets, not its own chrome:// pages, data: or blob: URLs."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            url = str(message["params"]["request"]["url"])
            if url.startswith(("http:", "https:", "ws:", "wss:")):
                urls.append(url)
    return urls


def text_of(driver: WebDriver, css: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def sign_in(driver: WebDriver, key: str) -> None:
    field = driver.find_element(By.ID, "admin-key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.ID, "sign-in").click()


def click_twice(driver: WebDriver, button_id: str) -> None:
    """A destructive action: the first click arms the button, the second confirms it."""
    for _ in range(2):
        until(driver, lambda d: d.find_element(By.ID, button_id).click() or True)
        time.sleep(0.2)


async def test_the_console_shows_the_platform_and_suspends_a_tenant(
    platform: Platform, browser: WebDriver, tmp_path: Path
) -> None:
    platform.start_dispatcher()
    # Unscaled simulated steps (30 ms) and 4 lines outstanding: the batch takes seconds.
    await platform.start_worker("w1", CostModel(slots=platform.settings.max_num_seqs))
    celery = CeleryWorker(platform.settings, BATCH_MAX_OUTSTANDING="4")
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
    assert all("/admin/overview" in e["message"] and "403" in e["message"] for e in refused_log)

    # The admin key: tiers, the worker, the tenant.
    await off_loop(sign_in, driver, platform.settings.admin_api_key)
    await off_loop(until, driver, lambda d: d.find_element(By.ID, "board").is_displayed())
    tiers = await off_loop(
        until, driver, lambda d: [r.get_attribute("data-tier") for r in rows(d, "tiers")] or None
    )
    assert tiers == ["interactive", "standard", "batch"]
    await off_loop(until, driver, lambda d: "w1" in text_of(d, "#workers tbody"))
    await off_loop(until, driver, lambda d: "acme-browser" in text_of(d, "#tenants tbody"))

    # A batch: its progress bar advances while the page polls, to its end.
    batch = await submit(
        sdk(platform, key), jsonl([line(f"l-{i}", max_tokens=16) for i in range(48)])
    )
    seen: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        cell = await off_loop(batch_cell, driver, batch.id)
        if cell and (not seen or seen[-1] != cell):
            seen.append(cell)
            if len(seen) == 3:
                await off_loop(driver.save_screenshot, str(tmp_path / "console-batch.png"))
        if cell and cell.startswith("48 / 48"):
            break
        await asyncio.sleep(0.3)
    done = [int(c.split(" / ")[0]) for c in seen]
    assert done and done[-1] == 48, seen
    assert len([d for d in done if 0 < d < 48]) >= 2, seen  # seen part-way, more than once
    assert done == sorted(done), seen
    await off_loop(
        until,
        driver,
        lambda d: (
            "completed" in d.find_element(By.CSS_SELECTOR, f'tr[data-batch="{batch.id}"]').text
        ),
        30,
    )

    # Set a quota from the page's form; the admin API has it, the page shows its headroom.
    await off_loop(fill_quota, driver, tenant_id, {"requests_per_minute": "100"})
    async with admin(platform) as a:
        for _ in range(50):
            quotas = (await a.get(f"/admin/tenants/{tenant_id}/quota")).json()["data"]
            if quotas:
                break
            await asyncio.sleep(0.1)
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
    for _ in range(100):
        status = (await sdk(platform, key).batches.retrieve(second.id)).status
        if status in ("cancelling", "cancelled"):
            break
        await asyncio.sleep(0.1)
    assert status in ("cancelling", "cancelled")

    # Suspend the tenant from the page; the admin API says it is suspended.
    await off_loop(click_twice, driver, f"suspend-{tenant_id}")
    async with admin(platform) as a:
        for _ in range(50):
            status = (await a.get(f"/admin/tenants/{tenant_id}")).json()["status"]
            if status == "suspended":
                break
            await asyncio.sleep(0.1)
    assert status == "suspended"
    await off_loop(
        until, driver, lambda d: d.find_element(By.ID, f"resume-{tenant_id}").is_displayed()
    )
    await off_loop(driver.save_screenshot, str(tmp_path / "console-suspended.png"))
    assert errors_in(await off_loop(driver.get_log, "browser")) == []
    urls = await off_loop(requested_urls, driver)
    assert f"{platform.url}/admin/overview" in urls
    assert all(u.startswith(platform.url + "/") for u in urls), urls


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


def rows(driver: WebDriver, table: str) -> list[Any]:
    return list(driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr[data-{table[:-1]}]"))


def batch_cell(driver: WebDriver, batch_id: str) -> str | None:
    """The progress bar's label of the batch's row ("done / total (percent)"), if shown."""
    try:
        row = driver.find_elements(By.CSS_SELECTOR, f'tr[data-batch="{batch_id}"] .bar .label')
        text = str(row[0].text) if row else ""
        return text if " / " in text else None  # a dash while validating (no total yet)
    except StaleElementReferenceException:
        return None


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
