"""The one place configuration is read: environment variables (prefix-free) and `.env`."""

from __future__ import annotations

import os
from decimal import Decimal
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tierq.file_store import S3Location
from tierq.redis_url import SentinelTarget

STATE_DIR_DEFAULT = Path(".tierq")
# Values people leave in example configs; refused as ADMIN_API_KEY outside the embedded default.
ADMIN_KEY_PLACEHOLDERS = frozenset(
    {"changeme", "change-me", "change_me", "admin", "secret", "password", "placeholder", "xxx"}
)


# The bundled model's folder under MODEL_CACHE_DIR/models.
BUNDLED_MODEL_FOLDER = "SmolLM2-135M-Instruct"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", extra="ignore")

    # --- where things live -------------------------------------------------------------
    # None means the embedded default: a SQLite file / an embedded Redis under state_dir.
    database_url: str | None = None
    # redis://, rediss://, unix://, or Redis under Sentinel:
    # redis+sentinel://[:password@]host:port[,host:port...]/<primary name>[/<db>]
    redis_url: str | None = None
    state_dir: Path = STATE_DIR_DEFAULT
    model_cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "tierq")
    # Redis key prefix; lets several deployments (or test runs) share one Redis.
    redis_prefix: str = "tierq"

    # --- API ----------------------------------------------------------------------------
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # How long an idle keep-alive connection stays open. Longer than the idle timeout of
    # the clients and load balancers in front (httpx 5 s, most balancers 60 s), so that
    # they, not the server, close an idle connection: a server that closes first races a
    # client reusing it ("Server disconnected without sending a response").
    api_keepalive_s: float = Field(default=75.0, gt=0)
    # Each process's PostgreSQL connections (an API process, a worker, each Celery
    # process): db_pool_size + db_max_overflow for sessions, and as many as db_pool_size
    # again for the hot path's single statements. A request that finds no free connection
    # for db_pool_timeout_s is answered 503 with Retry-After.
    db_pool_size: int = Field(default=10, ge=1)
    db_max_overflow: int = Field(default=20, ge=0)
    db_pool_timeout_s: float = Field(default=30.0, gt=0)
    # DATABASE_URL reaches PostgreSQL through a pooler in transaction mode (PgBouncer's
    # pool_mode = transaction): no statement is prepared under a name another transaction
    # could meet (models/db.py).
    database_transaction_pooling: bool = False
    # Admissions of one tenant that may run at once in one API process (the rest wait
    # without a database connection): one tenant's burst, serialised on its row lock,
    # cannot take every pooled connection from the other tenants.
    admission_concurrency_per_tenant: int = Field(default=4, ge=1)
    # How long an API process remembers who owns a key (0: look it up every request). A
    # revocation, suspension or change reaches every process at once on the access
    # channel; this bounds it if that message is lost. Admission always reads both again.
    auth_cache_ttl_s: float = Field(default=5.0, ge=0)
    # Key lookups an API process runs at once (the rest wait, at most AUTH_LOOKUP_QUEUE,
    # then 503): requests with unknown keys hold no more of the database pool than this.
    auth_lookup_concurrency: int = Field(default=4, ge=1)
    auth_lookup_queue: int = Field(default=256, ge=0)
    max_body_bytes: int = 1_000_000
    # Uploads to /v1/files may be this large (streamed to disk, never held in memory).
    max_upload_bytes: int = 512 * 1024 * 1024
    # Uploaded and generated files live here; None means `<state_dir>/files`. One host's
    # disk: a deployment of several hosts sets FILES_URL instead.
    files_dir: Path | None = None
    # An S3-compatible object store for the files, shared by every host: s3://bucket or
    # s3://bucket/prefix (the bucket must exist). Its endpoint and credentials come from
    # the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
    # AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION). Unset: FILES_DIR (tierq/file_store.py).
    files_url: str | None = None
    # Per tenant: the bytes of its live files (uploads and batch outputs) and how many it
    # may hold; an upload past either is refused with 413. 0: no limit.
    file_storage_quota_bytes: int = Field(default=10 * 1024**3, ge=0)
    max_files_per_tenant: int = Field(default=10_000, ge=0)
    # Expiry of uploads that do not ask for one (OpenAI: 30 days for purpose batch) and of
    # batch output and error files; 0: never. Beat removes expired files this often.
    file_expiry_s: int = Field(default=30 * 86_400, ge=0)
    file_expiry_interval_s: float = Field(default=300.0, gt=0)
    # Uploads a tenant may have in progress at once (every API process together; one more
    # is refused with 429); 0: no limit. Their bytes on disk count against its quota.
    files_max_concurrent_uploads: int = Field(default=2, ge=0)
    # A write of a file untouched this long was left by a crash (an upload in progress
    # touches its `.part` file every few seconds; on S3, a multipart upload whose last part
    # is this old): the expiry task removes it.
    files_part_max_age_s: float = Field(default=3600.0, ge=60)
    # The longest an upload may take, from its first byte stored to its end (a 400
    # upload_too_slow past it); unset: half of FILES_PART_MAX_AGE_S, the most it may be.
    # An object store dates a multipart object from the upload's start, and the orphan
    # sweep must never take a file whose row is still being committed for one a crash left.
    files_upload_max_s: float | None = Field(default=None, ge=1)
    max_prompt_chars: int = 200_000
    # A tenant's online jobs that may wait in the queue at once when its quota sets no
    # max_queued of its own (0: no default); more are refused with 429 quota_exceeded.
    default_max_queued: int = Field(default=2000, ge=0)
    list_page_max: int = 100
    # Distinct tenants the per-tenant metrics of one process name by id; the rest are
    # counted under tenant="other", so the series stay bounded however many tenants exist.
    tenant_metrics_max: int = Field(default=100, ge=0)
    # Where the dispatcher's, a worker's and a Celery worker's metrics ports listen
    # (`--metrics-port`, CELERY_METRICS_PORT): 0.0.0.0 where Prometheus scrapes them from
    # another host or container (docker-compose.yml).
    metrics_host: str = "127.0.0.1"
    # A Celery worker serves Prometheus here (all interfaces; unset: not at all), summing
    # its pool's processes through prometheus_client's multiprocess mode: it needs
    # PROMETHEUS_MULTIPROC_DIR, an empty folder of its own, set in its environment.
    celery_metrics_port: int | None = Field(default=None, ge=1, le=65535)
    prometheus_multiproc_dir: Path | None = None
    # `tierq run` serves the metrics of the processes it starts on this port and the four
    # after it, on METRICS_HOST: the dispatcher, the worker, the worker's per-tenant series,
    # the Celery worker, the reconciler; and writes a Prometheus configuration that scrapes
    # them and the API to STATE_DIR/prometheus.yml. Unset: none (the API's /metrics only).
    run_metrics_port: int | None = Field(default=None, ge=1, le=65531)

    # --- admin and billing ------------------------------------------------------------
    # The admin API's bearer key. Unset: `tierq run` makes one (STATE_DIR/admin-api-key);
    # elsewhere the admin API is closed. A placeholder value is refused outside the
    # embedded default.
    admin_api_key: str | None = None
    # The command line's clients (`tierq batch`, `tierq bench batch`): a tenant's API key.
    # Unset: the embedded default's dev tenant's (STATE_DIR/dev-api-key).
    tierq_api_key: str | None = None
    # The platform those clients (and `tierq admin ...`) talk to, unless --url says.
    tierq_url: str = "http://127.0.0.1:8000"
    # Every process's log level (tierq/logs.py); commands that print figures use WARNING.
    log_level: str = "INFO"
    # `json`: one JSON object a line, with the job's job_id, tenant_id, tier and trace_id
    # wherever they are known (tierq/logs.py); `text`: plain lines.
    log_format: Literal["text", "json"] = "text"
    # Set by `tierq run` for the processes it starts on the embedded default (they get
    # the URLs of its SQLite file and embedded Redis, and are still the embedded default).
    embedded_default: bool = False
    batch_discount: Decimal = Decimal("0.5")  # off the standard price, for the batch tier
    invoice_interval_s: float = 3600.0  # beat rolls up this and last month's invoices

    # --- engine -------------------------------------------------------------------------
    engine: Literal["vllm", "simulated"] = "vllm"
    # Path of a Hugging Face model folder; None means the bundled SmolLM2 model.
    model_path: str | None = None
    served_model_name: str = "SmolLM2-135M-Instruct"
    # Settings left unset (None) take the installed vLLM build's defaults
    # (workers/engine/vllm_args.py `build_defaults`): on the CPU build float32, eager
    # mode, a 2048-token step budget and PIN_AUX_PROCESSES; on a CUDA build vLLM's own
    # dtype ("auto"), CUDA graphs, its own step budget, and no CPU pinning.
    dtype: str | None = None
    max_model_len: int = 2048
    max_num_seqs: int = 64  # the most requests one engine runs at once (its batch slots)
    tensor_parallel_size: int = 1  # GPUs per engine (vLLM's tensor parallelism)
    gpu_memory_utilization: float = 0.9  # the share of each GPU's memory vLLM may take
    kv_cache_dtype: str = "auto"  # vLLM's KV cache dtype ("fp8" halves its memory on GPUs)
    quantization: str | None = None  # vLLM's quantization method; None: the model's own
    cpu_kvcache_space_gib: int = 2
    enforce_eager: bool | None = None
    # vLLM's per-step token budget. On a compute-bound CPU every step lasts as long as its
    # token count: a small budget (128) keeps interactive first tokens from waiting behind
    # other jobs' prefill, at a cost in throughput (docs/benchmarks.md, `bench steps`).
    max_num_batched_tokens: int | None = None
    # tierq's scheduler inside vLLM (workers/engine/vllm_scheduler.py): each step's token budget in
    # priority order, lower-tier prefill chunks deferred while better work waits for a
    # slot. False: vLLM's stock scheduler (running requests first, in admission order).
    engine_priority_steps: bool = True
    # With tierq's scheduler: a better request waiting for a slot preempts the worst running
    # one inside vLLM (it keeps its output; only its KV cache is recomputed), at most
    # engine_max_preemptions times per request. Lower tiers may then use every slot.
    engine_preemption: bool = True
    engine_max_preemptions: int = 4
    # With tierq's scheduler: while interactive work runs or waits, or arrived within
    # interactive_step_hold_s, a step takes at most this many tokens (or what the interactive
    # work needs, if more); otherwise MAX_NUM_BATCHED_TOKENS. None: 128 on the CPU build,
    # where a step lasts as long as its token count; 0 (off) on GPUs.
    interactive_step_tokens: int | None = None
    interactive_step_hold_s: float = 5.0
    # While the small step budget is on: an interactive request that arrived in the first
    # half of the step that just ended is prefilled in a step of interactive work alone
    # (the other tiers' decodes sit that step out). False: it shares its first step.
    interactive_first_step_alone: bool = True
    # vLLM's engine-core process waits for its model worker's result of each step by
    # spinning on sched_yield(); on a CPU host that spinner takes a core's worth of time from
    # the engine's compute or from the platform's own processes. True: it blocks instead
    # (workers/engine/quiet_waits.py). None: on for the CPU build, vLLM's spin on GPUs.
    engine_quiet_waits: bool | None = None
    # Failure-path tests and `tierq bench chaos` only: the fraction of requests that a
    # fault-injecting wrapper around the engine fails (workers/engine/faulty_engine.py), seeded.
    engine_fault_rate: float = 0.0
    engine_fault_seed: int = 0
    engine_fault_kinds: str = "request,validation,random,dead"

    # The CPU engine: `tierq run` keeps the API, dispatcher, Celery and the embedded Redis
    # on the core that vLLM leaves to its front end, and a worker binds itself and vLLM's
    # engine core there once its engine has started (workers/engine/cpu_placement.py), off
    # the cores vLLM bound its compute to. None: on for the CPU build, off on CUDA.
    pin_aux_processes: bool | None = None

    # --- worker -------------------------------------------------------------------------
    worker_id: str | None = None  # default: "<hostname>-<pid>"; set it to keep one inbox
    heartbeat_interval_s: float = 1.0
    worker_dead_after_s: float = 10.0
    max_deliveries: int = 3
    drain_timeout_s: float = 30.0
    # The per-job watchdog: a run whose engine stream yields nothing for this long is
    # aborted in the engine and handed back with its progress, not counted as a failed
    # delivery (a request vLLM lost track of would otherwise hold its job for ever).
    # 0 turns it off. Keep it above the longest a request may wait inside the engine
    # (a prefill of MAX_MODEL_LEN tokens, a preempted request's wait for a slot).
    job_stall_s: float = 300.0
    # How often a worker asks its engine whether it is alive; a dead engine makes the
    # worker hand its jobs back and exit non-zero (its supervisor restarts it).
    engine_health_interval_s: float = 1.0
    # How often a worker reads the status of the jobs it runs from the database: a cancel
    # (a tenant's, a suspension's, a batch's) whose notice on Redis was lost stops its run
    # within about this long, whatever Redis dropped.
    cancel_check_interval_s: float = Field(default=1.0, gt=0)
    # A worker or dispatcher that cannot reach Redis or the database retries with backoff
    # (up to this long between tries) rather than exit, keeping its generations running.
    outage_retry_max_s: float = 2.0

    # --- dispatcher and its policy (docs/reference/settings.md documents each) ------------
    dispatch_policy: Literal["tierq", "fcfs", "engine-priority"] = "tierq"
    dispatch_read_ahead: int = 32  # entries held per tenant shard of a tier
    dispatch_idle_wait_s: float = 0.2
    # Any number of dispatchers may run; one holds this lease in Redis and dispatches. A
    # leader that stops renewing it (killed, hung, cut off) is replaced within this time.
    dispatch_lease_s: float = Field(default=5.0, gt=0)
    # Cache-affine placement: jobs whose prompts start alike go to one worker (its prefix
    # cache holds that start) unless it would run this share of its slots more than the
    # least loaded worker; 0 places by free slots alone.
    affinity_slack: float = Field(default=0.25, ge=0)
    # ... and when a job's own worker is full, one of its tenant's next this many jobs
    # whose own worker has the free slot goes first (0: each tenant's order kept strictly).
    affinity_lookahead: int = Field(default=8, ge=0)
    min_share_standard: float = 0.20  # of tokens served over the window, while backlogged
    min_share_batch: float = 0.10
    share_window_s: float = 60.0
    slo_interactive_s: float = 5.0  # deadlines, from admission; urgency acts before them
    slo_standard_s: float = 300.0
    slo_batch_s: float = 86_400.0
    urgency_fraction: float = 0.8
    tenant_weights: dict[str, float] = Field(default_factory=dict)  # tenant id -> weight
    # Slots per worker that standard and batch work leave free (capped at half the slots).
    # 0: an engine that preempts for priority (ENGINE_PREEMPTION) needs none; reserved slots
    # idle while work waits.
    interactive_reserve: int = 0
    # Interactive jobs a worker takes beyond its MAX_NUM_SEQS when its engine preempts for
    # priority: each enters the engine at once and takes a lower-tier request's slot there.
    interactive_overflow: int = 16
    # Times the dispatcher may abort and re-queue one job for interactive work: only on
    # workers whose engine cannot preempt for priority itself.
    max_preemptions: int = 2

    # --- streaming ----------------------------------------------------------------------
    replay_ttl_s: int = 3600
    # Once a job's final event is written its buffer lives this much longer (the database
    # has the whole text after that), and a buffer keeps at most replay_max_bytes of
    # deltas: later ones reach live followers but are replayed as placeholders (the final
    # event still carries the whole result).
    replay_done_ttl_s: int = 300
    replay_max_bytes: int = 1_048_576
    # Open SSE streams plus online (OpenAI) requests waiting on a job, per tenant, over
    # every API process; one more is refused with 429 too_many_streams.
    max_streams_per_tenant: int = 256
    stream_lease_s: float = 30.0  # a stream an API process stops renewing is let go after
    # Connections each process's Redis client may open; more callers wait for one (for
    # redis_pool_timeout_s) instead of failing. SSE followers share one pub/sub connection
    # per API process, so this does not grow with the number of streams.
    redis_max_connections: int = 64
    redis_pool_timeout_s: float = 10.0

    # --- batches (OpenAI's Files and Batches) --------------------------------------------
    batch_max_requests: int = 50_000  # lines per input file
    batch_max_bytes: int = 200 * 1024 * 1024  # bytes per input file
    # Jobs of one batch queued or running at once: the expansion tops up to this, so a
    # 50,000-line file never floods Redis; enough to keep every worker's slots busy.
    batch_max_outstanding: int = 512
    batch_window_s: float = 86_400.0  # what completion_window "24h" means
    batch_tick_s: float = 2.0  # Celery beat re-drives every active batch this often
    # The lease a Celery worker holds on a batch it advances (renewed every third of it):
    # a worker killed mid-step holds its batch up this long at most.
    batch_lease_s: float = Field(default=15.0, gt=0)
    batch_error_limit: int = 1000  # validation errors reported per batch, at most
    # Batches a tenant may have unfinished at once (validating, in progress, finalizing or
    # cancelling); one more is refused with 429 too_many_batches.
    max_batches_per_tenant: int = 10

    # --- webhooks (OpenAI's batch events, signed as Standard Webhooks) ------------------
    # Whether tenants register their own endpoints (`/v1/webhook_endpoints`); when false
    # only the operator does (`/admin/tenants/{id}/webhook_endpoints`), and a tenant reads.
    webhook_tenant_endpoints: bool = True
    webhook_max_endpoints: int = Field(default=10, ge=0)  # per tenant
    # Outbound requests go to public addresses only: a URL whose host is (or resolves to)
    # a private, loopback, link-local or otherwise non-global address is refused, unless
    # the operator allows them (receivers inside the deployment's own network).
    webhook_allow_private: bool = False
    webhook_allow_http: bool = False  # plain http:// URLs (https only otherwise)
    webhook_timeout_s: float = Field(default=10.0, gt=0)  # one attempt, connect to answer
    # A delivery is retried with exponential backoff from base to max (plus jitter) until
    # it succeeds or this many attempts failed (about 21 hours at the defaults).
    webhook_max_attempts: int = Field(default=30, ge=1)
    webhook_retry_base_s: float = Field(default=5.0, gt=0)
    webhook_retry_max_s: float = Field(default=3600.0, gt=0)
    webhook_tick_s: float = Field(default=5.0, gt=0)  # beat sends what is due this often

    # --- Celery -------------------------------------------------------------------------
    # One Celery beat of the deployment sends the periodic tasks, holding a lease in Redis
    # this long (renewed every third of it); every other beat stands by and takes over
    # within this long of the holder's death (workers/beat.py).
    beat_lease_s: float = Field(default=15.0, ge=1.0)
    reconcile_interval_s: float = 30.0
    reconcile_grace_s: float = 10.0
    # A running job whose worker Redis no longer lists as holding it is requeued only
    # after it has been seen so for this long (a worker re-registers its running jobs
    # with every heartbeat, e.g. after a Redis flush).
    reconcile_orphan_grace_s: float = 5.0

    @field_validator("database_url", "redis_url", "files_url", mode="before")
    @classmethod
    def _blank_is_none(cls, v: object) -> object:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, v: str | None) -> str | None:
        """Accept the URLs operators paste (postgres://, postgresql://) and pick async drivers."""
        if v is None:
            return v
        for plain, asyncd in (
            ("postgres://", "postgresql+asyncpg://"),
            ("postgresql://", "postgresql+asyncpg://"),
            ("sqlite:///", "sqlite+aiosqlite:///"),
        ):
            if v.startswith(plain):
                return asyncd + v[len(plain) :]
        return v

    @field_validator("redis_url")
    @classmethod
    def _sentinel_url(cls, v: str | None) -> str | None:
        if v is not None:
            SentinelTarget.parse(v)  # ValueError: a malformed redis+sentinel:// URL
        return v

    @field_validator("files_url")
    @classmethod
    def _s3_url(cls, v: str | None) -> str | None:
        if v is not None:
            S3Location.parse(v)  # ValueError: not s3://bucket[/prefix]
        return v

    @model_validator(mode="after")
    def _upload_within_sweep(self) -> Settings:
        most = self.files_part_max_age_s / 2
        if self.files_upload_max_s is not None and self.files_upload_max_s > most:
            raise ValueError("files_upload_max_s is at most half of files_part_max_age_s")
        return self

    @property
    def upload_time_limit_s(self) -> float:
        """FILES_UPLOAD_MAX_S, or half of FILES_PART_MAX_AGE_S."""
        if self.files_upload_max_s is not None:
            return self.files_upload_max_s
        return self.files_part_max_age_s / 2

    @field_validator("batch_discount")
    @classmethod
    def _fraction(cls, v: Decimal) -> Decimal:
        if not Decimal(0) <= v <= Decimal(1):
            raise ValueError("batch_discount is a fraction between 0 and 1")
        return v

    @property
    def admin_key_is_placeholder(self) -> bool:
        key = (self.admin_api_key or "").strip().lower()
        return key in ADMIN_KEY_PLACEHOLDERS or (0 < len(key) < 16)

    @property
    def embedded(self) -> bool:
        return (self.database_url is None and self.redis_url is None) or self.embedded_default

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.state_dir / 'tierq.db').resolve()}"

    @property
    def resolved_redis_url(self) -> str:
        if self.redis_url:
            return self.redis_url
        return f"unix://{self.embedded_redis_socket}"

    @property
    def embedded_redis_socket(self) -> Path:
        return (self.state_dir / "redis.sock").resolve()

    @property
    def tier_slo_s(self) -> dict[str, float]:
        """Each tier's SLO (its deadline from admission), by tier name."""
        return {
            "interactive": self.slo_interactive_s,
            "standard": self.slo_standard_s,
            "batch": self.slo_batch_s,
        }

    @property
    def tier_min_share(self) -> dict[str, float]:
        """Each tier's minimum share of served tokens while backlogged (interactive: 0)."""
        return {
            "interactive": 0.0,
            "standard": self.min_share_standard,
            "batch": self.min_share_batch,
        }

    @property
    def celery_broker_url(self) -> str:
        url = self.resolved_redis_url
        target = SentinelTarget.parse(url)
        if target is not None:
            return target.kombu_url()
        if url.startswith("unix://"):
            return "redis+socket://" + url[len("unix://") :]
        return url

    @property
    def resolved_files_dir(self) -> Path:
        return (self.files_dir or self.state_dir / "files").resolve()

    @property
    def dev_key_file(self) -> Path:
        """The embedded default's dev tenant's API key, written by `tierq run` (0600)."""
        return self.state_dir / "dev-api-key"

    @property
    def admin_key_file(self) -> Path:
        """The admin key `tierq run` makes when ADMIN_API_KEY is unset (0600)."""
        return self.state_dir / "admin-api-key"

    @property
    def bundled_model_dir(self) -> Path:
        """Where the bundled model, converted once (workers/engine/bundled_model.py), is
        cached; the tokenizer the API counts prompts with is read from there too."""
        return self.model_cache_dir / "models" / BUNDLED_MODEL_FOLDER

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{os.uname().nodename}-{os.getpid()}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
