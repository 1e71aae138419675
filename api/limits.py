"""A pure-ASGI guard that refuses request bodies over the size limit (413), streamed or not."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body


class BodySizeLimit:
    """Refuse by Content-Length when there is one; otherwise read up to the limit first.

    A chunked body (no Content-Length) is buffered before the app sees it — at most
    `max_bytes`, the same bound the app would hold anyway — and refused once it outgrows it.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                await self._refuse(send)
                return
            await self.app(scope, receive, send)
            return
        if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            body.extend(message.get("body", b""))
            if len(body) > self.max_bytes:
                await self._refuse(send)
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

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            error_body(
                413, f"The request body exceeds {self.max_bytes} bytes.", "request_too_large"
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})
