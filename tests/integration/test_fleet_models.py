"""The fleet publishes what it serves (tierq/core/fleet.py): an API whose own settings disagree
with its workers' — a longer MAX_MODEL_LEN, no model folder on its host — validates
against the context length the live workers announce, and counts prompts with the
tokenizer a worker published, exactly as a host with the folder would."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import Platform, base_settings
from tests.helpers import assert_openai_error, client, until
from tierq.core import fleet, token_count
from tierq.core.redis_names import RedisNames
from tierq.core.settings import Settings
from tierq.workers.engine.simulated_engine import CostModel, SimulatedEngine
from tierq.workers.worker import Worker

pytestmark = pytest.mark.integration

WORKERS_CONTEXT = 1024


@pytest.fixture
def settings(pg_database: str, tmp_path: Path) -> Settings:
    """The API's host: a longer MAX_MODEL_LEN than the workers serve, and no model folder."""
    return base_settings(pg_database, tmp_path).model_copy(
        update={"max_model_len": 4096, "model_path": str(tmp_path / "no-model-here")}
    )


async def test_the_api_checks_and_counts_against_what_the_workers_serve(
    platform: Platform, tenant_key: str
) -> None:
    api = platform.settings
    worker_host = api.model_copy(update={"max_model_len": WORKERS_CONTEXT, "model_path": None})
    own = token_count.for_settings(worker_host)
    assert own.exact, "the bundled model's folder is needed: `tierq prepare-model`"
    assert not token_count.for_settings(api).exact  # the API's host has no tokenizer
    engine = SimulatedEngine(CostModel(slots=8, max_model_len=WORKERS_CONTEXT).scaled(20))
    await engine.start()
    worker = Worker(worker_host, platform.jobs, platform.r, engine, worker_id="w-fleet")
    task = asyncio.create_task(worker.run())
    try:
        await until(lambda: fleet.max_model_len(api) == WORKERS_CONTEXT, "the fleet's view", 20)
        await until(lambda: token_count.for_settings(api).exact, "the fleet's tokenizer", 20)
        messages = [{"role": "user", "content": "How many tokens is this, exactly? " * 20}]
        assert token_count.for_settings(api).bound(messages, None) == own.bound(messages, None)
        async with client(platform.url, tenant_key) as c:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}
            refused = await c.post("/v1/jobs", json=body)
            assert_openai_error(refused, 400, "context_length_exceeded")
            assert f"{WORKERS_CONTEXT} tokens" in refused.json()["error"]["message"]
            taken = await c.post("/v1/jobs", json={**body, "max_tokens": 16})
            assert taken.status_code == 202, taken.text
    finally:
        worker.request_stop()
        worker.request_stop()
        await asyncio.wait_for(task, 30)
        await engine.shutdown()
    # With no worker alive (scaled to zero, a restart) the fleet still serves 1024: the
    # API never goes back to its own 4096.
    await asyncio.sleep(fleet.REFRESH_S + api.worker_dead_after_s + 0.5)
    async with client(platform.url, tenant_key) as c:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}
        assert_openai_error(await c.post("/v1/jobs", json=body), 400, "context_length_exceeded")
    assert fleet.max_model_len(api) == WORKERS_CONTEXT
    # What the worker published is there for a host that starts after it.
    names = RedisNames(api.redis_prefix)
    assert await platform.r.hget(names.model_tokenizer(api.served_model_name), fleet.DIGEST)
