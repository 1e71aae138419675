"""Logging set-up shared by every process, and the job fields a log line carries.

With LOG_FORMAT=json every line is one JSON object: `ts`, `level`, `logger`, `message`,
the fields of the job being handled — `job_id`, `tenant_id`, `tier`, `trace_id` wherever
they are known — any structured `extra`, and `exc_info` for an exception. The job fields
live in a context variable, set where a job is handled (admission, the dispatcher's
hand-off, the worker's run of a job: `job_context`, `bind`), so every line logged there,
by tierq or a library, carries them.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from tierq.core.settings import get_settings

# The job fields of the work under way in this context (task), for the log lines.
_FIELDS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "tierq_log_fields", default=None
)

JOB_FIELDS = ("job_id", "tenant_id", "tier", "trace_id")

# What every LogRecord has; anything else on a record came from `extra`.
_RECORD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def _merged(fields: dict[str, Any]) -> dict[str, str]:
    merged = dict(_FIELDS.get() or {})
    merged.update({k: str(v) for k, v in fields.items() if v is not None})
    return merged


@contextlib.contextmanager
def job_context(**fields: Any) -> Iterator[None]:
    """Log lines inside carry these fields (None values are left out)."""
    token = _FIELDS.set(_merged(fields))
    try:
        yield
    finally:
        _FIELDS.reset(token)


def bind(**fields: Any) -> None:
    """Log lines from here to the end of the current context (an API request's task)
    carry these fields."""
    _FIELDS.set(_merged(fields))


def fields() -> dict[str, str]:
    """The job fields known here: those bound, and the trace id of the current span."""
    known = dict(_FIELDS.get() or {})
    if "trace_id" not in known:
        trace_id = _current_trace_id()
        if trace_id is not None:
            known["trace_id"] = trace_id
    return known


def _current_trace_id() -> str | None:
    # Only where OpenTelemetry is already loaded (tracing is on): nothing is imported
    # for a log line.
    otel = sys.modules.get("opentelemetry.trace")
    if otel is None:
        return None
    ctx = otel.get_current_span().get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else None


class JsonFormatter(logging.Formatter):
    """One JSON object a line (LOG_FORMAT=json)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(fields())
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def formatter(log_format: str | None = None) -> logging.Formatter:
    """The formatter LOG_FORMAT asks for (`text` or `json`)."""
    if (log_format or get_settings().log_format) == "json":
        return JsonFormatter()
    return logging.Formatter(TEXT_FORMAT)


def setup(level: str | None = None) -> None:
    """Log at `level`, else at Settings.log_level (LOG_LEVEL), as LOG_FORMAT says."""
    # Logs go to stderr, vLLM's too (its default is stdout): a command's stdout is its
    # output — a benchmark's JSON line stays the last line there.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(formatter())
    logging.basicConfig(level=(level or get_settings().log_level).upper(), handlers=[handler])
