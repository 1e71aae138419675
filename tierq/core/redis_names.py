"""Every Redis stream, key, group and channel name, in one place.

Nothing else in the code base spells a Redis name out. Per-job keys carry the job id
in a hash tag so that a job's replay buffer and channel land on one Redis Cluster slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierq.core.tiers import Tier

DISPATCH_GROUP = "dispatchers"  # consumer group on every tier stream
WORKER_GROUP = "worker"  # consumer group on every worker inbox


@dataclass(frozen=True)
class RedisNames:
    prefix: str = "tierq"

    def tier_stream(self, tier: Tier | str, tenant_id: str) -> str:
        """A tier's queue is sharded per tenant, so fairness can look past a long backlog."""
        return f"{self.prefix}:stream:{Tier(tier).value}:{tenant_id}"

    def preempted_stream(self, tier: Tier | str) -> str:
        """Jobs aborted to make room for interactive work: served first within their tier."""
        return f"{self.prefix}:preempted:{Tier(tier).value}"

    def source_tier(self, stream: str) -> Tier:
        """The tier of a tenant's shard or of a head-of-tier stream, from its name."""
        for kind in ("stream", "preempted"):
            head = f"{self.prefix}:{kind}:"
            if stream.startswith(head):
                return Tier(stream[len(head) :].split(":", 1)[0])
        raise ValueError(f"not a source stream: {stream}")

    @property
    def arrivals(self) -> str:
        """Counter of jobs admitted into the tier streams (not re-queued ones): the
        autoscaling signal's arrival rate."""
        return f"{self.prefix}:arrivals"

    def tier_tenants(self, tier: Tier | str) -> str:
        """Set of tenant ids that have a stream in this tier."""
        return f"{self.prefix}:tenants:{Tier(tier).value}"

    def preempt_channel(self, worker_id: str) -> str:
        return f"{self.prefix}:preempt:{worker_id}"

    @property
    def served(self) -> str:
        """Stream of Served reports from workers to the dispatcher."""
        return f"{self.prefix}:served"

    def inbox(self, worker_id: str) -> str:
        """A worker's jobs: an entry lives from hand-off until the worker lets the job go,
        so the stream's length is the worker's load (running or not yet read)."""
        return f"{self.prefix}:inbox:{worker_id}"

    @property
    def workers(self) -> str:
        """Hash worker_id -> JSON heartbeat (capacity, running, timestamp)."""
        return f"{self.prefix}:workers"

    @property
    def dispatch_wake(self) -> str:
        """List pushed to whenever the dispatcher may have something new to do."""
        return f"{self.prefix}:dispatch:wake"

    @property
    def dispatch_ready(self) -> str:
        """Set of source streams given entries since the leading dispatcher last took it:
        the shards a read round reads, so that a round costs what arrived, not every
        tenant that ever queued work (tierq/dispatcher/loop.py)."""
        return f"{self.prefix}:dispatch:ready"

    @property
    def dispatch_leader(self) -> str:
        """String "<epoch>:<holder>": the dispatchers' lease (tierq/dispatcher/leadership.py),
        expiring after DISPATCH_LEASE_S unless its holder renews it."""
        return f"{self.prefix}:dispatch:leader"

    @property
    def dispatch_epoch(self) -> str:
        """Counter: one more each time a dispatcher takes the lease (its fencing token)."""
        return f"{self.prefix}:dispatch:epoch"

    @property
    def dispatch_state(self) -> str:
        """JSON of the leading dispatcher's policy accounting (served tokens per tier and
        tenant), for the next leader to carry on from."""
        return f"{self.prefix}:dispatch:state"

    @property
    def inflight(self) -> str:
        """Set of job ids that some stream or inbox holds (the reconciler's view of Redis)."""
        return f"{self.prefix}:inflight"

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancel"

    def job_events(self, job_id: str) -> str:
        """List of a job's stream events (the replay buffer); index + 1 is the event id."""
        return f"{self.prefix}:job:{{{job_id}}}:events"

    def job_event_bytes(self, job_id: str) -> str:
        """Bytes of deltas written to a job's replay buffer (its bound is checked on it)."""
        return f"{self.prefix}:job:{{{job_id}}}:events:bytes"

    def job_channel(self, job_id: str) -> str:
        return f"{self.prefix}:job:{{{job_id}}}:live"

    def job_delivery(self, job_id: str) -> str:
        """The newest delivery (attempt) of a job that runs: its events fence older ones."""
        return f"{self.prefix}:job:{{{job_id}}}:delivery"

    def trace_context(self, owner_id: str) -> str:
        """The W3C traceparent of a job's or a batch's trace (tierq/core/tracing.py): where an
        SSE follower's span and a batch's lines find the trace they belong to."""
        return f"{self.prefix}:trace:{{{owner_id}}}"

    def job_orphan(self, job_id: str) -> str:
        """When the reconciler first saw a running job that nothing in Redis holds."""
        return f"{self.prefix}:job:{{{job_id}}}:orphan"

    @property
    def reconcile_lock(self) -> str:
        """Held by the Celery worker running the reconciler: two runs never overlap."""
        return f"{self.prefix}:reconcile:lock"

    def model_tokenizer(self, model: str) -> str:
        """A served model's tokenizer files (a hash: file name -> its text), published by
        a worker that has the model's folder for the hosts that do not (tierq.core.fleet)."""
        return f"{self.prefix}:model:{model}:tokenizer"

    @property
    def beat_lease(self) -> str:
        """Held by the one Celery beat of the deployment that sends the periodic tasks."""
        return f"{self.prefix}:beat:lease"

    @property
    def reconcile_queue(self) -> str:
        """The reconciler's own Celery queue: batch work can never starve it."""
        return f"{self.prefix}-celery-reconcile"

    @property
    def celery_queue(self) -> str:
        """The Celery queue (a Redis list) that this deployment's Celery workers consume."""
        return f"{self.prefix}-celery"

    def batch_poke(self, batch_id: str) -> str:
        """Set while an advance of the batch is requested and not yet started (debounce)."""
        return f"{self.prefix}:batch:{batch_id}:poke"

    @property
    def webhook_lock(self) -> str:
        """Held by the Celery process sending webhook deliveries (one pass at a time)."""
        return f"{self.prefix}:webhooks:lock"

    def batch_lock(self, batch_id: str) -> str:
        """Held by the Celery worker advancing the batch."""
        return f"{self.prefix}:batch:{batch_id}:lock"

    def tenant_streams(self, tenant_id: str) -> str:
        """Sorted set of the tenant's open streams and online requests (every API process):
        member a stream's id, score the end of its lease (Redis time, seconds)."""
        return f"{self.prefix}:tenant:{tenant_id}:streams"

    def tenant_uploads(self, tenant_id: str) -> str:
        """Sorted set of the tenant's uploads in progress (every API process): member an
        upload's id, score the end of its lease (Redis time, seconds). Hash-tagged with the
        two keys below: one script reads all three."""
        return f"{self.prefix}:tenant:{{{tenant_id}}}:uploads"

    def tenant_upload_bytes(self, tenant_id: str) -> str:
        """Hash upload id -> the bytes that upload may hold on disk (its reservation)."""
        return f"{self.prefix}:tenant:{{{tenant_id}}}:uploads:bytes"

    def tenant_uploads_ended(self, tenant_id: str) -> str:
        """Counter: one more each time one of the tenant's uploads ends (its file row, if
        any, committed first): a storage figure read before it changed is stale."""
        return f"{self.prefix}:tenant:{{{tenant_id}}}:uploads:ended"

    @property
    def access_channel(self) -> str:
        """Published when a tenant is suspended or deleted ("tenant:<id>") or a key revoked
        ("key:<id>"): every API process closes the streams that depend on it."""
        return f"{self.prefix}:access"

    def latency_samples(self, kind: str, tier: Tier | str) -> str:
        """List of a tier's latest latency samples in seconds, newest first (`kind`: "wait",
        admission to the start of generation, or "ttft", admission to the first text), as
        workers measured them; capped (tierq.core.queue.LATENCY_SAMPLES_KEPT). The operator
        console's percentiles (tierq/services/overview.py)."""
        return f"{self.prefix}:samples:{kind}:{Tier(tier).value}"

    @property
    def tenant_policy(self) -> str:
        """Hash tenant id -> JSON {"weight", "max_running": {scope: n}} for the dispatcher
        (written by the admin API on every change, re-synced from the database by Celery)."""
        return f"{self.prefix}:tenant-policy"
