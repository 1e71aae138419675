"""A span per HTTP request (tierq/core/tracing.py): the root of a submitted job's trace.

Outermost middleware, so the span covers everything the request does — admission, and
for a streamed answer every event to the last one. Tracing off, it passes the request on
untouched.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierq.core import tracing

# Probes and scrapes: a trace each every few seconds would bury the jobs' traces.
UNTRACED = frozenset({"/healthz", "/readyz", "/metrics", "/admin/metrics"})


class RequestSpans:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        tracing.enabled()  # set up from OTEL_* now (at startup), not in a first request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED or not tracing.enabled():
            await self.app(scope, receive, send)
            return
        traceparent = None
        for name, value in scope.get("headers", ()):
            if name == b"traceparent":
                traceparent = value.decode("latin-1")
                break
        status: dict[str, int] = {}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        method = scope.get("method", "GET")
        async with tracing.server_span(method, traceparent) as span:
            span.set_raw({"http.request.method": method, "url.path": scope.get("path", "")})
            try:
                await self.app(scope, receive, sending)
            finally:
                _finish(span, scope, method, status.get("code"))


def _finish(span: tracing.Span, scope: Scope, method: str, code: int | None) -> None:
    route: Any = scope.get("route")
    template = getattr(route, "path", None)
    if template:
        span.rename(f"HTTP {method} {template}")
        span.set_raw({"http.route": template})
    if code is not None:
        span.set_raw({"http.response.status_code": code})
        if code >= 500:
            span.fail(f"HTTP {code}")
