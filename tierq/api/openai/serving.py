"""OpenAI's online completions, served: a request becomes a job in its tier's queue like
any other (never around it), and the answer follows the job's events — streamed as
OpenAI's SSE chunks, or awaited whole. A client that goes away takes its job with it:
the job is cancelled and its slot freed.

`OpenAIServing` is made once per app (tierq/api/app.py) from its parts; the routes
(tierq/api/openai/router.py) only parse and hand over. It owns the cancels it started for
clients that left, and waits for them when the app stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from tierq.api.deps import AppParts, stream_slot
from tierq.api.errors import APIError, error_body
from tierq.api.jobs.events import follow_job
from tierq.api.streams.hub import StreamClosed
from tierq.api.streams.slots import Slot
from tierq.core.aio import Detached
from tierq.core.states import TERMINAL
from tierq.models import jobs as job_repo
from tierq.models.records import JobRecord, TenantRecord
from tierq.services import admission, cancellation
from tierq.services import openai_compat as oa
from tierq.services.requests import Refused

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 1.0
RETRY_AFTER_S = 2
CANCELS_STOP_S = 5.0  # the longest the app's stop waits for cancels under way


@dataclass(frozen=True, slots=True)
class _Caller:
    """Who asked: the request (to watch for its client leaving), its tenant and key."""

    request: Request
    tenant: TenantRecord
    key_id: str | None


class _StreamState:
    """Whether a streamed answer's generator ever ran (see `_after_stream`)."""

    started = False


class OpenAIServing:
    def __init__(self, parts: AppParts) -> None:
        self.parts = parts
        self._cancels = Detached("cancelling a job whose client left")

    async def aclose(self) -> None:
        """Let the cancels of jobs whose clients left finish (within a bound): a job whose
        cancel was cut short would run, and be billed, for nobody."""
        # Streams that end meanwhile may start more: waited for too, within the bound.
        await self._cancels.stop(CANCELS_STOP_S)

    async def complete(
        self,
        request: Request,
        tenant: TenantRecord,
        key_id: str | None,
        body: oa.ChatCompletionRequest | oa.CompletionRequest,
    ) -> JSONResponse | StreamingResponse:
        """Admit the request as a job and answer it: whole, or as it streams."""
        chat = isinstance(body, oa.ChatCompletionRequest)
        parts, caller = self.parts, _Caller(request, tenant, key_id)
        try:
            job_body = body.to_job()
        except ValidationError as exc:
            first = exc.errors()[0]
            raise APIError(400, f"{first['msg']}.", "invalid_request") from None
        # A slot before the job: a refused request (429 too_many_streams) leaves nothing
        # to run.
        slot = await stream_slot(parts.streams.slots, tenant)
        try:
            job, _ = await admission.submit(
                parts.jobs,
                parts.enqueuer,
                parts.settings,
                tenant,
                job_body,
                None,
                online=True,
                key_id=key_id,
                gate=parts.gate.enter,
            )
        except BaseException:
            slot.release()
            raise
        headers = {"x-request-id": job.id}
        if body.stream:
            # The stream lets its slot go when it ends; the background task covers a
            # response that never started streaming (a client gone before it): slot
            # freed, job cancelled.
            state = _StreamState()
            return StreamingResponse(
                self._stream(caller, job, chat, body.include_usage, slot, state),
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                background=BackgroundTask(self._after_stream, caller, job, slot, state),
            )
        try:
            final = await self._await_final(caller, job)
        finally:
            slot.release()
        if final.status.value == "succeeded":
            return JSONResponse(oa.completion_body(final, chat), headers=headers)
        status = oa.failure_status(final)
        message = final.error_message or "The request failed."
        return JSONResponse(
            error_body(status, message, final.error_code or "server_error"),
            status,
            headers=headers,
        )

    # --- the job's events -----------------------------------------------------------------
    def _follow(self, caller: _Caller, job: JobRecord) -> AsyncGenerator[tuple[int, Any], None]:
        parts = self.parts
        return follow_job(parts.streams.hub, parts.db, parts.events, job, key_id=caller.key_id)

    async def _job(self, job_id: str) -> JobRecord:
        async with self.parts.db.session() as s:
            job = await job_repo.get_job(s, job_id)
        assert job is not None
        return job

    def _cancel_later(self, caller: _Caller, job_id: str) -> None:
        """Cancel a job whose client went away (in a task of its own: the request's own
        scope is being cancelled)."""
        parts = self.parts

        async def cancel() -> None:
            try:
                await cancellation.cancel_job(
                    parts.jobs, parts.redis, parts.names, parts.events, caller.tenant.id, job_id
                )
            except Refused:
                pass  # it finished meanwhile
            except Exception:
                log.exception("could not cancel %s after its client left", job_id)

        self._cancels.spawn(cancel())

    async def _last_event(self, caller: _Caller, job: JobRecord) -> None:
        """Follow the job's events to its terminal one (the result is read from the
        database)."""
        async with contextlib.aclosing(self._follow(caller, job)) as events:
            async for _seq, event in events:
                if event.kind != "delta":
                    return

    async def _await_final(self, caller: _Caller, job: JobRecord) -> JobRecord:
        """Wait for the job to end, watching the client: one that hangs up cancels its job."""
        waiter = asyncio.create_task(self._last_event(caller, job))
        try:
            while True:
                done, _ = await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S)
                if done:
                    waiter.result()
                    break
                if await caller.request.is_disconnected():
                    self._cancel_later(caller, job.id)
                    raise APIError(499, "The client closed the request.", "client_closed_request")
        except StreamClosed as closed:
            self._cancel_later(caller, job.id)
            raise APIError(closed.status, closed.message, closed.code) from None
        except APIError:
            raise
        except Exception:  # Redis or the database lost: whatever it was, it is a 503
            log.exception("lost the event stream of %s", job.id)
            self._cancel_later(caller, job.id)  # answered with an error: it must not run on
            raise APIError(
                503,
                "The queue is unavailable; the request was not completed.",
                "service_unavailable",
                retry_after_s=RETRY_AFTER_S,
            ) from None
        finally:
            waiter.cancel()
        final = await self._job(job.id)
        if final.status not in TERMINAL:  # the stream ended without a terminal state
            self._cancel_later(caller, job.id)
            raise APIError(
                503, "The job did not finish.", "service_unavailable", retry_after_s=RETRY_AFTER_S
            )
        return final

    async def _after_stream(
        self, caller: _Caller, job: JobRecord, slot: Slot, state: _StreamState
    ) -> None:
        slot.release()
        if not state.started:  # the client left before the first byte: nobody will read it
            self._cancel_later(caller, job.id)

    # --- a streamed answer ------------------------------------------------------------
    async def _stream(
        self,
        caller: _Caller,
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

        def role(i: int) -> bytes:
            return _data(oa.chunk(job, chat, role=True, include_usage=include_usage, index=i))

        def content(i: int, text: str, scores: list[dict[str, Any]] | None) -> bytes:
            """Choice i's text after the characters of it sent so far."""
            return _data(
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

        try:
            async with contextlib.aclosing(self._follow(caller, job)) as events:
                async for _seq, event in events:
                    if event.kind == "delta":
                        i = int(event.data.get("index", 0))
                        if event.data.get("replay_truncated"):
                            gaps.add(i)
                        text = "" if i in gaps else event.data.get("text", "")
                        if text:
                            if chat and i not in roles:
                                roles.add(i)
                                yield role(i)
                            scores = event.data.get("logprobs", []) if wants else None
                            yield content(i, text, scores)
                            sent[i] = sent.get(i, 0) + len(text)
                            scored[i] = scored.get(i, 0) + len(scores or ())
                        continue
                    finished = True
                    final = await self._job(job.id)
                    break
            if final is None:
                finished = True
                self._cancel_later(caller, job.id)  # answered with an error: it must not run on
                yield _data(error_body(503, "The job's stream ended early.", "service_unavailable"))
            elif final.status.value == "succeeded":
                for choice in final.choices():
                    i = choice["index"]
                    if chat and i not in roles:  # nothing was streamed: the role still opens it
                        yield role(i)
                    # What followed text the replay buffer no longer held: from the result.
                    rest = choice["text"][sent.get(i, 0) :]
                    rest_scores = (choice["logprobs"] or [])[scored.get(i, 0) :] if wants else None
                    if rest or rest_scores:
                        yield content(i, rest, rest_scores)
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
            self._cancel_later(caller, job.id)
            yield _data(error_body(closed.status, closed.message, closed.code))
            yield b"data: [DONE]\n\n"
        except Exception:  # Redis or the database lost
            finished = True
            log.exception("lost the event stream of %s", job.id)
            self._cancel_later(caller, job.id)  # answered with an error: it must not run on
            yield _data(error_body(503, "The queue became unavailable.", "service_unavailable"))
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream
                self._cancel_later(caller, job.id)
            slot.release()


def _data(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
