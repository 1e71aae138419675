"""OpenAI's online endpoints: models, chat completions and completions.

A request becomes a job in its tier's queue like any other (never around it); the
response follows the job's events — streamed as OpenAI's SSE chunks, or awaited whole.
A client that goes away takes its job with it: the job is cancelled and its slot freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from api.deps import Door, DoorDep, SettingsDep, TenantDep, api_key_id, stream_slot
from api.errors import APIError, documented, error_body
from api.hub import Slot, StreamClosed
from api.jobs.events import EVENT_STREAM, follow_job
from models import jobs as job_repo
from models.records import JobRecord, TenantRecord
from services import admission, cancellation
from services import openai_compat as oa
from services.requests import Refused
from tierq.states import TERMINAL

log = logging.getLogger(__name__)

# Every route: the door's guard (400), the key (401), the database or the queue (503).
router = APIRouter(prefix="/v1", tags=["openai"], responses=documented(400, 401, 503))
# A completion: JSON, or chunks as Server-Sent Events with `stream: true`. A job that
# failed is answered with its error: 400 (the request's fault), 409 (cancelled) or 500.
_COMPLETION: dict[int | str, dict[str, Any]] = {
    200: {"content": EVENT_STREAM},
    **documented(403, 404, 409, 413, 429),
}

DISCONNECT_POLL_S = 1.0
RETRY_AFTER_S = 2
_background: set[asyncio.Task[Any]] = set()


@router.get("/models")
async def list_models(_: TenantDep, settings: SettingsDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model(settings.served_model_name)]}


@router.get("/models/{model_id:path}", responses=documented(404))
async def get_model(model_id: str, _: TenantDep, settings: SettingsDep) -> dict[str, Any]:
    if model_id != settings.served_model_name:
        raise APIError(
            404, f"The model '{model_id}' does not exist.", "model_not_found", param="model"
        )
    return _model(model_id)


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tierq"}


class _Context:
    def __init__(self, request: Request, tenant: TenantRecord, door: Door) -> None:
        self.request = request
        self.tenant = tenant
        self.db = door.db
        self.r = door.redis
        self.names = door.names
        self.events = door.events
        self.hub = door.hub
        self.key_id = api_key_id(request)
        self.gate = door.gate
        self.enqueuer = door.enqueuer
        self.settings = door.settings

    def follow(self, job: JobRecord) -> AsyncGenerator[tuple[int, Any], None]:
        return follow_job(self.hub, self.db, self.events, job, key_id=self.key_id)

    def cancel_later(self, job_id: str) -> None:
        """Cancel a job whose client went away (in a task of its own: the request's own
        scope is being cancelled)."""

        async def cancel() -> None:
            try:
                await cancellation.cancel_job(
                    self.db, self.r, self.names, self.events, self.tenant.id, job_id
                )
            except Refused:
                pass  # it finished meanwhile
            except Exception:
                log.exception("could not cancel %s after its client left", job_id)

        task = asyncio.create_task(cancel())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def job(self, job_id: str) -> JobRecord:
        async with self.db.session() as s:
            job = await job_repo.get_job(s, job_id)
        assert job is not None
        return job


async def _context(request: Request, tenant: TenantDep, door: DoorDep) -> _Context:
    return _Context(request, tenant, door)


ContextDep = Annotated[_Context, Depends(_context)]


@router.post("/chat/completions", response_model=None, responses=_COMPLETION)
async def chat_completions(
    body: oa.ChatCompletionRequest, ctx: ContextDep
) -> JSONResponse | StreamingResponse:
    return await _complete(ctx, body, True)


@router.post("/completions", response_model=None, responses=_COMPLETION)
async def completions(
    body: oa.CompletionRequest, ctx: ContextDep
) -> JSONResponse | StreamingResponse:
    return await _complete(ctx, body, False)


async def _complete(
    ctx: _Context, body: oa.ChatCompletionRequest | oa.CompletionRequest, chat: bool
) -> JSONResponse | StreamingResponse:
    settings = ctx.settings
    try:
        job_body = body.to_job()
    except ValidationError as exc:
        first = exc.errors()[0]
        raise APIError(400, f"{first['msg']}.", "invalid_request") from None
    # A slot before the job: a refused request (429 too_many_streams) leaves nothing to run.
    slot = await stream_slot(ctx.hub, settings, ctx.tenant)
    try:
        job, _ = await admission.submit(
            ctx.db,
            ctx.enqueuer,
            settings,
            ctx.tenant,
            job_body,
            None,
            online=True,
            key_id=ctx.key_id,
            gate=ctx.gate.enter,
        )
    except BaseException:
        slot.release()
        raise
    headers = {"x-request-id": job.id}
    if body.stream:
        # The stream lets its slot go when it ends; the background task covers a response
        # that never started streaming (a client gone before it): slot freed, job cancelled.
        state = _StreamState()
        return StreamingResponse(
            _stream(ctx, job, chat, body.include_usage, slot, state),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(_after_stream, ctx, job, slot, state),
        )
    try:
        final = await _await_final(ctx, job)
    finally:
        slot.release()
    if final.status.value == "succeeded":
        return JSONResponse(oa.completion_body(final, chat), headers=headers)
    status = oa.failure_status(final)
    message = final.error_message or "The request failed."
    return JSONResponse(
        error_body(status, message, final.error_code or "server_error"), status, headers=headers
    )


async def _last_event(ctx: _Context, job: JobRecord) -> None:
    """Follow the job's events to its terminal one (the result is read from the database)."""
    async with contextlib.aclosing(ctx.follow(job)) as events:
        async for _seq, event in events:
            if event.kind != "delta":
                return


async def _await_final(ctx: _Context, job: JobRecord) -> JobRecord:
    """Wait for the job to end, watching the client: one that hangs up cancels its job."""
    waiter = asyncio.create_task(_last_event(ctx, job))
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S)
            if done:
                waiter.result()
                break
            if await ctx.request.is_disconnected():
                ctx.cancel_later(job.id)
                raise APIError(499, "The client closed the request.", "client_closed_request")
    except StreamClosed as closed:
        ctx.cancel_later(job.id)
        raise APIError(closed.status, closed.message, closed.code) from None
    except APIError:
        raise
    except Exception:  # Redis or the database lost: whatever it was, it is a 503
        log.exception("lost the event stream of %s", job.id)
        ctx.cancel_later(job.id)  # answered with an error: it must not run (and bill) on
        raise APIError(
            503,
            "The queue is unavailable; the request was not completed.",
            "service_unavailable",
            retry_after_s=RETRY_AFTER_S,
        ) from None
    finally:
        waiter.cancel()
    final = await ctx.job(job.id)
    if final.status not in TERMINAL:  # the stream ended without a terminal state
        ctx.cancel_later(job.id)
        raise APIError(
            503, "The job did not finish.", "service_unavailable", retry_after_s=RETRY_AFTER_S
        )
    return final


def _data(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class _StreamState:
    """Whether a streamed answer's generator ever ran (see _after_stream)."""

    started = False


async def _after_stream(ctx: _Context, job: JobRecord, slot: Slot, state: _StreamState) -> None:
    slot.release()
    if not state.started:  # the client left before the first byte: nobody will read it
        ctx.cancel_later(job.id)


async def _stream(
    ctx: _Context,
    job: JobRecord,
    chat: bool,
    include_usage: bool,
    slot: Slot,
    state: _StreamState,
) -> AsyncIterator[bytes]:
    state.started = True
    finished = False
    # Per choice (one unless the job asked for n > 1), by its index: whether its role chunk
    # went out — with its first token, as vLLM sends it: a client timing its first chunk
    # measures the time to the first token, not to admission — the characters of text and
    # the tokens' log probabilities sent, and whether the replay buffer dropped some of its
    # text (past such a placeholder the choice continues from the result, in order, once
    # the job is over).
    roles: set[int] = set()
    sent: dict[int, int] = {}
    scored: dict[int, int] = {}
    gaps: set[int] = set()
    # With `logprobs` asked for, every content chunk carries its tokens' (maybe none).
    wants = job.params.get("logprobs") is not None
    final: JobRecord | None = None
    try:
        async with contextlib.aclosing(ctx.follow(job)) as events:
            async for _seq, event in events:
                if event.kind == "delta":
                    i = int(event.data.get("index", 0))
                    if event.data.get("replay_truncated"):
                        gaps.add(i)
                    text = "" if i in gaps else event.data.get("text", "")
                    if text:
                        if chat and i not in roles:
                            roles.add(i)
                            yield _data(
                                oa.chunk(job, chat, role=True, include_usage=include_usage, index=i)
                            )
                        scores = event.data.get("logprobs", []) if wants else None
                        yield _data(
                            oa.chunk(
                                job,
                                chat,
                                text=text,
                                include_usage=include_usage,
                                logprobs=scores,
                                offset=sent.get(i, 0),
                                index=i,
                            )
                        )
                        sent[i] = sent.get(i, 0) + len(text)
                        scored[i] = scored.get(i, 0) + len(scores or ())
                    continue
                finished = True
                final = await ctx.job(job.id)
                break
        if final is None:
            finished = True
            ctx.cancel_later(job.id)  # answered with an error: it must not run on
            yield _data(error_body(503, "The job's stream ended early.", "service_unavailable"))
        elif final.status.value == "succeeded":
            for choice in final.choices():
                i = choice["index"]
                if chat and i not in roles:  # nothing was streamed: the role still opens it
                    yield _data(
                        oa.chunk(job, chat, role=True, include_usage=include_usage, index=i)
                    )
                # What followed text the replay buffer no longer held: from the result.
                rest = choice["text"][sent.get(i, 0) :]
                rest_scores = (choice["logprobs"] or [])[scored.get(i, 0) :] if wants else None
                if rest or rest_scores:
                    yield _data(
                        oa.chunk(
                            job,
                            chat,
                            text=rest,
                            include_usage=include_usage,
                            logprobs=rest_scores,
                            offset=sent.get(i, 0),
                            index=i,
                        )
                    )
                yield _data(
                    oa.chunk(
                        final,
                        chat,
                        finish_reason=choice["finish_reason"] or "stop",
                        include_usage=include_usage,
                        index=i,
                    )
                )
            if include_usage:
                yield _data(oa.usage_chunk(final, chat))
        else:
            status = oa.failure_status(final)
            message = final.error_message or "The request failed."
            yield _data(error_body(status, message, final.error_code or "server_error"))
        yield b"data: [DONE]\n\n"
    except StreamClosed as closed:
        finished = True
        ctx.cancel_later(job.id)
        yield _data(error_body(closed.status, closed.message, closed.code))
        yield b"data: [DONE]\n\n"
    except Exception:  # Redis or the database lost
        finished = True
        log.exception("lost the event stream of %s", job.id)
        ctx.cancel_later(job.id)  # answered with an error: it must not run on
        yield _data(error_body(503, "The queue became unavailable.", "service_unavailable"))
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away mid-stream
            ctx.cancel_later(job.id)
        slot.release()
