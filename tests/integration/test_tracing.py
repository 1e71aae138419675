"""Traces across the platform (tierq/core/tracing.py), with the SDK's in-memory exporter: one
trace per job from the HTTP request through admission, the queue wait, the dispatch, the
worker's run and the engine to the last SSE event; a batch line's trace linked to its
batch's. In-process platform: real PostgreSQL and Redis, the simulated engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.conftest import Platform
from tests.integration.batch_helpers import jsonl, line, sdk
from tierq.core import tracing
from tierq.workers.batches import BatchRunner
from tierq.workers.reconcile import reconcile

pytestmark = pytest.mark.integration

JOB_BODY = {
    "tier": "interactive",
    "messages": [{"role": "user", "content": "Trace me."}],
    "max_tokens": 6,
}
# A client's own trace: the API's span must continue it.
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    before = tracing._tracer, tracing._configured
    tracing.install(provider)
    yield exporter
    tracing._tracer, tracing._configured = before
    provider.shutdown()


def _of_job(exporter: InMemorySpanExporter, job_id: str) -> dict[str, ReadableSpan]:
    """The job's tierq spans, by name (each once)."""
    found: dict[str, ReadableSpan] = {}
    for s in exporter.get_finished_spans():
        if (s.attributes or {}).get("tierq.job_id") == job_id:
            assert s.name not in found, f"two {s.name} spans for {job_id}"
            found[s.name] = s
    return found


async def _wait_for(
    exporter: InMemorySpanExporter, job_id: str, names: set[str]
) -> dict[str, ReadableSpan]:
    deadline = time.monotonic() + 20
    while True:
        found = _of_job(exporter, job_id)
        if names <= set(found):
            return found
        assert time.monotonic() < deadline, f"spans of {job_id}: {sorted(found)}"
        await asyncio.sleep(0.05)


def _server(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [
        s for s in exporter.get_finished_spans() if s.name == name and s.kind == SpanKind.SERVER
    ]


async def _served(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    """The request spans of that name, once there is one: a request's span ends after its
    response was sent, so the client may have read it all before the span is exported."""
    deadline = time.monotonic() + 10
    while not (found := _server(exporter, name)):
        assert time.monotonic() < deadline, f"no {name} span"
        await asyncio.sleep(0.05)
    return found


def _parent_id(s: ReadableSpan) -> int | None:
    return s.parent.span_id if s.parent is not None else None


async def _events(client: httpx.AsyncClient, url: str, key: str) -> list[str]:
    kinds = []
    async with client.stream("GET", url, headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status_code == 200
        async for text in resp.aiter_lines():
            if text.startswith("event: "):
                kinds.append(text[len("event: ") :])
                if kinds[-1] in ("done", "error"):
                    break
    return kinds


async def test_a_job_is_one_trace_from_the_request_to_its_last_sse_event(
    spans: InMemorySpanExporter, running: Platform, tenant_key: str
) -> None:
    auth = {"Authorization": f"Bearer {tenant_key}"}
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
        resp = await client.post("/v1/jobs", json=JOB_BODY, headers=auth)
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["id"]
        kinds = await _events(client, f"/v1/jobs/{job_id}/events", tenant_key)
    assert kinds[-1] == "done" and "delta" in kinds

    found = await _wait_for(
        spans,
        job_id,
        {
            "tierq.admission",
            "tierq.queue_wait",
            "tierq.dispatch",
            "tierq.run",
            "tierq.engine",
            "tierq.sse",
        },
    )
    (request,) = [
        s
        for s in await _served(spans, "HTTP POST /v1/jobs")
        if (s.attributes or {}).get("http.response.status_code") == 202
    ]
    trace_id = request.context.trace_id
    assert request.parent is None  # the job's trace starts at its request
    assert (request.attributes or {})["http.route"] == "/v1/jobs"
    assert (request.attributes or {})["tierq.job_id"] == job_id  # found by the job's id
    for name, s in found.items():
        assert s.context.trace_id == trace_id, f"{name} is in another trace"
    # The API's, the dispatcher's and the worker's spans all hang from the request...
    for name in ("tierq.admission", "tierq.queue_wait", "tierq.dispatch", "tierq.run", "tierq.sse"):
        assert _parent_id(found[name]) == request.context.span_id, name
    # ...through the trace context the stream entry carried (remote for them).
    for name in ("tierq.queue_wait", "tierq.dispatch", "tierq.run"):
        assert found[name].parent is not None and found[name].parent.is_remote, name
    # The engine's run is inside the worker's.
    engine, run = found["tierq.engine"], found["tierq.run"]
    assert _parent_id(engine) == run.context.span_id
    assert [e.name for e in engine.events] == ["first_token"]
    assert (engine.attributes or {})["tierq.completion_tokens"] > 0
    assert (run.attributes or {})["tierq.worker_id"] == "w1"
    assert run.kind == SpanKind.CONSUMER
    # In order: admitted, waited, handed out, run; the stream ends after the first token.
    wait, dispatch = found["tierq.queue_wait"], found["tierq.dispatch"]
    admission = found["tierq.admission"]
    assert admission.end_time is not None and wait.end_time is not None
    assert wait.start_time is not None and dispatch.start_time is not None
    assert admission.start_time is not None and admission.start_time <= wait.end_time
    assert wait.end_time <= dispatch.start_time + 1_000_000
    assert run.start_time is not None and dispatch.start_time <= run.start_time
    sse = found["tierq.sse"]
    assert sse.end_time is not None and sse.end_time >= engine.events[0].timestamp
    # The events request is a trace of its own, which the job's SSE span links to.
    (follow,) = await _served(spans, "HTTP GET /v1/jobs/{job_id}/events")
    assert follow.context.trace_id != trace_id
    assert [link.context.span_id for link in sse.links] == [follow.context.span_id]
    # What Redis keeps for followers is the request's context, sampled.
    kept = await running.r.get(running.dispatcher.names.trace_context(job_id))
    assert (
        kept
        == f"00-{trace_id:032x}-{request.context.span_id:016x}-{request.context.trace_flags:02x}"
    )
    assert tracing.sampled(kept)


async def test_a_streamed_openai_request_continues_the_clients_trace(
    spans: InMemorySpanExporter, running: Platform, tenant_key: str
) -> None:
    headers = {
        "Authorization": f"Bearer {tenant_key}",
        "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
    }
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Stream it."}],
        "max_tokens": 6,
        "stream": True,
    }
    async with (
        httpx.AsyncClient(base_url=running.url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        assert resp.status_code == 200
        job_id = resp.headers["x-request-id"]
        chunks = [x async for x in resp.aiter_lines() if x.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]"
    found = await _wait_for(spans, job_id, {"tierq.admission", "tierq.run", "tierq.sse"})
    (request,) = await _served(spans, "HTTP POST /v1/chat/completions")
    assert f"{request.context.trace_id:032x}" == CLIENT_TRACE
    assert request.parent is not None and f"{request.parent.span_id:016x}" == CLIENT_SPAN
    for name in ("tierq.admission", "tierq.queue_wait", "tierq.run", "tierq.sse"):
        assert _parent_id(found[name]) == request.context.span_id, name
    # One request: its own stream, no link; the request's span lasts to its last event.
    sse = found["tierq.sse"]
    assert not sse.links
    assert request.end_time is not None and sse.end_time is not None
    assert request.end_time >= sse.end_time


async def test_batch_lines_are_traces_of_their_own_linked_to_their_batch(
    spans: InMemorySpanExporter, running: Platform, tenant_key: str
) -> None:
    client = sdk(running, tenant_key)
    file = await client.files.create(
        file=("input.jsonl", jsonl([line("a"), line("b")])), purpose="batch"
    )
    batch = await client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    (created,) = [
        s
        for s in await _served(spans, "HTTP POST /v1/batches")
        if (s.attributes or {}).get("http.response.status_code") == 200
    ]
    runner = BatchRunner(running.settings, running.db, running.r)
    await runner.advance(batch.id)  # validate, then expand: the lines are enqueued
    lines = [s for s in spans.get_finished_spans() if s.name == "tierq.batch_line"]
    assert len(lines) == 2
    for root in lines:
        job_id = (root.attributes or {})["tierq.job_id"]
        assert (root.attributes or {})["tierq.batch_id"] == batch.id
        assert root.parent is None and root.kind == SpanKind.PRODUCER
        assert root.context.trace_id != created.context.trace_id
        assert [(link.context.trace_id, link.context.span_id) for link in root.links] == [
            (created.context.trace_id, created.context.span_id)
        ]
        found = await _wait_for(spans, job_id, {"tierq.queue_wait", "tierq.dispatch", "tierq.run"})
        for name in ("tierq.queue_wait", "tierq.dispatch", "tierq.run"):
            assert found[name].context.trace_id == root.context.trace_id, name
            assert _parent_id(found[name]) == root.context.span_id, name
    deadline = time.monotonic() + 30
    while (await client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline
        await runner.advance(batch.id)
        await asyncio.sleep(0.1)


async def test_tracing_off_records_nothing_and_stamps_no_entry(
    running: Platform, tenant_key: str
) -> None:
    assert not tracing.enabled()  # no OTEL_* here: the default
    auth = {"Authorization": f"Bearer {tenant_key}"}
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
        resp = await client.post("/v1/jobs", json=JOB_BODY, headers=auth)
        job_id = resp.json()["id"]
        kinds = await _events(client, f"/v1/jobs/{job_id}/events", tenant_key)
    assert kinds[-1] == "done"
    assert await running.r.get(running.dispatcher.names.trace_context(job_id)) is None


async def test_a_job_the_reconciler_puts_back_stays_in_its_trace(
    spans: InMemorySpanExporter, platform: Platform, tenant_key: str
) -> None:
    auth = {"Authorization": f"Bearer {tenant_key}"}
    async with httpx.AsyncClient(base_url=platform.url, timeout=30) as client:
        resp = await client.post("/v1/jobs", json=JOB_BODY, headers=auth)
        job_id = resp.json()["id"]
    # Redis loses the job's stream entry (and every other key but the trace's).
    kept = platform.dispatcher.names.trace_context(job_id)
    keys = [k async for k in platform.r.scan_iter(match=f"{platform.settings.redis_prefix}:*")]
    await platform.r.delete(*[k for k in keys if k != kept])
    assert await reconcile(platform.settings, platform.db, platform.jobs, platform.r) == [job_id]
    platform.start_dispatcher()
    await platform.start_worker("w1")
    found = await _wait_for(spans, job_id, {"tierq.admission", "tierq.run"})
    assert found["tierq.run"].context.trace_id == found["tierq.admission"].context.trace_id
    assert _parent_id(found["tierq.run"]) == _parent_id(found["tierq.admission"])


async def test_an_unreachable_collector_neither_breaks_nor_slows_a_job(
    running: Platform, tenant_key: str
) -> None:
    # The OTLP exporter towards a blackholed address (TEST-NET-1): each export waits for
    # its timeout, in the batch processor's thread; the jobs do not.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    exporter = OTLPSpanExporter(endpoint="http://192.0.2.1:4318/v1/traces", timeout=2)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=50))
    before = tracing._tracer, tracing._configured
    tracing.install(provider)
    try:
        auth = {"Authorization": f"Bearer {tenant_key}"}
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
            for _ in range(5):
                started = time.monotonic()
                resp = await client.post("/v1/jobs", json=JOB_BODY, headers=auth)
                job_id = resp.json()["id"]
                kinds = await _events(client, f"/v1/jobs/{job_id}/events", tenant_key)
                assert kinds[-1] == "done"
                assert time.monotonic() - started < 1.5  # a few ms on the simulated engine
    finally:
        tracing._tracer, tracing._configured = before
        await asyncio.to_thread(provider.shutdown)
