"""A pure-ASGI guard that refuses request bodies over the size limit (413), streamed or not."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body


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
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            body.extend(message.get("body", b""))
            if len(body) > limit:
                await self._refuse(send, limit)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

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
        body = json.dumps(
            error_body(413, f"The request body exceeds {limit} bytes.", "request_too_large")
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})
