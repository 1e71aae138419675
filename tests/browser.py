"""A real headless browser for the tests of web pages: Debian's Chromium and chromedriver
(`make test` installs them) driven by Selenium, cut off from every host but 127.0.0.1, and
the operator console's page as a test reads it."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable
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

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
T = TypeVar("T")


def chrome(tmp_path: Path) -> WebDriver:
    if not (shutil.which(CHROMEDRIVER) and shutil.which(CHROMIUM)):
        pytest.fail(
            "Chromium and chromedriver are missing: `make test` installs them "
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


async def follow_batch(
    driver: WebDriver, batch_id: str, total: int, timeout_s: float, shot: Path | None = None
) -> list[int]:
    """Watch the batch's row as the page redraws it until it shows `total` of `total` done
    and `completed`; the done counts seen, in order (each must not go back). `shot`: a
    screenshot taken at the third count seen."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cell = await off_loop(batch_cell, driver, batch_id)
        if cell and (not seen or seen[-1] != cell):
            seen.append(cell)
            if len(seen) == 3 and shot is not None:
                await off_loop(driver.save_screenshot, str(shot))
        if cell and cell.startswith(f"{total} / {total}"):
            break
        await asyncio.sleep(0.3)
    done = [int(c.split(" / ")[0]) for c in seen]
    assert done and done[-1] == total, seen
    assert done == sorted(done), seen
    row = f'tr[data-batch="{batch_id}"]'
    await off_loop(
        until, driver, lambda d: "completed" in d.find_element(By.CSS_SELECTOR, row).text, 60
    )
    return done
