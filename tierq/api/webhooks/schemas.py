"""The webhook routes' response bodies (see tierq/api/schemas.py for how they are used):
OpenAI's webhook endpoint objects, and tierq's delivery records."""

from __future__ import annotations

from typing import Literal

from tierq.api.schemas import Body, Page


class WebhookEndpoint(Body):
    id: str
    object: Literal["webhook_endpoint"]
    name: str
    url: str
    event_types: list[str]
    signing_secret_hint: str
    created_at: int
    updated_at: int
    signing_secret: str | None = None  # when made or rotated only


class WebhookEndpointList(Page):
    data: list[WebhookEndpoint]


class WebhookEndpointDeleted(Body):
    id: str
    object: Literal["webhook_endpoint.deleted"]
    deleted: Literal[True]


class WebhookEventTypes(Body):
    object: Literal["list"]
    data: list[str]


class WebhookTestResult(Body):
    object: Literal["webhook_endpoint.test"]
    webhook_endpoint_id: str
    event_type: str
    status_code: int
    success: bool


class DeliveredObject(Body):
    id: str


class WebhookDelivery(Body):
    id: str
    object: Literal["webhook_delivery"]
    webhook_endpoint_id: str
    tenant_id: str
    event_type: str
    data: DeliveredObject
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    next_attempt_at: int | None
    last_attempt_at: int | None
    last_status_code: int | None
    last_error: str | None
    created_at: int
    delivered_at: int | None


class WebhookDeliveryList(Page):
    data: list[WebhookDelivery]
