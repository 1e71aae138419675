"""Frozen, typed records that repository functions return (never live ORM objects)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from models.tables import Job, Tenant
from tierq.messages import JobMessage, estimate_tokens
from tierq.states import JobStatus
from tierq.tiers import Tier


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; everything stored is UTC."""
    if value is None:
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def unix(value: datetime | None) -> int | None:
    v = as_utc(value)
    return None if v is None else int(v.timestamp())


@dataclass(frozen=True)
class TenantRecord:
    id: str
    name: str
    status: str
    created_at: datetime

    @classmethod
    def from_row(cls, row: Tenant) -> TenantRecord:
        return cls(row.id, row.name, row.status, as_utc(row.created_at) or row.created_at)


@dataclass(frozen=True)
class JobRecord:
    id: str
    tenant_id: str
    tier: Tier
    model: str
    status: JobStatus
    messages: list[dict[str, Any]] | None
    prompt: str | None
    params: dict[str, Any]
    metadata: dict[str, Any] | None
    request_hash: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    result_text: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    error_code: str | None
    error_message: str | None
    deliveries: int
    worker_id: str | None

    @classmethod
    def from_row(cls, row: Job) -> JobRecord:
        return cls(
            id=row.id,
            tenant_id=row.tenant_id,
            tier=Tier(row.tier),
            model=row.model,
            status=JobStatus(row.status),
            messages=row.messages,
            prompt=row.prompt,
            params=dict(row.params or {}),
            metadata=row.metadata_,
            request_hash=row.request_hash,
            created_at=as_utc(row.created_at) or row.created_at,
            started_at=as_utc(row.started_at),
            finished_at=as_utc(row.finished_at),
            result_text=row.result_text,
            finish_reason=row.finish_reason,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            error_code=row.error_code,
            error_message=row.error_message,
            deliveries=row.deliveries,
            worker_id=row.worker_id,
        )

    def to_message(self) -> JobMessage:
        return JobMessage(
            job_id=self.id,
            tenant_id=self.tenant_id,
            tier=self.tier,
            model=self.model,
            messages=self.messages,
            prompt=self.prompt,
            params=self.params,
            enqueued_at=self.created_at.timestamp(),
            cost=estimate_tokens(self.messages, self.prompt, int(self.params.get("max_tokens", 1))),
        )

    def to_api(self) -> dict[str, Any]:
        """The job object of the native API (its shape is pinned by the spine issue)."""
        usage = None
        if self.prompt_tokens is not None and self.completion_tokens is not None:
            usage = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            }
        result = None
        if self.result_text is not None:
            result = {"text": self.result_text, "finish_reason": self.finish_reason}
        error = None
        if self.error_code is not None:
            error = {"code": self.error_code, "message": self.error_message}
        return {
            "id": self.id,
            "object": "job",
            "status": self.status.value,
            "tier": self.tier.value,
            "model": self.model,
            "created_at": unix(self.created_at),
            "started_at": unix(self.started_at),
            "finished_at": unix(self.finished_at),
            "result": result,
            "usage": usage,
            "error": error,
            "metadata": self.metadata,
        }
