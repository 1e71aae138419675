"""The OpenAPI document describes every JSON answer with a model of its own (tierq/api/schemas.py
and each feature's): a route added without one fails here, and the schema fuzz
(tests/integration/test_openapi_fuzz.py) checks real answers against these models."""

from __future__ import annotations

from typing import Any

from tierq.api.app import build_app

# Answers that are not a JSON object of the API's: Prometheus text, a file's bytes, the
# liveness and readiness probes' free-form checks, an event stream's empty 204.
NOT_MODELLED = {
    ("get", "/metrics"),
    ("get", "/admin/metrics"),
    ("get", "/v1/files/{file_id}/content"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/v1/jobs/{job_id}/events"),
    ("get", "/admin/invoices"),
    ("get", "/admin/invoices.csv"),
}


def _schema(doc: dict[str, Any], response: dict[str, Any]) -> dict[str, Any] | None:
    schema = response.get("content", {}).get("application/json", {}).get("schema")
    if schema is None:
        return None
    ref = schema.get("$ref", "")
    return doc["components"]["schemas"].get(ref.rsplit("/", 1)[-1]) if ref else schema


def test_every_json_answer_has_a_model_with_named_fields() -> None:
    doc = build_app().openapi()
    unmodelled = []
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            if (method, path) in NOT_MODELLED:
                continue
            for status, response in operation["responses"].items():
                if not status.startswith("2"):
                    continue
                schema = _schema(doc, response)
                if schema is None or not schema.get("properties") or not schema.get("required"):
                    unmodelled.append(f"{method.upper()} {path} {status}")
    assert unmodelled == []


def test_a_completion_is_documented_as_json_and_as_an_event_stream() -> None:
    doc = build_app().openapi()
    for path, model in (
        ("/v1/chat/completions", "ChatCompletion"),
        ("/v1/completions", "TextCompletion"),
    ):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"]["$ref"].endswith(f"/{model}")
        assert "text/event-stream" in content
