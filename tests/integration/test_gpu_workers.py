"""`tierq worker --gpus all` on a host with four GPUs: one engine per group, each a worker of
its own. Real `tierq worker` processes on the test's PostgreSQL and Redis; the host's GPUs
are a fake device list (an `nvidia-smi` on PATH that lists four, as the real one prints
them) and the engines are simulated (the engine is not the subject: what each process is
given and how it is supervised is).

- TENSOR_PARALLEL_SIZE=2 over four GPUs: two workers, `<id>-gpu0-1` and `<id>-gpu2-3`, each
  with its CUDA_VISIBLE_DEVICES, its own heartbeat and inbox, its own metrics port; jobs run
  on both.
- One of them SIGKILLed while it runs jobs: the host's process starts it again under the
  same id, and the jobs finish, each billed once.
- A second host process under the same WORKER_ID: its engines' ids are held by live
  workers, so it stops and exits 4 (restarting would not help), the first untouched.
- SIGTERM to the host's process drains both and leaves nothing; SIGKILL of it makes the
  kernel SIGTERM each child (its parent-death signal), which drains and exits too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from benchmarks.ports import free_ports
from tests.conftest import Platform
from tests.helpers import client, until, until_async, wait_for
from tests.integration.worker_proc import WorkerProcess, registered
from tests.unit.test_gpu_workers import fake_nvidia_smi
from tierq.core.messages import Heartbeat
from tierq.models import jobs as job_repo

pytestmark = pytest.mark.integration

IDS = ("rack1-gpu0-1", "rack1-gpu2-3")


def _gpu_host(
    platform: Platform, tmp_path: Path, log: str = "gpus.log", metrics_port: int | None = None
) -> WorkerProcess:
    """`tierq worker --gpus all` as WORKER_ID rack1 on a host whose nvidia-smi lists four."""
    smi = fake_nvidia_smi(tmp_path / "bin", [0, 1, 2, 3])
    env = {
        "PATH": f"{smi}:{os.environ['PATH']}",
        "TENSOR_PARALLEL_SIZE": "2",
        "DRAIN_TIMEOUT_S": "5",
        "WORKER_DEAD_AFTER_S": "60",  # a restarted child takes its id at once, not by age
    }
    args: tuple[str, ...] = ("--gpus", "all")
    if metrics_port is not None:
        args += ("--metrics-port", str(metrics_port))
    return WorkerProcess(platform, "rack1", tmp_path / log, env, args)


async def _running_host(
    platform: Platform, processes: list[WorkerProcess], tmp_path: Path, **options: Any
) -> WorkerProcess:
    """A `_gpu_host` whose two engines have registered."""
    host = _gpu_host(platform, tmp_path, **options)
    processes.append(host)
    for worker_id in IDS:
        await registered(platform, worker_id)
    return host


def _children(host: WorkerProcess) -> dict[str, psutil.Process]:
    """The host's live worker processes, by the WORKER_ID each was given."""
    found = {}
    for child in psutil.Process(host.proc.pid).children():
        with contextlib.suppress(psutil.NoSuchProcess):  # a zombie until it is reaped
            found[child.environ()["WORKER_ID"]] = child
    return found


async def _heartbeat(platform: Platform, worker_id: str) -> Heartbeat | None:
    raw = await platform.r.hget(platform.dispatcher.names.workers, worker_id)
    return None if raw is None else Heartbeat.decode(raw)


async def _submit(c: httpx.AsyncClient, n: int) -> list[str]:
    body = {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 120}
    return [(await c.post("/v1/jobs", json=body)).json()["id"] for _ in range(n)]


async def test_one_worker_per_gpu_group_with_its_own_id_devices_inbox_and_restarts(
    platform: Platform, tenant_key: str, processes: list[WorkerProcess], tmp_path: Path
) -> None:
    platform.start_dispatcher()
    port = free_ports(2)
    host = await _running_host(platform, processes, tmp_path, metrics_port=port)
    children = _children(host)
    assert sorted(children) == list(IDS)
    for worker_id, devices in zip(IDS, ("0,1", "2,3"), strict=True):
        environ = children[worker_id].environ()
        assert environ["CUDA_VISIBLE_DEVICES"] == devices
        assert environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        beat = await _heartbeat(platform, worker_id)
        assert beat is not None and beat.holder.split(":")[1] == str(children[worker_id].pid)
    async with httpx.AsyncClient() as h:  # each engine's metrics on a port of its own
        for i in range(2):
            assert (await h.get(f"http://127.0.0.1:{port + i}/metrics")).status_code == 200

    async with client(platform.url, tenant_key) as c:
        # 8 slots each (MAX_NUM_SEQS): 12 long jobs at once need both engines.
        first = await _submit(c, 12)
        done = [await wait_for(c, j, timeout=90) for j in first]
        assert [d["status"] for d in done] == ["succeeded"] * 12
        async with platform.db.session() as s:
            ran_on = {(await job_repo.get_job(s, j)).worker_id for j in first}  # type: ignore[union-attr]
        assert ran_on == set(IDS)

        # SIGKILL one engine's worker while it runs jobs: started again under its id, the
        # jobs it held finish.
        second = await _submit(c, 12)

        async def holds() -> bool:
            async with platform.db.session() as s:
                rows = [await job_repo.get_job(s, j) for j in second]
            return any(r and r.worker_id == IDS[1] and r.status == "running" for r in rows)

        await until_async(holds, "the engine to kill never ran a job", 30)
        victim = children[IDS[1]]
        victim.kill()
        found: list[psutil.Process] = []

        def started_again() -> bool:
            # One read of the host's children: the victim drops out of them as it turns
            # into a zombie, between any two reads.
            child = _children(host).get(IDS[1])
            found[:] = [child] if child is not None and child.pid != victim.pid else []
            return bool(found)

        await until(started_again, "the killed engine's worker restarted", seconds=60)
        [restarted] = found
        assert restarted.environ()["CUDA_VISIBLE_DEVICES"] == "2,3"

        async def took_its_id() -> bool:
            beat = await _heartbeat(platform, IDS[1])
            return beat is not None and beat.holder.split(":")[1] == str(restarted.pid)

        await until_async(took_its_id, "the restarted worker never took its id", 60)
        done = [await wait_for(c, j, timeout=120) for j in second]
    assert [d["status"] for d in done] == ["succeeded"] * 12
    assert all(d["usage"]["completion_tokens"] == 120 for d in done)
    async with platform.db.session() as s:
        for j in first + second:
            assert len(await job_repo.usage_for_job(s, j)) == 1  # billed once
    assert "exited with -9; restarting" in (tmp_path / "gpus.log").read_text()

    # A planned stop: every engine drains, the host's process exits 0, nothing is left.
    both = list(_children(host).values())
    host.signal(signal.SIGTERM)
    assert await host.exited(60) == 0
    assert not [p for p in both if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for worker_id in IDS:
        assert await _heartbeat(platform, worker_id) is None, worker_id


async def test_the_engines_drain_when_their_host_process_is_killed(
    platform: Platform, processes: list[WorkerProcess], tmp_path: Path
) -> None:
    host = await _running_host(platform, processes, tmp_path)
    children = list(_children(host).values())
    assert len(children) == 2
    host.proc.send_signal(signal.SIGKILL)  # the supervisor alone, not its children's groups
    host.proc.wait()
    for child in children:
        try:
            await asyncio.to_thread(child.wait, 30)
        except psutil.TimeoutExpired:
            raise AssertionError(f"{child.pid} outlived its supervisor") from None
    for worker_id in IDS:  # they drained and retired: no heartbeat left behind
        assert await _heartbeat(platform, worker_id) is None, worker_id


async def test_a_second_host_under_the_same_ids_exits_4_and_the_first_keeps_them(
    platform: Platform, processes: list[WorkerProcess], tmp_path: Path
) -> None:
    first = await _running_host(platform, processes, tmp_path)
    holders = {w: (await _heartbeat(platform, w)).holder for w in IDS}  # type: ignore[union-attr]
    second = _gpu_host(platform, tmp_path, log="second.log")
    processes.append(second)
    assert await second.exited(120) == 4
    log = (tmp_path / "second.log").read_text()
    assert "exited with 4: stopping every engine of this host" in log
    assert "restarting" not in log
    assert first.proc.poll() is None
    for worker_id in IDS:
        assert (await _heartbeat(platform, worker_id)).holder == holders[worker_id]  # type: ignore[union-attr]
