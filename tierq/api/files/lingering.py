"""A refusal answered before the request's body was read whole (an upload past its quota,
its size limit or its tenant's concurrent uploads).

The connection is closed after it, so the server reads no more of the body (uvicorn would
otherwise read and discard the rest, however large). But a socket closed with unread data
is reset, and a reset makes the client's system drop the answer it had not read yet: so the
answer is sent whole first, then the body is read and discarded for a moment (at most
LINGER_S and LINGER_BYTES; nginx's lingering close) while the client reads it and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tierq.api.errors import APIError, error_body

LINGER_S = 1.0
LINGER_BYTES = 16 * 1024 * 1024


class Unread(Exception):
    """A refusal made before the body was read whole."""

    def __init__(self, refusal: APIError) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class LingeringRefusal(Response):
    """The refusal in the OpenAI error shape, with `Connection: close`."""

    def __init__(self, refusal: APIError) -> None:
        headers = {**(refusal.headers or {}), "Connection": "close"}
        if refusal.retry_after_s is not None:
            headers["Retry-After"] = str(refusal.retry_after_s)
        body = error_body(refusal.status, refusal.message, refusal.code, refusal.param)
        super().__init__(
            json.dumps(body).encode(), refusal.status, headers, media_type="application/json"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        # A client gone, or the body past the size limit's counter: nothing more to wait for.
        with contextlib.suppress(Exception, TimeoutError):
            await asyncio.wait_for(_discard(receive), LINGER_S)
        await send({"type": "http.response.body", "body": b""})


async def _discard(receive: Receive) -> None:
    read = 0
    while read < LINGER_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
