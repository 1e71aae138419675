"""The message codec: what travels in tier streams, worker inboxes and job event channels."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tierq.core.tiers import Tier

# One failed delivery, in the thousandths `jobs.fault_charge` counts: a job is dead-lettered
# once it was charged MAX_DELIVERIES of them.
FAULT_UNIT = 1000


def fault_share(jobs: int) -> int:
    """Each job's charge for one fault that `jobs` jobs ran into together (a dead engine, a
    vanished worker): any of them may have caused it, so each carries its share, rounded up.
    A job that crashes every engine it runs in is charged in each of those crashes, and runs
    alone (a whole delivery a crash) once the jobs beside it have finished; a job that only
    ran beside it is charged for the crashes they shared, a fraction each."""
    return -(-FAULT_UNIT // max(1, jobs))


@dataclass(frozen=True)
class JobMessage:
    """A job as a stream entry carries it: its id and what the dispatcher routes by. The
    request itself (messages, prompt, parameters: up to MAX_PROMPT_CHARS) stays in the
    database, and the worker's claim of the job reads it in the same round trip — so an
    entry is a couple of hundred bytes, whatever the prompt."""

    job_id: str
    tenant_id: str
    tier: Tier
    enqueued_at: float = 0.0
    cost: int = 1  # estimated tokens (prompt + max_tokens), what the scheduler charges
    preemptions: int = 0  # times it was aborted to make room for interactive work
    batch_id: str | None = None  # the batch it belongs to: its end advances the batch
    prefix: str | None = None  # prefix_key of its prompt: where its cache may already be
    # The job's trace context, a W3C traceparent (tierq/core/tracing.py): the dispatcher's and
    # the worker's spans join the trace the API started. None: untraced (written only
    # when tracing is on; entries of older versions have no such field).
    trace: str | None = None
    # What the job's previous delivery is charged should the claim find it unfinished
    # (running: its worker vanished without settling it), in thousandths of a failed
    # delivery: whoever puts such an entry back knows how many jobs shared the fault.
    unsettled_charge: int = FAULT_UNIT

    def encode(self) -> dict[str, str]:
        # Field by field: dataclasses.asdict deep-copies, and every admission encodes one.
        body: dict[str, Any] = {
            "job_id": self.job_id,
            "tenant_id": self.tenant_id,
            "tier": self.tier.value,
            "enqueued_at": self.enqueued_at,
            "cost": self.cost,
            "preemptions": self.preemptions,
            "batch_id": self.batch_id,
            "prefix": self.prefix,
        }
        if self.trace is not None:  # an untraced entry stays as it was
            body["trace"] = self.trace
        if self.unsettled_charge != FAULT_UNIT:
            body["unsettled_charge"] = self.unsettled_charge
        return {"job": json.dumps(body, separators=(",", ":"))}

    @classmethod
    def decode(cls, fields: dict[Any, Any]) -> JobMessage:
        raw = fields.get("job", fields.get(b"job"))
        if raw is None:
            raise ValueError("stream entry carries no 'job' field")
        body = json.loads(raw)
        body["tier"] = Tier(body["tier"])
        # Entries written by an older version carried the request too: ignored.
        return cls(**{k: v for k, v in body.items() if k in _MESSAGE_FIELDS})


_MESSAGE_FIELDS = frozenset(f.name for f in fields(JobMessage))


PREFIX_CHARS = 1024  # the start of a prompt that placement keys on (a system prompt's worth)


def prefix_key(
    messages: list[dict[str, Any]] | None, prompt: str | None, scope: str | None = None
) -> str:
    """A digest of the first PREFIX_CHARS of a job's input (roles and contents in order)
    within `scope` (its tenant): jobs that share it — a tenant's system prompt, the turns
    of one conversation, the lines of a batch with a common preamble — share the engine's
    prefix cache where they run on one engine (tierq/dispatcher/policy.py places them so). The
    cache is salted per tenant, so the same text of two tenants is two keys."""
    if prompt is not None:
        text = prompt[:PREFIX_CHARS]
    else:
        parts: list[str] = []
        size = 0
        for m in messages or []:
            part = f"{m.get('role', '')}\x1f{m.get('content', '')}\x1e"
            parts.append(part[: PREFIX_CHARS - size])
            size += len(parts[-1])
            if size >= PREFIX_CHARS:
                break
        text = "".join(parts)
    if scope is not None:
        text = f"{scope}\x1d{text}"
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def output_bound(params: dict[str, Any]) -> int:
    """The most tokens a job can generate: `max_tokens` for each of its `n` choices. What
    it reserves, is charged by the scheduler and may be billed for, besides its prompt."""
    return int(params.get("max_tokens", 0)) * int(params.get("n", 1) or 1)


def estimate_tokens(
    messages: list[dict[str, Any]] | None, prompt: str | None, max_tokens: int
) -> int:
    """A tokenizer-free estimate of a job's cost: about four characters a prompt token."""
    if prompt is not None:
        chars = len(prompt)
    else:
        chars = sum(len(str(m.get("content", ""))) + 8 for m in messages or [])
    return max(1, chars // 4) + max_tokens


@dataclass(frozen=True)
class Served:
    """What a worker reports when a job leaves its engine: the scheduler's correction."""

    job_id: str
    tenant_id: str
    tier: Tier
    estimated: int
    actual: int  # prompt + generated tokens actually served (0 if it never ran)
    outcome: str  # succeeded | failed | cancelled | preempted | handed_back | skipped | abandoned

    def encode(self) -> dict[str, str]:
        body = asdict(self)
        body["tier"] = self.tier.value
        return {"served": json.dumps(body, separators=(",", ":"))}

    @classmethod
    def decode(cls, fields: dict[Any, Any]) -> Served:
        body = json.loads(fields["served"])
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
    """A worker's advertisement: alive, and how many jobs its engine may hold at once.

    `ts` is Redis' clock when it was written (liveness never compares two hosts' clocks);
    `jobs` are the ids it is running, so the reconciler can tell a job a live worker holds
    from one that Redis lost."""

    worker_id: str
    capacity: int
    running: int
    ts: float
    draining: bool = False
    reserve: int = 0  # slots kept for the interactive tier
    jobs: list[str] = field(default_factory=list)
    engine_ok: bool = True  # False: its engine died; it is handing its jobs back
    # True: its engine preempts for priority itself; the dispatcher never aborts its jobs
    # for interactive work (`reserve` then counts the interactive jobs beyond its slots).
    engine_preempts: bool = False
    # The process writing it ("<host>:<pid>:<boot.pid namespace>:<nonce>",
    # workers.identity): a worker starting under a live id tells its own dead
    # predecessor on this host from another live holder.
    holder: str = ""
    # What it serves, as its engine was built: the fleet's view that admission on every
    # host validates against (tierq.core.fleet), whatever that host's own settings say.
    model: str = ""
    max_model_len: int = 0

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> Heartbeat:
        # Fields a newer version adds are left out: an older reader keeps working.
        given = json.loads(raw)
        return cls(**{k: v for k, v in given.items() if k in _HEARTBEAT_FIELDS})


_HEARTBEAT_FIELDS = frozenset(f.name for f in fields(Heartbeat))
