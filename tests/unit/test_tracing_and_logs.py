"""Tracing's set-up from OTEL_* and its cost when off, the trace context in the job codec,
and the JSON log lines (tierq/core/tracing.py, tierq/core/messages.py, tierq/core/logs.py)."""

from __future__ import annotations

import http.server
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

from tierq.core import logs, tracing
from tierq.core.messages import JobMessage
from tierq.core.tiers import Tier

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter, with no OTEL_* of this environment but `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LOG_"))}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_entry_without_a_trace_is_what_it_was_and_old_entries_decode() -> None:
    msg = JobMessage("job_1", "ten_1", Tier.STANDARD, enqueued_at=1.5, cost=7)
    body = json.loads(msg.encode()["job"])
    assert "trace" not in body  # untraced entries are unchanged
    old = {"job": json.dumps({"job_id": "job_1", "tenant_id": "ten_1", "tier": "standard"})}
    assert JobMessage.decode(old).trace is None
    traced = JobMessage("job_1", "ten_1", Tier.STANDARD, trace=TRACEPARENT)
    assert JobMessage.decode(traced.encode()) == traced
    assert JobMessage.decode({b"job": traced.encode()["job"].encode()}).trace == TRACEPARENT


def test_trace_context_helpers() -> None:
    assert tracing.trace_id_of(TRACEPARENT) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert tracing.trace_id_of(None) is None and tracing.trace_id_of("junk") is None
    assert tracing.sampled(TRACEPARENT) and tracing.sampled(TRACEPARENT[:-2] + "03")
    assert not tracing.sampled(TRACEPARENT[:-2] + "00") and not tracing.sampled(None)
    # A foreign or damaged entry's field breaks nothing.
    assert tracing.trace_id_of(123) is None and not tracing.sampled(123)  # type: ignore[arg-type]


def test_without_an_exporter_tracing_is_off_sets_nothing_up_and_costs_next_to_nothing() -> None:
    done = _python(
        """
        import asyncio, sys, time
        from tierq.core import tracing
        from tierq.core.messages import JobMessage
        from tierq.core.tiers import Tier

        msg = JobMessage("job_1", "ten_1", Tier.BATCH)
        assert not tracing.enabled()
        assert tracing.stamp(msg) is msg
        with tracing.span("x") as s:
            s.set(job_id="job_1")
        with tracing.dispatching([(msg, "1-0", "w1")]):
            pass
        async def one():
            return 1
        assert asyncio.run(tracing.run_job(one(), msg, "w1")) == 1
        stream = object()
        assert tracing.engine_stream(stream) is stream  # type: ignore[arg-type]
        # (redis-py loads parts of OpenTelemetry for metrics of its own: not the tracer)
        assert "opentelemetry.sdk.trace" not in sys.modules
        assert "opentelemetry.trace.propagation.tracecontext" not in sys.modules
        started = time.perf_counter()
        for _ in range(100_000):
            with tracing.span("x"):
                pass
        print((time.perf_counter() - started) / 100_000)
        """
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 20e-6  # seconds a span costs when off: a flag and a no-op


def test_the_console_exporter_from_otel_traces_exporter() -> None:
    done = _python(
        """
        from tierq.core import tracing
        assert tracing.enabled()
        with tracing.span("tierq.test", attributes={"job_id": "job_1"}):
            print(tracing.current_traceparent())
        """,
        OTEL_TRACES_EXPORTER="console",
        OTEL_SERVICE_NAME="tierq-unit",
    )
    assert done.returncode == 0, done.stderr
    assert tracing.sampled(done.stdout.strip())
    assert '"name": "tierq.test"' in done.stderr and "tierq-unit" in done.stderr
    assert '"tierq.job_id": "job_1"' in done.stderr


def test_an_unreachable_collector_never_holds_a_span_up() -> None:
    # A blackholed address (a TEST-NET-1 one): the export waits for its timeout, in the
    # background; the spans themselves take no longer than without it.
    done = _python(
        """
        import time
        from tierq.core import tracing
        assert tracing.enabled()
        started = time.perf_counter()
        for _ in range(1000):
            with tracing.span("tierq.test"):
                pass
        print(time.perf_counter() - started)
        """,
        OTEL_EXPORTER_OTLP_ENDPOINT="http://192.0.2.1:4318",
        OTEL_EXPORTER_OTLP_TIMEOUT="1",
        OTEL_BSP_SCHEDULE_DELAY="50",
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 1.0


def test_otel_sdk_disabled_and_exporter_none_turn_it_off() -> None:
    code = "from tierq.core import tracing; assert not tracing.enabled()"
    for env in (
        {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"},
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
    ):
        done = _python(code, **env)
        assert done.returncode == 0, (env, done.stderr)


def test_json_lines_carry_the_job_fields_extra_and_exceptions() -> None:
    formatter = logs.JsonFormatter()
    record = logging.makeLogRecord(
        {"name": "tierq.workers.worker", "levelname": "INFO", "msg": "ran %s", "args": ("it",)}
    )
    record.__dict__["worker_id"] = "w1"  # as `extra` puts it
    with logs.job_context(job_id="job_1", tenant_id="ten_1", tier="batch", trace_id=None):
        line = json.loads(formatter.format(record))
    assert line["message"] == "ran it" and line["logger"] == "tierq.workers.worker"
    assert (line["job_id"], line["tenant_id"], line["tier"]) == ("job_1", "ten_1", "batch")
    assert "trace_id" not in line and line["worker_id"] == "w1"
    assert "job_id" not in json.loads(formatter.format(record))  # only inside the context
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.makeLogRecord({"msg": "failed", "exc_info": sys.exc_info()})
    assert "ValueError: boom" in json.loads(formatter.format(failed))["exc_info"]


def test_log_format_json_makes_every_line_json() -> None:
    done = _python(
        """
        import logging
        from tierq.core import logs
        logs.setup()
        with logs.job_context(job_id="job_1", tier="standard"):
            logging.getLogger("tierq.x").warning("two\\nlines %d", 2, extra={"k": 3})
        """,
        LOG_FORMAT="json",
    )
    assert done.returncode == 0, done.stderr
    (line,) = done.stderr.splitlines()
    entry = json.loads(line)
    assert entry["message"] == "two\nlines 2" and entry["k"] == 3
    assert entry["job_id"] == "job_1" and entry["tier"] == "standard"
    assert entry["level"] == "WARNING"


def test_otel_exporter_otlp_endpoint_sends_the_spans_there() -> None:
    """The whole path from the environment: a process with only the endpoint set sends
    its spans to an OTLP/HTTP receiver (here a bare one) by the time it exits."""
    received: list[tuple[str, bytes]] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = _python(
            """
            from tierq.core import tracing
            with tracing.span("tierq.exported", attributes={"job_id": "job_42"}):
                pass
            """,
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}",
        )
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    assert [path for path, _ in received] == ["/v1/traces"]
    assert b"tierq.exported" in received[0][1] and b"job_42" in received[0][1]
