"""Fixtures of the integration tests beside tests/conftest.py's."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import PG_ADMIN_URL, Platform
from tests.helpers import client
from tests.integration.worker_proc import WorkerProcess
from tests.pgbouncer_server import PgBouncer
from tests.s3_server import SeaweedS3


@pytest.fixture
def processes() -> Iterator[list[WorkerProcess]]:
    """Worker processes a test starts; each is killed (its process group) at the end."""
    started: list[WorkerProcess] = []
    yield started
    for p in started:
        p.kill()


@pytest.fixture
async def a(platform: Platform, tenant_key: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the platform's API as one tenant..."""
    async with client(platform.url, tenant_key) as c:
        yield c


@pytest.fixture
async def b(platform: Platform, other_tenant_key: str) -> AsyncIterator[httpx.AsyncClient]:
    """...and as another."""
    async with client(platform.url, other_tenant_key) as c:
        yield c


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A real S3 server (SeaweedFS) for the session; this process's AWS variables point at
    it (the file store reads them as any tierq process does)."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    before = {name: os.environ.get(name) for name in server.env}
    os.environ.update(server.env)
    yield server
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    server.stop()


@pytest.fixture(scope="session")
def pgbouncer() -> Iterator[PgBouncer]:
    """Debian's PgBouncer in transaction mode in front of the test PostgreSQL. Its folder is
    outside pytest's (root's own): it runs as the postgres user."""
    server = make_url(PG_ADMIN_URL)
    folder = Path(tempfile.mkdtemp(prefix="tierq-pgbouncer-"))
    bouncer = PgBouncer(
        folder,
        server.host or "127.0.0.1",
        server.port or 5432,
    )
    try:
        bouncer.start()
        yield bouncer
    finally:
        bouncer.stop()
        shutil.rmtree(folder, ignore_errors=True)
