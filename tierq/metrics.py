"""Prometheus metrics, named once; each process exports those it touches.

Two registries. The default one holds every series without a tenant label: the API's
unauthenticated `/metrics` and the `--metrics-port` of the dispatcher and worker serve it.
`TENANT_REGISTRY` holds the per-tenant series, which name tenants and their volumes: the
API serves it behind the admin key (`/admin/metrics`), a worker only on
`--tenant-metrics-port`. Its tenant label takes at most `TENANT_METRICS_MAX` values per
process (`tenant_label`), so many tenants cannot make the series unbounded.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

JOBS_SUBMITTED = Counter("tierq_jobs_submitted_total", "Jobs admitted", ["tier"])
JOBS_REFUSED = Counter("tierq_jobs_refused_total", "Job submissions refused", ["code"])
ADMISSION_STATEMENTS = Counter(
    "tierq_admission_statements_total",
    "Admission decisions by path: fast (one statement, PostgreSQL, no quota for the tier), "
    "quotas (one call of the admission function, PostgreSQL, quotas for the tier) or exact "
    "(an ORM transaction: an Idempotency-Key used before, or SQLite)",
    ["path"],
)
JOBS_FINISHED = Counter(
    "tierq_jobs_finished_total", "Jobs finished by a worker", ["tier", "status"]
)
TOKENS_SERVED = Counter("tierq_tokens_served_total", "Tokens served", ["tier", "kind"])
JOBS_DISPATCHED = Counter("tierq_jobs_dispatched_total", "Jobs handed to workers", ["tier"])
JOBS_RECLAIMED = Counter("tierq_jobs_reclaimed_total", "Jobs taken back from dead workers")
DISPATCHER_LEADER = Gauge(
    "tierq_dispatcher_leader", "1 while this dispatcher holds the lease and dispatches, else 0"
)
DESIRED_WORKERS = Gauge(
    "tierq_desired_workers",
    "Workers the waiting and running work needs (the leading dispatcher's autoscaling signal)",
    ["model"],
)
DISPATCHER_LEADERSHIPS = Counter(
    "tierq_dispatcher_leaderships_total", "Times this dispatcher took the lease (failovers)"
)
DISPATCHER_FENCED = Counter(
    "tierq_dispatcher_fenced_total",
    "Writes of this dispatcher refused because another had taken its lease",
)
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

TENANT_REGISTRY = CollectorRegistry()
# The label value shared by every tenant past the first TENANT_METRICS_MAX of a process
# (tenant ids are "ten_..." so none is spelled so).
OTHER_TENANT = "other"
TENANT_ADMITTED = Counter(
    "tierq_tenant_jobs_admitted_total",
    "Jobs admitted, per tenant and tier",
    ["tenant", "tier"],
    registry=TENANT_REGISTRY,
)
TENANT_REFUSED = Counter(
    "tierq_tenant_jobs_refused_total",
    "Submissions refused, per tenant, tier and code",
    ["tenant", "tier", "code"],
    registry=TENANT_REGISTRY,
)
TENANT_TOKENS_SERVED = Counter(
    "tierq_tenant_tokens_served_total",
    "Tokens served, per tenant, tier and kind (prompt or completion)",
    ["tenant", "tier", "kind"],
    registry=TENANT_REGISTRY,
)
_TENANT_SERIES = (TENANT_ADMITTED, TENANT_REFUSED, TENANT_TOKENS_SERVED)


class _TenantLabels:
    """The tenants this process labels by id: the first `limit` it counts, kept until the
    process ends (or `bound_tenant_labels` starts over); any other is `OTHER_TENANT`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen: set[str] = set()
        self.lock = threading.Lock()  # prometheus_client may be counted from any thread

    def __call__(self, tenant_id: str) -> str:
        if tenant_id in self.seen:
            return tenant_id
        if len(self.seen) < self.limit:
            with self.lock:
                if len(self.seen) < self.limit:
                    self.seen.add(tenant_id)
                    return tenant_id
        return OTHER_TENANT


_tenant_labels = _TenantLabels(100)  # Settings.tenant_metrics_max's default, until bound


def tenant_label(tenant_id: str) -> str:
    """The `tenant` label value of a series of TENANT_REGISTRY: every call site uses this."""
    return _tenant_labels(tenant_id)


def bound_tenant_labels(limit: int) -> None:
    """Label at most `limit` tenants by id from now on (TENANT_METRICS_MAX), starting over:
    the tenants labelled so far and their series are forgotten. A process calls it as it
    starts, before it counts anything (tests start several platforms in one process)."""
    with _tenant_labels.lock:
        _tenant_labels.limit = limit
        _tenant_labels.seen = set()
        for series in _TENANT_SERIES:
            series.clear()


def count_tokens_served(tenant_id: str, tier: str, prompt: int, completion: int) -> None:
    """Tokens a job was served (and billed): in the untenanted and the per-tenant series."""
    TOKENS_SERVED.labels(tier, "prompt").inc(prompt)
    TOKENS_SERVED.labels(tier, "completion").inc(completion)
    label = tenant_label(tenant_id)
    TENANT_TOKENS_SERVED.labels(label, tier, "prompt").inc(prompt)
    TENANT_TOKENS_SERVED.labels(label, tier, "completion").inc(completion)
