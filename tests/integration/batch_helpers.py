"""What the tests of Files and Batches share: an SDK client, input lines and files, a
batch submitted and followed to its end, and the lines of its output."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from openai import AsyncOpenAI

from tests.conftest import Platform
from tests.integration.celery_proc import CeleryWorker

CHAT = "/v1/chat/completions"


def sdk(platform: Platform, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{platform.url}/v1", api_key=key, max_retries=0)


def line(custom_id: str, content: str = "Say hello.", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            **body,
        },
    }


def jsonl(items: list[Any]) -> bytes:
    return b"".join(
        (item if isinstance(item, bytes) else json.dumps(item).encode()) + b"\n" for item in items
    )


async def submit(client: AsyncOpenAI, data: bytes, endpoint: str = CHAT) -> Any:
    file = await client.files.create(file=("input.jsonl", data), purpose="batch")
    return await client.batches.create(
        input_file_id=file.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
        metadata={"run": "test"},
    )


async def finished(
    client: AsyncOpenAI, batch_id: str, celery: CeleryWorker | None, timeout: float = 90
) -> Any:
    """The batch once it has ended. `celery`: the test's own Celery worker, which must stay
    up meanwhile (None where a platform such as `tierq run` runs its own)."""
    deadline = time.monotonic() + timeout
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        output = "" if celery is None else celery.output()
        if celery is not None:
            assert celery.proc is not None and celery.proc.poll() is None, output
        assert time.monotonic() < deadline, f"batch still {batch.status}:\n{output}"
        await asyncio.sleep(0.2)


async def lines_of(client: AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(x) for x in content.text.splitlines() if x.strip()]
