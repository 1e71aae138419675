"""The benchmarks' SSE reader (benchmarks/harness.py `sse_events`, on httpx-sse): an event
carries an id only where it set one (httpx-sse repeats the last one, as the spec's
lastEventId, and the chaos bench counts a number seen twice as a repeated event)."""

from __future__ import annotations

import httpx

from benchmarks.harness import sse_events

STREAM = (
    b'id: 1\nevent: delta\ndata: {"text": "a"}\n\n'
    b": ping\n\n"
    b'id: 2\nevent: delta\ndata: {"text": "b"}\n\n'
    b'event: error\ndata: {"error": "the key was revoked"}\n\n'
    b"data: first line\ndata: second line\n\n"
)


async def _events(body: bytes, content_type: str = "text/event-stream") -> list[dict[str, str]]:
    resp = httpx.Response(200, headers={"content-type": content_type}, content=body)
    return [event async for event in sse_events(resp)]


async def test_each_event_has_its_own_id_and_keep_alives_are_skipped() -> None:
    assert await _events(STREAM) == [
        {"id": "1", "event": "delta", "data": '{"text": "a"}'},
        {"id": "2", "event": "delta", "data": '{"text": "b"}'},
        {"event": "error", "data": '{"error": "the key was revoked"}'},
        {"data": "first line\nsecond line"},
    ]


async def test_an_answer_that_is_not_an_event_stream_has_no_events() -> None:
    assert await _events(b'{"error": {"code": "too_many_streams"}}\n\n', "application/json") == []
