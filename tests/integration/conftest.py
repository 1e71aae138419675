"""Fixtures of the integration tests beside tests/conftest.py's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.worker_proc import WorkerProcess


@pytest.fixture
def processes() -> Iterator[list[WorkerProcess]]:
    """Worker processes a test starts; each is killed (its process group) at the end."""
    started: list[WorkerProcess] = []
    yield started
    for p in started:
        p.kill()
