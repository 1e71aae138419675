"""Pure-ASGI guards at the door: request bodies over the size limit (413, streamed or not),
and input that no route may take (400): see tierq/services/hostile.py."""

from __future__ import annotations

import json
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierq.api.errors import error_body
from tierq.services.hostile import suspect, unstorable


class _TooLarge(Exception):
    """Raised into the app from a counted upload that outgrew its limit."""


class BodySizeLimit:
    """Refuse by Content-Length when there is one; otherwise read up to the limit first.

    A chunked body (no Content-Length) is buffered before the app sees it — at most
    `max_bytes`, the same bound the app would hold anyway — and refused once it outgrows it.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, large: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.large = large or {}  # exact paths that take larger bodies (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.large.get(scope.get("path", ""), self.max_bytes)
        headers = dict(scope.get("headers", []))
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > limit:
                await self._refuse(send, limit)
                return
            await self.app(scope, receive, send)
            return
        if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
            await self.app(scope, receive, send)
            return
        if limit != self.max_bytes:
            await self._counted(scope, receive, send, limit)
            return
        body = await read_body(receive, limit)
        if body is None:
            await self._refuse(send, limit)
            return
        await self.app(scope, replaying(body, receive), send)

    async def _counted(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        """A large chunked upload is not buffered: it is counted as the app reads it, and
        the app is stopped (then answered 413) once it outgrows the limit."""
        seen = 0
        started = False

        async def counting() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge
            return message

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting, watch)
        except _TooLarge:
            if not started:
                await self._refuse(send, limit)

    async def _refuse(self, send: Send, limit: int) -> None:
        await send_error(send, 413, f"The request body exceeds {limit} bytes.", "request_too_large")


class HostileInput:
    """Refuse (400, OpenAI's error shape) a request whose path, query string or JSON body
    holds what tierq/services/hostile.py names — before any route, so none can store it, whatever
    its schema. Runs inside BodySizeLimit, which bounds every body; a body that is not a form
    is buffered only up to `max_bytes`. A body that could not hold such a value (the usual
    one) is not parsed here."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        # Only a form (a file upload) may be larger: any other body past this is refused
        # before it is buffered whole.
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        why = _bad_target(scope)
        if why is not None:
            await _refuse(send, why)
            return
        headers = dict(scope.get("headers", []))
        if scope["method"] in ("GET", "HEAD") or _form(headers.get(b"content-type", b"")):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive, self.max_bytes)
        if body is None:
            await send_error(
                send, 413, f"The request body exceeds {self.max_bytes} bytes.", "request_too_large"
            )
            return
        if suspect(body):
            try:
                why = unstorable(json.loads(body))
            except RecursionError:
                why = "the body is nested too deeply"
            except ValueError:
                why = None  # not JSON at all: the route says so in its own words
            if why is not None:
                await _refuse(send, why)
                return
        await self.app(scope, replaying(body, receive), send)


def _form(content_type: bytes) -> bool:
    """A form body, whose fields the routes that take one check themselves. Any other body is
    scanned: FastAPI parses JSON whatever the type's case (`Application/JSON`) and for any
    `+json` subtype, and a route may read another body itself."""
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind.startswith(b"multipart/") or kind == b"application/x-www-form-urlencoded"


async def read_body(receive: Receive, limit: int | None = None) -> bytes | None:
    """A request's whole body, read ahead of the app; None once it outgrows `limit`."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        body.extend(message.get("body", b""))
        if limit is not None and len(body) > limit:
            return None
        if not message.get("more_body", False):
            break
    return bytes(body)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body read ahead, then the rest of the exchange."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _bad_target(scope: Scope) -> str | None:
    why = unstorable(scope.get("path", ""))
    if why is not None:
        return f"the path {why.removeprefix('a value ')}"
    query: bytes = scope.get("query_string", b"")
    if not query:
        return None
    raw = query.decode("latin-1")
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, errors="strict")
    except UnicodeDecodeError:
        return "the query string is not UTF-8"
    for name, value in pairs:
        why = unstorable(name) or unstorable(value)
        if why is not None:
            return f"the query parameter '{name[:40]}' {why.removeprefix('a value ')}"
    return None


async def _refuse(send: Send, why: str) -> None:
    await send_error(send, 400, f"The request cannot be taken: {why}.", "invalid_request")


async def send_error(send: Send, status: int, message: str, code: str) -> None:
    """An error answered from a guard, before any route: OpenAI's error shape."""
    body = json.dumps(error_body(status, message, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})
