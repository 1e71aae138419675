"""States: of a job, with the transitions allowed between them (mirrored by the `jobs.status`
column); of a batch (OpenAI's vocabulary, `batches.status`); of a tenant (`tenants.status`)."""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"  # accepted, written to Postgres, waiting in its tier's stream
    RUNNING = "running"  # a worker's engine is generating it
    SUCCEEDED = "succeeded"  # finished; result and usage stored
    FAILED = "failed"  # finished with an error (bad request for the engine, or dead-lettered)
    CANCELLED = "cancelled"  # cancelled by its tenant before it finished


TERMINAL: frozenset[JobStatus] = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}
)

_ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.CANCELLED, JobStatus.FAILED}),
    # running -> queued: handed back (drain, or a worker found dead by the reconciler)
    JobStatus.RUNNING: frozenset(
        {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.QUEUED}
    ),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


def can_transition(src: JobStatus, dst: JobStatus) -> bool:
    return dst in _ALLOWED[src]


def sources_for(dst: JobStatus) -> tuple[JobStatus, ...]:
    """Every state from which `dst` may be entered (used in conditional UPDATEs)."""
    return tuple(src for src, dsts in _ALLOWED.items() if dst in dsts)


class BatchStatus(StrEnum):
    VALIDATING = "validating"  # its input file is being checked, then expanded into jobs
    FAILED = "failed"  # its input file was refused as a whole
    IN_PROGRESS = "in_progress"  # its jobs are being admitted, queued and run
    FINALIZING = "finalizing"  # every job ended: its output and error files are written
    COMPLETED = "completed"  # its output and error files are ready
    EXPIRED = "expired"  # its completion window ended first; what finished is kept
    CANCELLING = "cancelling"  # cancelled: its unfinished jobs are being stopped
    CANCELLED = "cancelled"  # cancelled, and what finished before is written


class TenantStatus(StrEnum):
    ACTIVE = "active"  # its keys work
    SUSPENDED = "suspended"  # its keys are refused and its work was cancelled; it may resume
    DELETED = "deleted"  # gone from every listing; its ledger and invoices stay
