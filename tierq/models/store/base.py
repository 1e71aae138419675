"""The job store's interface and the values it takes and gives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Protocol

from tierq.core.messages import FAULT_UNIT
from tierq.core.states import JobStatus
from tierq.models.admission import Admission, Answer
from tierq.models.jobs import NewJob
from tierq.models.records import JobHead, JobRecord, Progress, Result


@dataclass(frozen=True)
class Usage:
    """A job's row of the ledger: its tokens at the prices it was admitted under."""

    job_id: str
    tenant_id: str
    prompt_tokens: int
    completion_tokens: int
    cost: Decimal


class JobStore(Protocol):
    """Where a job's state lives. Every change is conditional on the state it leaves (and,
    given `delivery`, on that being the job's latest delivery), so two parties racing on
    one job — a worker finishing it while its tenant cancels it, a job delivered twice —
    cannot both win: the loser gets None and stands down."""

    async def admit(self, request: Admission, *, counted: bool) -> Answer:
        """Admit a job by the whole rule, in one step that writes nothing unless it admits:
        a replay of the request's Idempotency-Key is answered with the job the key made (no
        quota is charged twice); then, as of now and not as of authentication, the tenant's
        status and the request's key's; a tenant with quotas for the tier is answered
        `count_first` unless the reservation was `counted` by the served model's tokenizer;
        the default bound on its waiting jobs; the price in force; every quota that
        applies (`models.quotas.decide`, on the figures `models.quotas.figures` names),
        checked one admission of the tenant at a time (across processes, on PostgreSQL and
        an SQLite file). The answer carries the job, or what
        refused it (the caller words the refusal: tierq/services/admission.py)."""
        ...

    async def create(self, new: NewJob) -> tuple[JobRecord, bool]:
        """Insert a queued job, unchecked (`admit` is the checked way in); with an
        Idempotency-Key already used, that job instead (`IdempotencyConflict` for another
        request body). Returns (job, created)."""
        ...

    async def get(self, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
        """The job (of that tenant, given one)."""
        ...

    async def head(self, job_id: str, tenant_id: str) -> JobHead | None:
        """The tenant's job's id and status, without its request or result: what every
        stream's connect reads, in one round trip where the backend can."""
        ...

    async def statuses(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        """The status of each of these jobs that exists."""
        ...

    async def unfinished(
        self, older_than: datetime, limit: int = 1000, after: tuple[datetime, str] | None = None
    ) -> list[JobRecord]:
        """Queued or running jobs created before `older_than`, oldest first, one page after
        `after` (the (created_at, id) of the previous page's last): the reconciler's."""
        ...

    async def claim(
        self,
        job_id: str,
        worker_id: str,
        max_deliveries: int,
        unsettled_charge: int = FAULT_UNIT,
    ) -> JobRecord | None:
        """queued -> running, or running -> running on a redelivery, its delivery counted.

        A job found running was not settled by its last delivery's worker: that delivery
        is charged `unsettled_charge` (thousandths of a failed delivery; whoever put the
        entry back knows how many jobs shared the fault). The job to run, or None when it
        must not run: finished, cancelled, unknown, claimed by someone else meanwhile, or
        failed here ("dead-lettered", `max_deliveries_exceeded`) because its charge
        reached `max_deliveries` failed deliveries."""
        ...

    async def finish(
        self, job_id: str, result: Result, delivery: int | None = None
    ) -> JobRecord | None:
        """running -> succeeded with its result, and its ledger row when it has usage,
        exactly once."""
        ...

    async def fail(
        self,
        job_id: str,
        code: str,
        message: str,
        *,
        delivery: int | None = None,
        from_queued: bool = False,
    ) -> JobRecord | None:
        """running (or, `from_queued`, queued) -> failed with an error."""
        ...

    async def requeue(
        self,
        job_id: str,
        detail: str,
        delivery: int | None = None,
        *,
        preempted: bool = False,
        progress: Progress | None = None,
        charge: int = 0,
    ) -> JobRecord | None:
        """running -> queued: a worker hands the job back (a drain, a preemption, an engine
        error, a dead engine), or it was found orphaned. `charge` is what this delivery is
        held against the job, in thousandths of a failed one. `progress`, what the runs so
        far generated, replaces the kept one (the next delivery resumes after it); without
        it the kept one stays."""
        ...

    async def cancel(self, job_id: str, tenant_id: str | None = None) -> JobRecord | None:
        """queued or running -> cancelled (the job of that tenant, given one); None when it
        was neither. A queued job with kept progress is billed for it here (no run will
        bill it now); a running job's run bills what it computed (`bill_cancelled`)."""
        ...

    async def cancel_all(self, tenant_id: str, code: str, message: str) -> list[JobRecord]:
        """Every queued or running job of the tenant -> cancelled with `code` and `message`
        (its suspension, its deletion), as `cancel` does each: kept progress billed, a
        running job's run left to bill what it computed. The jobs cancelled."""
        ...

    async def bill_cancelled(
        self, job_id: str, prompt_tokens: int, completion_tokens: int
    ) -> JobRecord | None:
        """A cancelled job billed for what the engine did before it stopped, once: None when
        it is not cancelled, or was billed already."""
        ...

    async def usage(self, job_id: str) -> list[Usage]:
        """The job's ledger rows: none, or the one it was billed."""
        ...

    async def transitions(self, job_id: str) -> list[tuple[str, str | None]]:
        """The job's history: (status, detail), oldest first."""
        ...

    async def close(self) -> None:
        """Let go of the store's own connections."""
        ...
