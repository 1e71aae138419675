"""Frozen, typed records that repository functions return (never live ORM objects)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from tierq.core.messages import JobMessage, estimate_tokens, output_bound, prefix_key
from tierq.core.states import BatchStatus, JobStatus, TenantStatus
from tierq.core.tiers import Tier
from tierq.models.tables import Batch, File, Job, Tenant


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
    status: TenantStatus
    created_at: datetime
    allowed_tiers: tuple[Tier, ...] = (Tier.INTERACTIVE, Tier.STANDARD, Tier.BATCH)
    default_tier: Tier = Tier.STANDARD
    weight: float = 1.0

    @classmethod
    def from_row(cls, row: Tenant) -> TenantRecord:
        return cls(
            row.id,
            row.name,
            TenantStatus(row.status),
            as_utc(row.created_at) or row.created_at,
            allowed_tiers=tuple(Tier(t) for t in row.allowed_tiers or ()),
            default_tier=Tier(row.default_tier),
            weight=row.weight,
        )

    def to_api(self) -> dict[str, Any]:
        """The tenant object of the admin API."""
        return {
            "id": self.id,
            "object": "tenant",
            "name": self.name,
            "status": self.status.value,
            "allowed_tiers": [t.value for t in self.allowed_tiers],
            "default_tier": self.default_tier.value,
            "weight": self.weight,
            "created_at": unix(self.created_at),
        }


@dataclass(frozen=True)
class Progress:
    """What a job's runs generated before one stopped unfinished (preempted, handed back):
    the next run continues after these tokens (tierq/workers/engine/base.py, `resume`)."""

    token_ids: tuple[int, ...]
    text: str  # their text, as streamed
    prompt_tokens: int  # the prompt's tokens, as the engine counted them
    # The engine and model whose vocabulary the ids are in: another (a model changed under
    # the same served name, another engine) does not resume after them.
    source: str = ""

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> Progress | None:
        if not raw:
            return None
        return cls(
            tuple(int(t) for t in raw["token_ids"]),
            raw["text"],
            raw["prompt_tokens"],
            raw.get("source", ""),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "token_ids": list(self.token_ids),
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "source": self.source,
        }


@dataclass(frozen=True)
class Result:
    """What a run that generated a job to its end hands the store (`finish`)."""

    text: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    logprobs: list[dict[str, Any]] | None = None  # with `logprobs`: each token's
    choices: list[dict[str, Any]] | None = None  # with n > 1: the choices after the first


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
    batch_id: str | None = None
    batch_line: int | None = None
    custom_id: str | None = None
    reserved_tokens: int = 0
    input_price: Decimal | None = None
    output_price: Decimal | None = None
    preemptions: int = 0  # deliveries that ended in a preemption (not failures)
    fault_charge: int = 0  # failed deliveries held against it, in thousandths of one
    progress: Progress | None = None  # what earlier runs generated, to resume after
    result_logprobs: list[dict[str, Any]] | None = None  # with `logprobs`: each token's
    result_choices: list[dict[str, Any]] | None = None  # with n > 1: the choices after the first

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
            batch_id=row.batch_id,
            batch_line=row.batch_line,
            custom_id=row.custom_id,
            reserved_tokens=row.reserved_tokens,
            input_price=row.input_price,
            output_price=row.output_price,
            preemptions=row.preemptions or 0,
            fault_charge=row.fault_charge or 0,
            progress=Progress.from_json(row.progress),
            result_logprobs=row.result_logprobs,
            result_choices=row.result_choices,
        )

    def choices(self) -> list[dict[str, Any]]:
        """Every choice of the result in order: {"index", "text", "finish_reason",
        "logprobs"} (one unless the job asked for n > 1)."""
        first = {
            "index": 0,
            "text": self.result_text or "",
            "finish_reason": self.finish_reason,
            "logprobs": self.result_logprobs,
        }
        return [first, *(self.result_choices or [])]

    def to_message(self) -> JobMessage:
        return JobMessage(
            job_id=self.id,
            tenant_id=self.tenant_id,
            tier=self.tier,
            enqueued_at=self.created_at.timestamp(),
            cost=estimate_tokens(self.messages, self.prompt, output_bound(self.params) or 1),
            preemptions=self.preemptions,
            batch_id=self.batch_id,
            prefix=prefix_key(self.messages, self.prompt, scope=self.tenant_id),
        )

    def to_api(self, *, logprobs: bool = True) -> dict[str, Any]:
        """The job object of the native API. `logprobs=False` leaves the log probabilities
        out (a job's final event: they can be megabytes; its deltas carried them, and the
        job itself has them)."""
        usage = None
        if self.prompt_tokens is not None and self.completion_tokens is not None:
            usage = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            }
        result: dict[str, Any] | None = None
        if self.result_text is not None:
            result = {"text": self.result_text, "finish_reason": self.finish_reason}
            if self.result_logprobs is not None and logprobs:
                result["logprobs"] = self.result_logprobs
            if self.result_choices is not None:
                result["choices"] = [
                    c if logprobs else {k: v for k, v in c.items() if k != "logprobs"}
                    for c in self.choices()
                ]
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


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant_id: str
    purpose: str
    filename: str
    bytes: int
    created_at: datetime
    expires_at: datetime | None = None

    @classmethod
    def from_row(cls, row: File) -> FileRecord:
        return cls(
            row.id,
            row.tenant_id,
            row.purpose,
            row.filename,
            row.bytes,
            as_utc(row.created_at) or row.created_at,
            as_utc(row.expires_at),
        )

    def to_api(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": unix(self.created_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": unix(self.expires_at),
        }


@dataclass(frozen=True)
class JobHead:
    """What following a job needs to know of it: not its request or its result."""

    id: str
    tenant_id: str
    status: JobStatus


@dataclass(frozen=True)
class BatchRecord:
    id: str
    tenant_id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    metadata: dict[str, Any] | None
    errors: list[dict[str, Any]] | None
    output_file_id: str | None
    error_file_id: str | None
    request_total: int
    request_completed: int
    request_failed: int
    next_line: int
    next_offset: int
    reserved_tokens: int
    reserved_cost: Decimal
    created_at: datetime
    expires_at: datetime
    in_progress_at: datetime | None
    finalizing_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None

    @classmethod
    def from_row(cls, row: Batch) -> BatchRecord:
        return cls(
            id=row.id,
            tenant_id=row.tenant_id,
            endpoint=row.endpoint,
            input_file_id=row.input_file_id,
            completion_window=row.completion_window,
            status=BatchStatus(row.status),
            metadata=row.metadata_,
            errors=row.errors,
            output_file_id=row.output_file_id,
            error_file_id=row.error_file_id,
            request_total=row.request_total,
            request_completed=row.request_completed,
            request_failed=row.request_failed,
            next_line=row.next_line,
            next_offset=row.next_offset,
            reserved_tokens=int(row.reserved_tokens or 0),
            reserved_cost=row.reserved_cost or Decimal(0),
            created_at=as_utc(row.created_at) or row.created_at,
            expires_at=as_utc(row.expires_at) or row.expires_at,
            in_progress_at=as_utc(row.in_progress_at),
            finalizing_at=as_utc(row.finalizing_at),
            completed_at=as_utc(row.completed_at),
            failed_at=as_utc(row.failed_at),
            expired_at=as_utc(row.expired_at),
            cancelling_at=as_utc(row.cancelling_at),
            cancelled_at=as_utc(row.cancelled_at),
        )

    def to_api(self, counts: tuple[int, int] | None = None) -> dict[str, Any]:
        """OpenAI's batch object; `counts` (completed, failed) are live ones while it runs."""
        completed, failed = (
            counts
            if counts is not None
            else (
                self.request_completed,
                self.request_failed,
            )
        )
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": None if not self.errors else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status.value,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": unix(self.created_at),
            "in_progress_at": unix(self.in_progress_at),
            "expires_at": unix(self.expires_at),
            "finalizing_at": unix(self.finalizing_at),
            "completed_at": unix(self.completed_at),
            "failed_at": unix(self.failed_at),
            # While it runs, a set expired_at only marks the window as passed (still winding up).
            "expired_at": unix(self.expired_at) if self.status == BatchStatus.EXPIRED else None,
            "cancelling_at": unix(self.cancelling_at),
            "cancelled_at": unix(self.cancelled_at),
            "request_counts": {
                "total": self.request_total,
                "completed": completed,
                "failed": failed,
            },
            "metadata": self.metadata,
        }
