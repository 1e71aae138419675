"""The message codec: what travels in tier streams, worker inboxes and job event channels."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tierq.tiers import Tier


@dataclass(frozen=True)
class JobMessage:
    """A job as the dispatcher and the worker see it; built from the job row."""

    job_id: str
    tenant_id: str
    tier: Tier
    model: str
    messages: list[dict[str, Any]] | None
    prompt: str | None
    params: dict[str, Any] = field(default_factory=dict)  # max_tokens, temperature, ...
    enqueued_at: float = 0.0

    def encode(self) -> dict[str, str]:
        body = asdict(self)
        body["tier"] = self.tier.value
        return {"job": json.dumps(body, separators=(",", ":"))}

    @classmethod
    def decode(cls, fields: dict[Any, Any]) -> JobMessage:
        raw = fields.get("job", fields.get(b"job"))
        if raw is None:
            raise ValueError("stream entry carries no 'job' field")
        body = json.loads(raw)
        body["tier"] = Tier(body["tier"])
        return cls(**body)


@dataclass(frozen=True)
class JobEvent:
    """One event in a job's stream: a text delta, or the terminal `done` / `error`."""

    kind: str  # "delta" | "done" | "error"
    data: dict[str, Any]

    def encode(self) -> str:
        return json.dumps({"kind": self.kind, "data": self.data}, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> JobEvent:
        body = json.loads(raw)
        return cls(kind=body["kind"], data=body["data"])


@dataclass(frozen=True)
class Heartbeat:
    """A worker's advertisement: alive, and how many jobs its engine may hold at once."""

    worker_id: str
    capacity: int
    running: int
    ts: float
    draining: bool = False

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> Heartbeat:
        return cls(**json.loads(raw))
