"""Webhooks: OpenAI's batch events, signed by the Standard Webhooks scheme OpenAI uses, sent
to a URL a tenant (or the operator) registered — what `client.webhooks.unwrap` verifies.

Sending is an outbound request to a URL someone else named, so it is held to what such a
request may do (server-side request forgery):
- the host is resolved once and every address it resolves to must be global — not
  private, loopback, link-local, multicast, reserved or shared — unless the operator
  allows private addresses (WEBHOOK_ALLOW_PRIVATE); the request then goes to an address
  that was checked (the URL's host stays in `Host` and TLS's SNI and certificate check),
  so a second resolution cannot point it elsewhere;
- https only, unless WEBHOOK_ALLOW_HTTP; no credentials in the URL;
- no redirect is followed (a 3xx is a failed attempt), no proxy from the environment;
- one attempt takes at most WEBHOOK_TIMEOUT_S, and of the answer only its status line and
  headers are read (and at most ERROR_EXCERPT bytes of a failure's body, for the record).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import hmac
import ipaddress
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
)

from tierq.core.aio import raise_if_cancelled
from tierq.core.settings import Settings
from tierq.services.requests import NOT_BLANK, blank

# The events tierq sends: OpenAI's batch events. The other event types OpenAI defines
# (responses, fine-tuning, ...) have no counterpart here and are refused at registration.
EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")
EventType = Literal["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]
MAX_URL = 2048
ERROR_EXCERPT = 200  # bytes of a failed answer's body kept in the delivery's record
USER_AGENT = "tierq-webhooks/1"


def _not_blank(v: str) -> str:
    if blank(v):
        raise ValueError("a name must hold more than whitespace")
    return v


# Not blank as the document's pattern says it (ECMA-262's whitespace): Python's `\S`
# refused U+0085, which the document took (found by the OpenAPI fuzz).
Name = Annotated[
    str,
    StringConstraints(min_length=1, max_length=200),
    AfterValidator(_not_blank),
    Field(json_schema_extra={"pattern": NOT_BLANK}),
]
Url = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_URL, pattern="^https?://"),
    Field(
        description="An https:// URL (http:// where the operator allows it) whose host is, "
        "or resolves only to, public addresses (private ones where the operator allows them)."
    ),
]


def _unique(v: list[str] | None) -> list[str] | None:
    """An event type named twice is taken once."""
    return None if v is None else list(dict.fromkeys(v))


class WebhookEndpointCreate(BaseModel):
    """`POST /v1/webhook_endpoints` (and the operator's): OpenAI's body."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    url: Url
    event_types: list[EventType] = Field(min_length=1, max_length=len(EVENT_TYPES))

    _unique_types = field_validator("event_types")(_unique)


class WebhookEndpointUpdate(BaseModel):
    """`POST /v1/webhook_endpoints/{id}`: what is given replaces what was."""

    model_config = ConfigDict(extra="forbid")

    name: Name | None = None
    url: Url | None = None
    event_types: list[EventType] | None = Field(
        default=None, min_length=1, max_length=len(EVENT_TYPES)
    )

    _unique_types = field_validator("event_types")(_unique)


class RotateSecret(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_old_secret_active_for_24_hours: bool = False


class WebhookTest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    event_type: EventType


# --- URLs and addresses -----------------------------------------------------------------


class UnsafeURL(ValueError):
    """A webhook URL that may not be used: its message says why."""


def check_url(url: str, settings: Settings) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL a webhook may be sent to, else UnsafeURL; the host as
    it goes on the wire (an international name in its IDNA form). Its addresses are checked
    separately (`resolve`), when it is registered and on every send."""
    try:
        parts = urlsplit(url)
        port = parts.port
        wire = httpx.URL(url)  # IDNA 2008, as the request will spell the host
    except (ValueError, httpx.InvalidURL) as exc:
        raise UnsafeURL(f"The URL is not valid: {exc}.") from None
    schemes = ("https", "http") if settings.webhook_allow_http else ("https",)
    if parts.scheme not in schemes:
        raise UnsafeURL(f"The URL must be {' or '.join(s + '://' for s in schemes)}.")
    if not parts.hostname:
        raise UnsafeURL("The URL has no host.")
    if parts.username is not None or parts.password is not None:
        raise UnsafeURL("The URL may not carry credentials.")
    if parts.fragment:
        raise UnsafeURL("The URL may not carry a fragment.")
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise UnsafeURL("The URL may not contain whitespace or control characters.")
    host = wire.raw_host.decode("ascii").strip("[]")
    return parts.scheme, host, port or (443 if parts.scheme == "https" else 80)


# IPv6 prefixes whose addresses carry an IPv4 address a network may route to (NAT64, 6to4,
# Teredo, the IPv4-compatible and -translated forms) or that are private in all but name
# (site-local): an AAAA record in one of them could reach 10.0.0.5 through a gateway, so
# none is taken for public.
_EMBEDS_IPV4 = tuple(
    ipaddress.ip_network(n)
    for n in (
        "::/96",
        "::ffff:0:0:0/96",
        "64:ff9b::/96",
        "64:ff9b:1::/48",
        "2002::/16",
        "2001::/32",
        "fec0::/10",
    )
)


def address_allowed(address: str, settings: Settings) -> bool:
    """Whether a request may go to this IP address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if ip.is_unspecified or ip.is_multicast:
        return False  # 0.0.0.0 reaches this host itself
    if settings.webhook_allow_private:
        return True
    if isinstance(ip, ipaddress.IPv6Address) and any(ip in net for net in _EMBEDS_IPV4):
        return False
    return ip.is_global


# Lookups run in a few threads of their own: a tenant naming hosts whose DNS never answers
# ties up these, not the default executor that file uploads and schema checks share.
_RESOLVER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="webhook-dns")


async def resolve(host: str, port: int, settings: Settings) -> list[str]:
    """The host's addresses, every one of them allowed, else UnsafeURL (in at most
    WEBHOOK_TIMEOUT_S)."""
    lookup = functools.partial(
        socket.getaddrinfo, host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    try:
        async with asyncio.timeout(settings.webhook_timeout_s):
            found = await asyncio.get_running_loop().run_in_executor(_RESOLVER, lookup)
    except TimeoutError:
        raise UnsafeURL(f"The URL's host {host!r} did not resolve in time.") from None
    except (socket.gaierror, UnicodeError) as exc:
        raise UnsafeURL(f"The URL's host {host!r} does not resolve: {exc}.") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    if not addresses:
        raise UnsafeURL(f"The URL's host {host!r} has no address.")
    refused = [a for a in addresses if not address_allowed(a, settings)]
    if refused:
        raise UnsafeURL(
            f"The URL's host {host!r} is (or resolves to) {refused[0]}: private, loopback, "
            "link-local and other non-public addresses are not allowed."
        )
    return addresses


async def check_reachable(url: str, settings: Settings) -> None:
    """Refuse (UnsafeURL) a URL that could not be sent to now: registration's check."""
    _, host, port = check_url(url, settings)
    await resolve(host, port, settings)


# --- secrets and signatures ---------------------------------------------------------


def new_secret() -> str:
    """A signing secret as Standard Webhooks spells it: whsec_ and base64 of 32 bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64 HMAC-SHA256>` of `id.timestamp.body` under the secret's bytes."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def signed_headers(
    message_id: str, body: bytes, secrets_: list[str], timestamp: int | None = None
) -> dict[str, str]:
    """The Standard Webhooks headers: one signature per secret (two while a rotated-out
    secret is still honoured), space-separated."""
    ts = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": " ".join(signature(s, message_id, ts, body) for s in secrets_),
        "content-type": "application/json",
        "user-agent": USER_AGENT,
    }


# --- sending -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """What one attempt came to: the answer's status, or why there was none."""

    status_code: int | None
    error: str | None

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


async def send(url: str, body: bytes, headers: dict[str, str], settings: Settings) -> Attempt:
    """POST the body to the URL, under the rules this module's docstring states. Whatever
    goes wrong is the attempt's outcome (never raised): each attempt is recorded."""
    try:
        async with asyncio.timeout(settings.webhook_timeout_s):
            return await _send(url, body, headers, settings)
    except UnsafeURL as exc:
        return Attempt(None, str(exc))
    except TimeoutError:
        return Attempt(None, f"no answer within {settings.webhook_timeout_s:g} s")
    except Exception as exc:
        raise_if_cancelled(exc)
        return Attempt(None, f"{type(exc).__name__}: {exc}"[:500])


async def _send(url: str, body: bytes, headers: dict[str, str], settings: Settings) -> Attempt:
    scheme, host, port = check_url(url, settings)
    addresses = await resolve(host, port, settings)
    # Each address gets its share of the attempt to connect: one that drops packets leaves
    # time for the next.
    timeout = httpx.Timeout(None, connect=settings.webhook_timeout_s / (len(addresses) + 1))
    async with httpx.AsyncClient(
        follow_redirects=False, trust_env=False, timeout=timeout
    ) as client:
        for n, address in enumerate(addresses):  # the checked addresses, in order
            try:
                return await _post(client, url, address, scheme, host, body, headers)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                if n == len(addresses) - 1:
                    raise
    raise AssertionError("resolve returns at least one address")


async def _post(
    client: httpx.AsyncClient,
    url: str,
    address: str,
    scheme: str,
    host: str,
    body: bytes,
    headers: dict[str, str],
) -> Attempt:
    """POST to this address, the URL's host kept in `Host` and in TLS's SNI and check."""
    wire = httpx.URL(url)
    target = wire.copy_with(host=address)
    netloc = wire.netloc.decode("ascii")  # the name in its IDNA form, with a given port
    extensions = {"sni_hostname": host} if scheme == "https" else {}
    async with client.stream(
        "POST", target, content=body, headers={**headers, "host": netloc}, extensions=extensions
    ) as answer:
        if 200 <= answer.status_code < 300:
            return Attempt(answer.status_code, None)
        excerpt = b""
        async for chunk in answer.aiter_raw():
            excerpt += chunk
            if len(excerpt) >= ERROR_EXCERPT:
                break
        text = excerpt[:ERROR_EXCERPT].decode("utf-8", "replace").strip()
        why = f"answered {answer.status_code}" + (f": {text}" if text else "")
        if 300 <= answer.status_code < 400:
            why = f"answered {answer.status_code} (redirects are not followed)"
        return Attempt(answer.status_code, why[:500])
