"""Prometheus metrics, named once; each process exports those it touches."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

JOBS_SUBMITTED = Counter("tierq_jobs_submitted_total", "Jobs admitted", ["tier"])
JOBS_REFUSED = Counter("tierq_jobs_refused_total", "Job submissions refused", ["code"])
JOBS_FINISHED = Counter(
    "tierq_jobs_finished_total", "Jobs finished by a worker", ["tier", "status"]
)
TOKENS_SERVED = Counter("tierq_tokens_served_total", "Tokens served", ["tier", "kind"])
JOBS_DISPATCHED = Counter("tierq_jobs_dispatched_total", "Jobs handed to workers", ["tier"])
JOBS_RECLAIMED = Counter("tierq_jobs_reclaimed_total", "Jobs taken back from dead workers")
JOBS_REENQUEUED = Counter("tierq_jobs_reenqueued_total", "Jobs re-enqueued by the reconciler")
WORKER_RUNNING = Gauge("tierq_worker_running_jobs", "Jobs running in this worker's engine")
QUEUE_WAIT = Histogram(
    "tierq_queue_wait_seconds",
    "From admission to the start of generation",
    ["tier"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
)
TTFT = Histogram(
    "tierq_time_to_first_token_seconds",
    "From admission to the first generated text",
    ["tier"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
DISPATCH_DECISION = Histogram(
    "tierq_dispatch_decision_seconds",
    "Time the scheduling policy takes for one decision",
    buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2),
)
BATCHES = Counter("tierq_batches_total", "Batches that entered a status", ["status"])
FILES_UPLOADED_BYTES = Counter("tierq_files_uploaded_bytes_total", "Bytes uploaded to /v1/files")
TENANT_ADMITTED = Counter(
    "tierq_tenant_jobs_admitted_total", "Jobs admitted, per tenant and tier", ["tenant", "tier"]
)
TENANT_REFUSED = Counter(
    "tierq_tenant_jobs_refused_total",
    "Submissions refused, per tenant, tier and code",
    ["tenant", "tier", "code"],
)
TENANT_TOKENS_SERVED = Counter(
    "tierq_tenant_tokens_served_total",
    "Tokens served, per tenant, tier and kind (prompt or completion)",
    ["tenant", "tier", "kind"],
)
