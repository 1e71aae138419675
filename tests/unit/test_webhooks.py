"""Webhooks' pure parts (tierq/services/webhooks.py, tierq/models/webhooks.py's event body): URLs and
addresses a delivery may go to, Standard Webhooks signatures as the `openai` SDK verifies
them, and the retry schedule."""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest
from pydantic import ValidationError

from tierq.core.settings import Settings
from tierq.models.webhooks import EndpointRecord, event_body
from tierq.services import webhooks
from tierq.workers.webhooks import backoff_s

STRICT = Settings(_env_file=None)  # type: ignore[call-arg]
OPEN = STRICT.model_copy(update={"webhook_allow_private": True, "webhook_allow_http": True})


@pytest.mark.parametrize(
    "url",
    [
        "http://hooks.example.com/x",  # http needs WEBHOOK_ALLOW_HTTP
        "ftp://hooks.example.com/x",
        "https://user:pw@hooks.example.com/x",
        "https://hooks.example.com/x#frag",
        "https:///nohost",
        "https://hooks.example.com:99999/x",
        "https://hooks.example.com/a b",
        "hooks.example.com/x",
    ],
)
def test_urls_that_are_refused_before_any_lookup(url: str) -> None:
    with pytest.raises(webhooks.UnsafeURL):
        webhooks.check_url(url, STRICT)


def test_a_good_url_gives_its_host_and_port() -> None:
    assert webhooks.check_url("https://hooks.example.com/in", STRICT) == (
        "https",
        "hooks.example.com",
        443,
    )
    assert webhooks.check_url("http://10.0.0.5:8080/in", OPEN) == ("http", "10.0.0.5", 8080)


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # shared address space (carrier NAT)
        "192.0.2.10",  # documentation
        "::1",
        "fe80::1",
        "fd00::1",
        "::ffff:127.0.0.1",  # IPv4-mapped loopback
        "::ffff:10.0.0.1",
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
        "64:ff9b:1::a00:1",  # local-use NAT64
        "2002:7f00:1::",  # 6to4 of 127.0.0.1
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
        "::7f00:1",  # IPv4-compatible
        "::ffff:0:7f00:1",  # IPv4-translated
        "fec0::1",  # site-local
    ],
)
def test_non_global_addresses_are_refused_unless_allowed(address: str) -> None:
    assert not webhooks.address_allowed(address, STRICT)
    assert webhooks.address_allowed(address, OPEN)


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "224.0.0.1", "ff02::1"])
def test_unspecified_and_multicast_are_refused_always(address: str) -> None:
    assert not webhooks.address_allowed(address, OPEN)


def test_global_addresses_are_allowed() -> None:
    for address in ("8.8.8.8", "93.184.215.14", "2606:4700:4700::1111"):
        assert webhooks.address_allowed(address, STRICT)


async def test_names_are_resolved_and_every_address_checked() -> None:
    with pytest.raises(webhooks.UnsafeURL, match=r"127\.0\.0\.1|::1"):
        await webhooks.check_reachable("https://localhost/hook", STRICT)
    with pytest.raises(webhooks.UnsafeURL, match="does not resolve"):
        await webhooks.check_reachable("https://no-such-host.invalid/hook", STRICT)
    await webhooks.check_reachable("https://8.8.8.8/hook", STRICT)  # a literal: no lookup
    await webhooks.check_reachable("http://localhost:9/hook", OPEN)


async def test_one_private_address_among_public_ones_refuses_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name that resolves to a public and a private address (a rebinding trick) is
    refused whole: the request could not be kept to the public one."""

    def lookup(host: str, port: int, **_: object) -> list[tuple[object, ...]]:
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("8.8.8.8", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", port)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    with pytest.raises(webhooks.UnsafeURL, match=r"10\.0\.0\.1"):
        await webhooks.check_reachable("https://mixed.example/hook", STRICT)


def test_an_international_name_goes_on_the_wire_in_its_idna_form() -> None:
    assert webhooks.check_url("https://bücher.example/in", STRICT)[1] == "xn--bcher-kva.example"
    with pytest.raises(webhooks.UnsafeURL):
        webhooks.check_url("https://☃.example/", STRICT)  # not a valid IDNA 2008 name


async def test_a_url_the_sender_cannot_build_is_a_failed_attempt_not_an_error() -> None:
    attempt = await webhooks.send("https://☃.example/", b"{}", {}, OPEN)
    assert attempt.status_code is None and attempt.error


async def test_the_request_goes_to_the_checked_address_with_host_and_sni_kept() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        got = await webhooks._post(
            client,
            "https://bücher.example:8443/in?x=1",
            "93.184.215.14",
            "https",
            "xn--bcher-kva.example",
            b"{}",
            {"webhook-id": "evt_1"},
        )
    assert got.delivered
    [request] = seen
    assert request.url.host == "93.184.215.14" and request.url.port == 8443
    assert request.url.raw_path == b"/in?x=1"
    assert request.headers["host"] == "xn--bcher-kva.example:8443"
    assert request.extensions["sni_hostname"] == "xn--bcher-kva.example"
    assert request.headers["webhook-id"] == "evt_1"


async def test_a_refused_address_is_an_attempt_that_failed_without_a_request() -> None:
    attempt = await webhooks.send("https://127.0.0.1:9/hook", b"{}", {}, STRICT)
    assert attempt.status_code is None and not attempt.delivered
    assert attempt.error is not None and "127.0.0.1" in attempt.error


def test_signatures_verify_with_the_openai_sdk() -> None:
    secret = webhooks.new_secret()
    assert secret.startswith("whsec_") and len(secret) > 40
    body = event_body("evt_1", "batch.completed", "batch_1", 1_700_000_000).encode()
    headers = webhooks.signed_headers("evt_1", body, [secret])
    client = openai.OpenAI(api_key="unused")
    event = client.webhooks.unwrap(body, headers, secret=secret)
    assert event.type == "batch.completed" and event.data.id == "batch_1"
    assert event.id == "evt_1" and event.object == "event"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body, headers, secret=webhooks.new_secret())
    with pytest.raises(openai.InvalidWebhookSignatureError):  # the body changed
        client.webhooks.unwrap(body.replace(b"batch_1", b"batch_2"), headers, secret=secret)
    old = webhooks.signed_headers("evt_1", body, [secret], timestamp=1_700_000_000)
    with pytest.raises(openai.InvalidWebhookSignatureError, match="too old"):
        client.webhooks.unwrap(body, old, secret=secret)


def test_during_a_rotation_both_secrets_verify() -> None:
    new, old = webhooks.new_secret(), webhooks.new_secret()
    now = datetime.now(UTC)
    endpoint = EndpointRecord(
        id="we_1",
        tenant_id="ten_1",
        name="n",
        url="https://8.8.8.8/",
        event_types=("batch.completed",),
        secret=new,
        previous_secret=old,
        previous_secret_until=now + timedelta(hours=1),
        created_by="tenant",
        created_at=now,
        updated_at=now,
        deleted_at=None,
    )
    body = b'{"id":"evt_2"}'
    headers = webhooks.signed_headers("evt_2", body, endpoint.signing_secrets(now))
    assert len(headers["webhook-signature"].split()) == 2
    client = openai.OpenAI(api_key="unused")
    for secret in (new, old):
        client.webhooks.verify_signature(body, headers, secret=secret)
    later = now + timedelta(hours=2)  # the old one is no longer honoured
    assert endpoint.signing_secrets(later) == [new]


def test_the_event_body_is_openais_event_object() -> None:
    body = json.loads(event_body("evt_9", "batch.failed", "batch_9", 123))
    assert body == {
        "id": "evt_9",
        "object": "event",
        "created_at": 123,
        "type": "batch.failed",
        "data": {"id": "batch_9"},
    }


def test_registration_bodies() -> None:
    ok = webhooks.WebhookEndpointCreate.model_validate(
        {"name": "n", "url": "https://8.8.8.8/", "event_types": ["batch.completed"]}
    )
    assert ok.event_types == ["batch.completed"]
    twice = {"name": "n", "url": "https://8.8.8.8/", "event_types": ["batch.failed"] * 2}
    assert webhooks.WebhookEndpointCreate.model_validate(twice).event_types == ["batch.failed"]
    for bad in (
        {"name": "n", "url": "https://8.8.8.8/", "event_types": []},
        {"name": "n", "url": "https://8.8.8.8/", "event_types": ["response.completed"]},
        {"name": " ", "url": "https://8.8.8.8/", "event_types": ["batch.failed"]},
        {"name": "n", "url": "https://8.8.8.8/" + "x" * 3000, "event_types": ["batch.failed"]},
        {"name": "n", "url": "https://8.8.8.8/", "event_types": ["batch.failed"], "x": 1},
    ):
        with pytest.raises(ValidationError):
            webhooks.WebhookEndpointCreate.model_validate(bad)


def test_backoff_doubles_to_its_cap_with_jitter() -> None:
    s = STRICT.model_copy(update={"webhook_retry_base_s": 5.0, "webhook_retry_max_s": 60.0})
    for attempt, nominal in ((1, 5.0), (2, 10.0), (3, 20.0), (4, 40.0), (5, 60.0), (12, 60.0)):
        waits = [backoff_s(attempt, s) for _ in range(50)]
        assert all(0.8 * nominal <= w <= 1.2 * nominal for w in waits), (attempt, waits)
    # The default schedule: about 21 hours from the first failure to the last attempt.
    total = sum(
        min(STRICT.webhook_retry_max_s, STRICT.webhook_retry_base_s * 2 ** (n - 1))
        for n in range(1, STRICT.webhook_max_attempts)
    )
    assert 18 * 3600 < total < 24 * 3600


def test_a_name_is_blank_as_the_document_says_whitespace() -> None:
    """The document's pattern is ECMA-262's: U+0085 is not whitespace there, so a name of
    it is taken (Python's `\\S` had refused it: the fuzz found a conforming body refused),
    and kept whole; a name of ECMA whitespace alone is refused."""
    from tierq.services.requests import strip_blank
    from tierq.services.webhooks import WebhookEndpointCreate

    made = WebhookEndpointCreate(
        name="\u0085", url="https://8.8.8.8/hook", event_types=["batch.completed"]
    )
    assert strip_blank(f" {made.name}\u3000") == "\u0085"
    with pytest.raises(ValueError):
        WebhookEndpointCreate(
            name=" \u3000\ufeff", url="https://8.8.8.8/hook", event_types=["batch.completed"]
        )
