"""`tierq bench admission`: how many jobs a second the API admits, and how fast.

The real API process (`tierq api`, `--api-workers` of them behind one port) against a
scratch PostgreSQL database and a redis-server of the bench's own
(benchmarks.harness.ScratchPlatform). No dispatcher, worker or engine runs: admission is
the subject, and the jobs stay queued. Tenants are made through the admin API (no
quotas: the fast path; `--quota` gives each a quota, checked under the tenant's
exclusive row lock against a prompt counted by the tokenizer).

Two phases, each `--n` requests from `--clients` concurrent clients (each on a
keep-alive connection of its own, spread round-robin over `--tenants` tenants):
- `jobs`: `POST /v1/jobs` (a short prompt, max_tokens 16) until its 202;
- `chat`: streamed `POST /v1/chat/completions` until the response's headers (the
  stream starts once the job is admitted: its row committed, its entry on the tier's
  stream), then the client hangs up — so the API also cancels each of these jobs (that
  work is part of what is measured; each such request needs a new connection).

The client is a small HTTP/1.1 client on raw sockets so that it costs this 2-core
machine as little as possible; the API's own CPU time per admitted job is reported
beside the rates (from /proc), a figure that drifts less than a rate does. Logs go to
stderr; one JSON line is printed last on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import ScratchPlatform, Supervisor
from tierq.core.settings import Settings
from tierq.launch.supervisor import Child

log = logging.getLogger("tierq.bench")

REDIS_PREFIX = "tqadm"
WARMUP = 200  # requests per phase not measured (connections, caches, prepared statements)


@dataclass(frozen=True)
class AdmissionConfig:
    clients: int = 32
    n: int = 5000
    api_workers: int = 1
    tenants: int = 8
    quota: bool = False
    keep_logs: bool = False


class _Conn:
    """One keep-alive HTTP/1.1 connection: write a request, read its status and body."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self.reader, self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(self, raw: bytes, *, headers_only: bool = False) -> tuple[int, bytes]:
        reader, writer = await self._open()
        writer.write(raw)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if headers_only:
            self.close()  # a streamed response: hang up once it started
            return status, b""
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await reader.readexactly(length) if length else b""
        return status, body


def _post(path: str, key: str, body: dict[str, Any], host: str) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their children (uvicorn's workers)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    seen: set[int] = set()
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


async def phase(
    name: str,
    host: str,
    port: int,
    keys: list[str],
    cfg: AdmissionConfig,
    api_pids: list[int],
    model: str,
) -> dict[str, Any]:
    """`cfg.n` measured requests (after WARMUP) from `cfg.clients` clients."""
    streamed = name == "chat"
    path = "/v1/chat/completions" if streamed else "/v1/jobs"
    total = cfg.n + WARMUP
    issued = 0
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    errors = 0
    started: dict[str, float] = {}

    def body(i: int) -> dict[str, Any]:
        text = f"Say something about the number {i}."
        if streamed:
            return {
                "model": model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 16,
                "stream": True,
            }
        return {"prompt": text, "max_tokens": 16}

    async def client(c: int) -> None:
        nonlocal issued, errors
        conn = _Conn(host, port)
        key = keys[c % len(keys)]
        try:
            while issued < total:
                i = issued
                issued += 1
                if i == WARMUP:
                    started["t0"] = time.perf_counter()
                    started["cpu0"] = _cpu_s(api_pids)
                raw = _post(path, key, body(i), host)
                t = time.perf_counter()
                try:
                    status, _ = await conn.request(raw, headers_only=streamed)
                except (OSError, asyncio.IncompleteReadError) as exc:
                    conn.close()
                    status = 0
                    log.warning("%s request failed: %r", name, exc)
                elapsed = time.perf_counter() - t
                if i >= WARMUP:
                    latencies.append(elapsed)
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
                    if status not in (200, 202):
                        errors += 1
        finally:
            conn.close()

    await asyncio.gather(*(client(c) for c in range(cfg.clients)))
    wall = time.perf_counter() - started["t0"]
    cpu = _cpu_s(api_pids) - started["cpu0"]
    measured = len(latencies)
    p50, p99 = _percentile(latencies, 0.50), _percentile(latencies, 0.99)
    return {
        "jobs_per_s": round(measured / wall, 1),
        "p50_ms": None if p50 is None else round(p50 * 1000, 2),
        "p99_ms": None if p99 is None else round(p99 * 1000, 2),
        "errors": errors,
        "statuses": statuses,
        "api_cpu_ms_per_job": round(cpu / measured * 1000, 3) if measured else None,
        "requests": measured,
    }


async def make_tenants(url: str, admin_key: str, cfg: AdmissionConfig) -> list[str]:
    """`cfg.tenants` tenants with a key each (and a quota each with `--quota`)."""
    keys = []
    admin = {"Authorization": f"Bearer {admin_key}"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for i in range(cfg.tenants):
            spec = {"name": f"bench-{i}", "allowed_tiers": ["interactive", "standard", "batch"]}
            resp = await client.post("/admin/tenants", json=spec, headers=admin)
            resp.raise_for_status()
            tenant_id = resp.json()["id"]
            resp = await client.post(f"/admin/tenants/{tenant_id}/keys", headers=admin)
            resp.raise_for_status()
            keys.append(resp.json()["key"])
            if cfg.quota:  # limits far above what the run uses: checked, never refusing
                quota = {"requests_per_minute": 10**6, "max_queued": 10**6}
                resp = await client.put(
                    f"/admin/tenants/{tenant_id}/quota", json=quota, headers=admin
                )
                resp.raise_for_status()
    return keys


async def run_admission(base: Settings, cfg: AdmissionConfig) -> dict[str, Any]:
    tag = f"admission_{uuid.uuid4().hex[:8]}"
    async with ScratchPlatform(
        base, "admission", "simulated", REDIS_PREFIX, tag, cfg.keep_logs
    ) as p:
        api, sup = await start_api(p, cfg.api_workers)
        keys = await make_tenants(p.url, p.admin_key, cfg)
        assert api.proc is not None
        pids = [api.proc.pid]
        host, port = p.settings.api_host, p.settings.api_port
        log.info("admission: %d clients, %d tenants, %d requests", cfg.clients, cfg.tenants, cfg.n)
        model = p.settings.served_model_name
        jobs = await phase("jobs", host, port, keys, cfg, pids, model)
        log.info("jobs: %s", jobs)
        chat = await phase("chat", host, port, keys, cfg, pids, model)
        log.info("chat: %s", chat)
        sup.kill_all()
        p.completed = True
    return {
        "bench": "admission",
        "clients": cfg.clients,
        "n": cfg.n,
        "api_workers": cfg.api_workers,
        "tenants": cfg.tenants,
        "quota": cfg.quota,
        **{k: v for k, v in jobs.items() if k != "requests"},
        "chat": {k: v for k, v in chat.items() if k != "requests"},
        "cpus": os.cpu_count(),
    }


async def start_api(p: ScratchPlatform, workers: int = 1) -> tuple[Child, Supervisor]:
    """The API process alone (`workers` of them behind one port) on the scratch services,
    ready; no dispatcher, so the jobs stay queued (and no per-tenant bound on them here)."""
    env = {**_env(p), "DEFAULT_MAX_QUEUED": "0"}
    argv = [sys.executable, "-m", "tierq", "api", "--workers", str(workers)]
    api = Child("api", argv, p.logs / "api.log", p.state / "api.pid")
    sup = p.start([api], {"api": env})
    await wait_api(p.url, p.logs)
    return api, sup


async def wait_api(url: str, logs: Path, timeout_s: float = 120.0) -> None:
    """Up once /readyz finds the database and Redis (no worker here)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=2) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/readyz")).status_code == 200:
                    return
            await asyncio.sleep(0.3)
    raise RuntimeError(f"the API was not ready in {timeout_s:.0f} s; see {logs}")


def _env(p: ScratchPlatform) -> dict[str, str]:
    from benchmarks.harness import base_env

    return base_env(p.settings, p.admin_key)
