"""Traces: one OpenTelemetry trace per job, across the API, the dispatcher and the worker.

Optional. The SDK comes with the `otel` extra and is set up from the standard `OTEL_*`
variables, on first use: `OTEL_TRACES_EXPORTER` (`otlp`, `console`, `none`; unset: `otlp`
when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set),
`OTEL_EXPORTER_OTLP_*` (endpoint, protocol — `http/protobuf` unless `grpc` — headers,
timeout), `OTEL_SERVICE_NAME` (default `tierq`), `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, `OTEL_SDK_DISABLED`. With no exporter configured, or
the SDK not installed, no tracer is set up (this module imports nothing of
OpenTelemetry then) and every helper here is a check of one variable: tracing costs a job
nothing. Spans are exported in the
background (a bounded queue, dropped when full), so a collector that is slow or
unreachable never holds a job up, and a failure inside tracing is logged, never raised.

The trace context travels as a W3C `traceparent`: in the stream entry (`JobMessage.trace`,
stamped by `enqueue` from the span current there), so the dispatcher's and the worker's
spans join the trace the API's request started; and for a job's SSE followers and a
batch's lines, in a Redis key (`RedisNames.trace_context`). The spans (as
docs/operators/traces-and-logs.md lists them):

    HTTP <method> <route>          the API's request (SERVER; the root of a job's trace)
      tierq.admission              the job admitted (database), before it is enqueued
      tierq.queue_wait             dispatcher: from the XADD to the hand-off
      tierq.dispatch               dispatcher: the hand-off to a worker's inbox
      tierq.run                    worker: the claim, the engine's run, the settling
        tierq.engine               worker: the engine's generation, first token an event
      tierq.sse                    API: a follower's stream of the job, to its last event
    tierq.batch_line               Celery: a batch line enqueued; the root of the line's
                                   trace, linked to its batch's (the POST /v1/batches)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis

from tierq import __version__
from tierq.core import logs
from tierq.core.messages import JobMessage

log = logging.getLogger(__name__)

T = TypeVar("T")

_tracer: Any = None  # an opentelemetry Tracer while tracing is on
_configured = False  # whether the environment was read (once per process)
_warned = False


# --- set-up ----------------------------------------------------------------------------


def _exporters() -> list[str]:
    names = os.environ.get("OTEL_TRACES_EXPORTER")
    if names is None:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    return [n for n in (x.strip().lower() for x in names.split(",")) if n and n != "none"]


def configure() -> bool:
    """Read OTEL_* once; True if tracing is on. Called on first use; a process may call it
    early. A process that already set an SDK TracerProvider (`opentelemetry-instrument`)
    has its spans go there."""
    global _configured
    _configured = True
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _exporters()
    if not exporters:
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "OTEL_* asks for traces but the OpenTelemetry SDK is not installed "
            "(pip install 'tierq[otel]'): tracing is off"
        )
        return False
    try:
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            install(current)
            return True
        attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "tierq"}
        provider = TracerProvider(resource=Resource.create(attributes))
        for name in exporters:
            exporter = _exporter(name)
            if exporter is not None:
                provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)  # libraries that trace join the same traces
        install(provider)
        return True
    except Exception:
        log.exception("setting up OpenTelemetry failed: tracing is off")
        return False


def _exporter(name: str) -> Any:
    try:
        if name == "otlp":
            protocol = (
                os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf"
            )
            if protocol.strip().lower() == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )

                return GrpcExporter()
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            return ConsoleSpanExporter(out=sys.stderr)  # stdout is a command's output
    except ImportError:
        log.warning("the OpenTelemetry exporter %r is not installed: its spans are dropped", name)
        return None
    log.warning("unknown OTEL_TRACES_EXPORTER %r: ignored", name)
    return None


def install(provider: Any) -> None:
    """Trace into this TracerProvider (None: tracing off). Tests install one with the
    SDK's in-memory exporter; processes get theirs from `configure`."""
    global _tracer, _configured
    _configured = True
    _tracer = None if provider is None else provider.get_tracer("tierq", __version__)


def enabled() -> bool:
    if _tracer is None and not _configured:
        configure()
    return _tracer is not None


def _failed(what: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("tracing: %s failed; the job goes on untraced", what, exc_info=True)


# --- trace context ---------------------------------------------------------------------


def _context(traceparent: str | None) -> Any:
    """The OpenTelemetry context whose parent is `traceparent` (an empty one: a new root)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent} if traceparent else {}
    return TraceContextTextMapPropagator().extract(carrier)


def _span_context(traceparent: str | None) -> Any:
    """The span a traceparent names (for a link), or None."""
    if not traceparent:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span(_context(traceparent)).get_span_context()
    return ctx if ctx.is_valid else None


def current_traceparent() -> str | None:
    """The W3C traceparent of the span current here; None when tracing is off or no span is."""
    if not enabled():
        return None
    try:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        return carrier.get("traceparent")
    except Exception:
        _failed("reading the trace context")
        return None


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id a traceparent names (`00-<trace id>-<span id>-<flags>`)."""
    if not traceparent or not isinstance(traceparent, str):
        return None
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def sampled(traceparent: str | None) -> bool:
    """Whether a traceparent's flags say its trace is recorded (bit 0; W3C level 2 adds
    more bits)."""
    if not isinstance(traceparent, str):
        return False
    try:
        return bool(int(traceparent.rsplit("-", 1)[1], 16) & 1)
    except (IndexError, ValueError):
        return False


def stamp(msg: JobMessage) -> JobMessage:
    """The message with the current trace context, unless it carries one already (a job
    handed back keeps the trace it started in)."""
    if msg.trace is not None or _tracer is None:
        return msg
    traceparent = current_traceparent()
    return msg if traceparent is None else dataclasses.replace(msg, trace=traceparent)


TRACE_CONTEXT_TTL_S = 86_400  # how long a job's trace context stays findable for followers


async def remember(r: aioredis.Redis, key: str, ttl_s: float) -> None:
    """Keep the current trace context under `key` (a batch's, for its lines to link to)."""
    traceparent = current_traceparent()
    if traceparent is None or not sampled(traceparent):
        return
    try:
        await r.set(key, traceparent, ex=max(1, int(ttl_s)))
    except Exception:
        _failed("storing the trace context")


async def recall(r: aioredis.Redis, key: str) -> str | None:
    """The trace context kept under `key`; None when tracing is off or none was kept."""
    if not enabled():
        return None
    try:
        value = await r.get(key)
    except Exception:
        _failed("reading the stored trace context")
        return None
    if isinstance(value, bytes):
        value = value.decode()
    return value or None


# --- spans -----------------------------------------------------------------------------


class Span:
    """A span being recorded, or nothing (tracing off): `set` adds attributes."""

    def __init__(self, span: Any = None) -> None:
        self.span = span

    def set(self, **attributes: Any) -> None:
        if self.span is None:
            return
        try:
            for key, value in attributes.items():
                if value is not None:
                    self.span.set_attribute(f"tierq.{key}", value)
        except Exception:
            _failed("setting span attributes")

    def set_raw(self, attributes: dict[str, Any]) -> None:
        """Attributes under their own names (OpenTelemetry's semantic conventions)."""
        if self.span is not None:
            try:
                self.span.set_attributes(attributes)
            except Exception:
                _failed("setting span attributes")

    def fail(self, description: str) -> None:
        if self.span is not None:
            try:
                from opentelemetry.trace import Status, StatusCode

                self.span.set_status(Status(StatusCode.ERROR, description))
            except Exception:
                _failed("setting a span's status")

    def rename(self, name: str) -> None:
        if self.span is not None:
            try:
                self.span.update_name(name)
            except Exception:
                _failed("renaming a span")

    def event(self, name: str, **attributes: Any) -> None:
        if self.span is None:
            return
        try:
            self.span.add_event(name, {f"tierq.{k}": v for k, v in attributes.items()})
        except Exception:
            _failed("adding a span event")


NOOP = Span()
_NULL = contextlib.nullcontext(NOOP)  # reusable, with and async with


def job_attributes(msg: JobMessage) -> dict[str, Any]:
    return {
        "job_id": msg.job_id,
        "tenant_id": msg.tenant_id,
        "tier": msg.tier.value,
        "batch_id": msg.batch_id,
    }


def _attrs(attributes: dict[str, Any] | None) -> dict[str, Any]:
    return {f"tierq.{k}": v for k, v in (attributes or {}).items() if v is not None}


def _end(span: Any, exc: BaseException | None, end_time: int | None = None) -> None:
    try:
        if exc is not None:
            from opentelemetry.trace import Status, StatusCode

            if isinstance(exc, Exception):
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            else:  # cancelled, or a generator closed: not the job's failure
                span.set_attribute("tierq.interrupted", type(exc).__name__)
        span.end(end_time=end_time)
    except Exception:
        _failed("ending a span")


class _SpanScope:
    """A span current for the block (`with` or `async with`)."""

    def __init__(self, name: str, kwargs: dict[str, Any]) -> None:
        self.name = name
        self.kwargs = kwargs
        self.span: Any = None
        self.token: Any = None

    def __enter__(self) -> Span:
        try:
            from opentelemetry import context as otel_context
            from opentelemetry import trace

            self.span = _tracer.start_span(self.name, **self.kwargs)
            self.token = otel_context.attach(trace.set_span_in_context(self.span))
        except Exception:
            _failed(f"starting span {self.name}")
            self.span = None
            return NOOP
        return Span(self.span)

    def __exit__(self, _t: Any, exc: BaseException | None, _tb: Any) -> None:
        if self.span is None:
            return
        try:
            from opentelemetry import context as otel_context

            otel_context.detach(self.token)
        except Exception:
            _failed("leaving a span")
        _end(self.span, exc)

    async def __aenter__(self) -> Span:
        return self.__enter__()

    async def __aexit__(self, t: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(t, exc, tb)


_CURRENT: Any = object()


def span(
    name: str,
    *,
    attributes: dict[str, Any] | None = None,
    parent: Any = _CURRENT,
    links: Sequence[str | None] = (),
    kind: str = "internal",
) -> Any:
    """A span current for the block (`with` or `async with`), yielding a `Span`.
    `parent`: a traceparent (None: a new root); by default the current span. `links`:
    traceparents the span links to. `attributes` get the `tierq.` prefix."""
    if not enabled():
        return _NULL
    try:
        from opentelemetry.trace import Link, SpanKind

        kwargs: dict[str, Any] = {
            "attributes": _attrs(attributes),
            "kind": getattr(SpanKind, kind.upper()),
        }
        if parent is not _CURRENT:
            kwargs["context"] = _context(parent)
        linked = [Link(ctx) for ctx in map(_span_context, links) if ctx is not None]
        if linked:
            kwargs["links"] = linked
        return _SpanScope(name, kwargs)
    except Exception:
        _failed(f"preparing span {name}")
        return _NULL


def tag(**attributes: Any) -> None:
    """Attributes (`tierq.` prefixed) on the span current here, if one is recorded."""
    if not enabled():
        return
    try:
        from opentelemetry import trace

        current = trace.get_current_span()
    except Exception:
        _failed("reading the current span")
        return
    if current.is_recording():
        Span(current).set(**attributes)


def server_span(method: str, traceparent: str | None) -> Any:
    """The span of one HTTP request (named `HTTP <method>` until its route is known): a
    child of the client's traceparent if it sent one, else the root of a new trace."""
    return span(f"HTTP {method}", parent=traceparent, kind="server")


# --- the places a job passes -----------------------------------------------------------


async def run_job(coro: Awaitable[T], msg: JobMessage, worker_id: str) -> T:
    """A worker's run of a job: `coro` inside the job's log fields and its `tierq.run`
    span (a child of the job's trace, from the stream entry)."""
    with logs.job_context(
        job_id=msg.job_id,
        tenant_id=msg.tenant_id,
        tier=msg.tier.value,
        trace_id=trace_id_of(msg.trace),
    ):
        if not enabled():
            return await coro
        attributes = {**job_attributes(msg), "worker_id": worker_id}
        with span("tierq.run", attributes=attributes, parent=msg.trace, kind="consumer"):
            return await coro


def engine_stream(stream: AsyncIterator[T], **attributes: Any) -> AsyncIterator[T]:
    """The engine's output, inside a `tierq.engine` span (a child of the current one):
    an event at the first chunk with text, and the tokens and finish reason at the end.
    Tracing off: the stream itself."""
    if not enabled():
        return stream
    return _traced_engine(stream, attributes)


async def _traced_engine(stream: AsyncIterator[T], attributes: dict[str, Any]) -> AsyncIterator[T]:
    # Never made current: an async generator's context is its consumer's.
    started = None
    try:
        started = _tracer.start_span("tierq.engine", attributes=_attrs(attributes))
    except Exception:
        _failed("starting span tierq.engine")
    if started is None:
        async for item in stream:
            yield item
        return
    handle = Span(started)
    chunks = tokens = 0
    first = True
    last: Any = None
    error: BaseException | None = None
    try:
        async for item in stream:
            text: Any = getattr(item, "text", None)
            if first and text:
                handle.event("first_token")
                first = False
            chunks += 1
            tokens += int(getattr(item, "new_tokens", 0) or 0)
            last = item
            yield item
    except BaseException as exc:
        error = exc
        raise
    finally:
        handle.set(
            chunks=chunks,
            completion_tokens=tokens,
            prompt_tokens=getattr(last, "prompt_tokens", None),
            finish_reason=getattr(last, "finish_reason", None),
        )
        _end(started, error)


@contextlib.contextmanager
def _dispatching(handed: list[tuple[JobMessage, str, str]]) -> Iterator[None]:
    now = time.time_ns()
    spans = []
    for msg, entry_id, worker_id in handed:
        with logs.job_context(
            job_id=msg.job_id,
            tenant_id=msg.tenant_id,
            tier=msg.tier.value,
            trace_id=trace_id_of(msg.trace),
        ):
            log.debug("handing job to %s", worker_id)
        if _tracer is None:
            continue
        try:
            parent = _context(msg.trace)
            attributes = _attrs({**job_attributes(msg), "worker_id": worker_id})
            queued_at = _entry_time_ns(entry_id) or int(msg.enqueued_at * 1e9)
            wait = _tracer.start_span(
                "tierq.queue_wait",
                context=parent,
                start_time=min(queued_at, now),
                attributes={**attributes, "tierq.preemptions": msg.preemptions},
            )
            wait.end(end_time=now)
            dispatch = _tracer.start_span("tierq.dispatch", context=parent, attributes=attributes)
            spans.append(dispatch)
        except Exception:
            _failed("starting the dispatch spans")
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        for started in spans:
            _end(started, error)


def dispatching(handed: list[tuple[JobMessage, str, str]]) -> Any:
    """Around the dispatcher's hand-off of jobs (message, tier stream entry id, worker):
    each job's `tierq.queue_wait` (from its entry's XADD) and `tierq.dispatch` spans, in
    the job's trace, and a log line with its fields (debug)."""
    if not enabled() and not log.isEnabledFor(logging.DEBUG):
        return _NULL
    return _dispatching(handed)


def _entry_time_ns(entry_id: str) -> int | None:
    """When a stream entry was added: its id's milliseconds (Redis' clock)."""
    try:
        return int(str(entry_id).split("-", 1)[0]) * 1_000_000
    except ValueError:
        return None


def following(r: aioredis.Redis, key: str) -> Any:
    """Around a follower's stream of a job (`async with`): its `tierq.sse` span, ending
    with the last event; a child of the job's trace (kept under `key` at enqueue), linked
    to the request that follows it when that is another trace. Not made current (the
    stream is an async generator)."""
    if not enabled():
        return _NULL
    return _Following(r, key)


class _Following:
    def __init__(self, r: aioredis.Redis, key: str) -> None:
        self.r, self.key = r, key
        self.span: Any = None

    async def __aenter__(self) -> Span:
        job_trace = await recall(self.r, self.key)
        here = current_traceparent()
        try:
            from opentelemetry.trace import Link

            links = []
            if job_trace and trace_id_of(here) not in (None, trace_id_of(job_trace)):
                links = [Link(ctx) for ctx in [_span_context(here)] if ctx is not None]
            self.span = _tracer.start_span(
                "tierq.sse", context=_context(job_trace or here), links=links or None
            )
        except Exception:
            _failed("starting span tierq.sse")
            return NOOP
        return Span(self.span)

    async def __aexit__(self, _t: Any, exc: BaseException | None, _tb: Any) -> None:
        if self.span is not None:
            _end(self.span, exc)


def batch_line(msg: JobMessage, batch_trace: str | None) -> Any:
    """Around enqueueing a batch line: the root span of the line's own trace
    (`tierq.batch_line`), linked to its batch's."""
    if not enabled():
        return _NULL
    return span(
        "tierq.batch_line",
        attributes=job_attributes(msg),
        parent=None,
        links=[batch_trace],
        kind="producer",
    )
