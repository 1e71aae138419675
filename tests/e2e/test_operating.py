"""Operating a running `tierq run` as an operator would: PostgreSQL, Redis, the real vLLM
engine, every component a process of its own, with RUN_METRICS_PORT set.

- Prometheus (Debian's, which `make test` installs) runs with the configuration `tierq run`
  wrote, scrapes every process, and holds every series the Grafana dashboard queries.
- The operator console in a real browser (tests/browser.py) follows the live platform.
- `tierq top` refreshes in a terminal (a pseudo-terminal here) and stops on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import AsyncOpenAI
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from benchmarks.ports import free_port
from tests.browser import (
    errors_in,
    follow_batch,
    off_loop,
    requested_urls,
    rows,
    sign_in,
    text_of,
    until,
)
from tests.dashboards import dashboard_metric_names
from tests.e2e.conftest import LivePlatform, metrics_ports, pg_live
from tests.helpers import client, wait_for
from tests.integration.batch_helpers import finished, jsonl, line, submit
from tierq.core.settings import Settings
from tierq.launch.supervisor import default_worker_id

pytestmark = pytest.mark.e2e

ADMIN_KEY = f"e2e-admin-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LivePlatform]:
    env = {**metrics_ports(), "ADMIN_API_KEY": ADMIN_KEY}
    with pg_live(tmp_path_factory.mktemp("ops-platform"), env) as live:
        yield live


def _sdk(live: LivePlatform) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{live.url}/v1", api_key=live.key, max_retries=0, timeout=120)


@contextlib.contextmanager
def prometheus(config: Path, tmp: Path) -> Iterator[str]:
    """Debian's Prometheus with `config`, scraping every second instead of every 15 s."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: `make test` installs Debian's prometheus"
    doc = yaml.safe_load(config.read_text())
    doc["global"]["scrape_interval"] = "1s"
    fast = tmp / "prometheus.yml"
    fast.write_text(yaml.safe_dump(doc))
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={fast}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address={url.removeprefix('http://')}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_prometheus_scrapes_every_process_and_holds_every_series_the_dashboard_queries(
    ops: LivePlatform, tmp_path: Path
) -> None:
    config = ops.state_dir / "prometheus.yml"
    assert "prometheus --config.file=" in ops.output.read_text()
    jobs = {j["job_name"] for j in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert jobs == {
        "api",
        "api-tenants",
        "dispatcher",
        "worker",
        "worker-tenants",
        "celery",
        "celery-reconciler",
    }
    with prometheus(config, tmp_path) as prom:
        # The workload that touches every series: a batch, jobs of two tiers, a refusal.
        batch = await submit(_sdk(ops), jsonl([line(f"l-{i}") for i in range(3)]))
        async with client(ops.url, ops.key, timeout=120) as c:
            ids = []
            for i, tier in enumerate(["interactive", "standard"] * 3):
                body = {"tier": tier, "prompt": f"Count to {i}.", "max_tokens": 8}
                resp = await c.post("/v1/jobs", json=body)
                assert resp.status_code == 202, resp.text
                ids.append(resp.json()["id"])
            refused = await c.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 50_000})
            assert refused.status_code == 400, refused.text
            for job_id in ids:
                assert (await wait_for(c, job_id, timeout=120))["status"] == "succeeded"
        assert (await finished(_sdk(ops), batch.id, None, 240)).status == "completed"

        wanted = dashboard_metric_names()
        held: set[str] = set()
        targets: list[dict[str, Any]] = []
        async with httpx.AsyncClient(base_url=prom, timeout=10) as p:
            for _ in range(120):
                names = await p.get("/api/v1/label/__name__/values")
                held = set(names.json()["data"])
                targets = (await p.get("/api/v1/targets")).json()["data"]["activeTargets"]
                if wanted <= held and all(t["health"] == "up" for t in targets):
                    break
                await asyncio.sleep(0.5)
            # Each process's own series, through its own port (its job's label).
            own = {}
            for job, name in (
                ("dispatcher", "tierq_queue_depth"),
                ("worker", "tierq_engine_preemptions_total"),
                # vLLM's own, in the worker ("vllm:" names; "vllm_" as OpenMetrics has them)
                ("worker", "vllm[:_]num_requests_running"),
                ("celery", "tierq_batch_lines"),
                ("api", "tierq_jobs_refused_total"),
            ):
                selector = f'{{__name__=~"{name}", job="{job}"}}'
                found = await p.get("/api/v1/series", params={"match[]": selector})
                own[(job, name)] = len(found.json()["data"])
    down = [(t["labels"]["job"], t["lastError"]) for t in targets if t["health"] != "up"]
    assert not down, down
    assert {t["labels"]["job"] for t in targets} == jobs
    assert wanted <= held, f"not in Prometheus: {sorted(wanted - held)}"
    assert all(own.values()), own


def _workers_text(driver: WebDriver) -> str:
    return text_of(driver, "#workers tbody")


def _worker_id(ops: LivePlatform) -> str:
    """The id `tierq run` gave its worker (its host and state folder)."""
    return default_worker_id(Settings(state_dir=ops.state_dir, _env_file=None))  # type: ignore[call-arg]


async def test_the_console_follows_the_running_platform_in_a_browser(
    ops: LivePlatform, browser: WebDriver, tmp_path: Path
) -> None:
    await off_loop(browser.get, f"{ops.url}/console")
    await off_loop(sign_in, browser, ADMIN_KEY)
    await off_loop(until, browser, lambda d: d.find_element(By.ID, "board").is_displayed())
    tiers = await off_loop(
        until, browser, lambda d: [r.get_attribute("data-tier") for r in rows(d, "tiers")] or None
    )
    assert tiers == ["interactive", "standard", "batch"]
    # The worker `tierq run` started (its heartbeat, through Redis), and the dev tenant.
    worker_id = _worker_id(ops)
    await off_loop(until, browser, lambda d: worker_id in _workers_text(d), 60)
    await off_loop(until, browser, lambda d: "dev" in text_of(d, "#tenants tbody"))

    # A batch on the real engine: the page follows its progress, to its end.
    batch = await submit(_sdk(ops), jsonl([line(f"c-{i}", max_tokens=24) for i in range(12)]))
    await follow_batch(browser, batch.id, 12, 240)
    await off_loop(browser.save_screenshot, str(tmp_path / "console-tierq-run.png"))
    assert errors_in(await off_loop(browser.get_log, "browser")) == []
    urls = await off_loop(requested_urls, browser)
    assert f"{ops.url}/admin/overview" in urls
    assert all(u.startswith(ops.url + "/") for u in urls), urls


class Terminal:
    """A process on a pseudo-terminal of 250 columns (ids fit in their cells), its output
    collected as it comes."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, replica = pty.openpty()
        fcntl.ioctl(replica, termios.TIOCSWINSZ, struct.pack("HHHH", 80, 250, 0, 0))
        self.proc = subprocess.Popen(
            argv, env=env, stdin=replica, stdout=replica, stderr=replica, start_new_session=True
        )
        os.close(replica)
        self.output = b""

    def _read(self) -> bool:
        """What the process wrote within 0.2 s, added to `output`; False once it has gone
        (EIO: nothing more will come)."""
        ready, _, _ = select.select([self.master], [], [], 0.2)
        if ready:
            try:
                self.output += os.read(self.master, 65536)
            except OSError:
                return False
        return True

    def read_until(self, predicate: Any, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = self._read()
            text = self.output.decode(errors="replace")
            if predicate(text):
                return text
            if not alive:
                break
        raise AssertionError(f"not seen in {timeout} s:\n{self.output.decode()[-4000:]}")

    def wait(self, timeout: float) -> int:
        """The process's exit status, reading what it writes meanwhile: a process whose
        terminal nobody reads blocks in its next write (Rich draws a last frame on exit)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and self._read():
            assert time.monotonic() < deadline, f"still running after {timeout} s"
        return self.proc.wait(5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


async def test_tierq_top_refreshes_in_a_terminal_and_stops_on_ctrl_c(ops: LivePlatform) -> None:
    env = {**os.environ, "ADMIN_API_KEY": ADMIN_KEY, "TERM": "xterm-256color"}
    env.pop("STATE_DIR", None)
    argv = [sys.executable, "-m", "tierq", "top", "--url", ops.url, "--interval", "0.5"]
    term = Terminal(argv, env)
    try:
        frames = "Workers (dispatcher leader:"
        first = await asyncio.to_thread(
            term.read_until, lambda t: t.count(frames) >= 2 and _worker_id(ops) in t, 60
        )
        assert "interactive" in first and "standard" in first and "batch" in first
        # Something new on the platform shows up in the frames that follow, without a restart.
        batch = await submit(_sdk(ops), jsonl([line(f"t-{i}") for i in range(5)]))
        await asyncio.to_thread(term.read_until, lambda t: batch.id in t, 60)
        assert (await finished(_sdk(ops), batch.id, None, 240)).status == "completed"
        # Its row's completed/failed/total, once it is done.
        await asyncio.to_thread(term.read_until, lambda t: "5/0/5" in t, 60)
        os.killpg(term.proc.pid, signal.SIGINT)  # Ctrl-C, as the terminal sends it
        # 60 s: on 2026-12-02, in a full `make test` with the machine at 0.4x its usual
        # speed, 15 s was once not enough (it passed alone the same hour, in 109 s in all).
        assert await asyncio.to_thread(term.wait, 60) == 0
    finally:
        term.close()
