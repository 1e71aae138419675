"""What the platform's HTTP answers share, for every client of them (the command line,
`tierq top`, the batch client)."""

from __future__ import annotations

import httpx


def error_message(resp: httpx.Response) -> str:
    """The message of an error answer in OpenAI's shape, else the body as it came."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text
