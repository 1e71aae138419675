"""One clock across hosts (tierq/core/clock.py): a real `tierq api` process whose host clock is
five minutes fast (libfaketime, Debian's faketime) stamps the jobs it admits with the
deployment's time — Redis' — not its own, so the dispatcher, the workers and the
reconciler of other hosts compare them with theirs."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
import time
from email.utils import parsedate_to_datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from benchmarks.ports import free_port
from tests.conftest import ADMIN_KEY
from tests.helpers import stop_group
from tests.integration.celery_proc import child_env
from tierq.core.settings import Settings
from tierq.models.db import Database

pytestmark = pytest.mark.integration

SKEW_S = 300


async def test_an_api_host_with_a_fast_clock_stamps_jobs_on_the_deployments_clock(
    settings: Settings, db: Database, tenant_key: str
) -> None:
    faketime = shutil.which("faketime")
    assert faketime, "faketime is missing: `make fleet-tools` installs Debian's package"
    port = free_port()
    log = Path(settings.state_dir) / "api.log"
    with log.open("ab") as out:
        api = subprocess.Popen(
            [
                *(faketime, "-f", f"+{SKEW_S}s"),
                *(str(Path(sys.executable).parent / "tierq"), "api", "--port", str(port)),
            ],
            env=child_env(settings, ADMIN_API_KEY=ADMIN_KEY),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get("/healthz")).status_code == 200:
                        break
                assert api.poll() is None and time.monotonic() < deadline, log.read_text()
                await asyncio.sleep(0.2)
            made = await c.post(
                "/v1/jobs",
                headers={"Authorization": f"Bearer {tenant_key}"},
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
        assert made.status_code == 202, made.text
        async with db.session() as s:  # at once: the API's stop may take seconds
            created, now = (
                await s.execute(
                    text("SELECT created_at, now() FROM jobs WHERE id = :id"),
                    {"id": made.json()["id"]},
                )
            ).one()
    finally:
        stop_group(api)
    # The process's own clock was fast (its HTTP Date header)...
    own = parsedate_to_datetime(made.headers["date"])
    assert (own - now).total_seconds() > SKEW_S - 30, (own, now)
    # ...and the job's admission time is the deployment's.
    assert abs((created - now).total_seconds()) < 5, (created, now)
