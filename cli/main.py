"""The `tierq` command line: one entry point for every component and tool."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli.admin import admin_app
from cli.options import URL_OPTION, platform_url
from cli.top import top
from tierq.logs import setup as setup_logging
from tierq.settings import get_settings

if TYPE_CHECKING:
    from client.batches import BatchClient

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures.")
app.add_typer(bench_app, name="bench")
batch_app = typer.Typer(no_args_is_help=True, help="OpenAI-style batches of JSONL requests.")
app.add_typer(batch_app, name="batch")
app.add_typer(admin_app, name="admin")
app.command()(top)

# Where a bench keeps its result (`tierq bench --save ...`; None: printed only), and which
# bench runs.
_KEEP: dict[str, Any] = {"to": None, "bench": "bench"}


@bench_app.callback()
def _bench_options(
    ctx: typer.Context,
    save: bool = typer.Option(
        False,
        "--save",
        help="Keep each run's JSON line as a file under --results (<bench>/<date>-<commit>.json)"
        ", with the commit, the machine, the date and the engine build beside it.",
    ),
    results: Path = typer.Option(Path("benchmarks/results"), help="Where --save keeps results."),
) -> None:
    _KEEP["to"] = results if save else None
    _KEEP["bench"] = ctx.invoked_subcommand or "bench"


def _emit(result: dict[str, Any]) -> None:
    """A bench's JSON line, last on stdout; with --save also kept as a file."""
    folder = _KEEP["to"]
    if folder is not None:
        from benchmarks.results import record

        kept = record(_KEEP["bench"], result, sys.argv[1:], folder)
        typer.echo(f"kept as {kept}", err=True)
    typer.echo(json.dumps(result, separators=(",", ":")))


@app.callback()
def _diagnostics(ctx: typer.Context) -> None:
    """MEMORY_SNAPSHOTS_DIR: snapshots of every tierq process on SIGUSR2 (a diagnostic)."""
    from tierq import memory_snapshots

    memory_snapshots.install(ctx.invoked_subcommand or "tierq")


log = logging.getLogger("tierq")


KEY_OPTION = typer.Option(
    None, help="API key (default: TIERQ_API_KEY, else STATE_DIR/dev-api-key)."
)


@app.command()
def run(
    verbose: bool = typer.Option(False, help="Show every process's log in this terminal."),
) -> None:
    """Run the whole platform on this machine (embedded SQLite and Redis unless URLs are set)."""
    from launch.supervisor import run_platform

    setup_logging()
    raise typer.Exit(run_platform(get_settings(), verbose=verbose))


@app.command()
def api(
    host: str | None = typer.Option(None),
    port: int | None = typer.Option(None),
    workers: int = typer.Option(
        1, min=1, help="API processes behind the one port (one per core on a multi-core host)."
    ),
) -> None:
    """Serve the HTTP API."""
    import uvicorn

    setup_logging()
    settings = get_settings()
    if workers > 1 and settings.prometheus_multiproc_dir is None:
        # Several processes behind one port: /metrics sums them all (tierq/metrics.py),
        # from a folder that starts empty and goes with this command.
        import atexit
        import os
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="tierq-api-metrics-")
        atexit.register(shutil.rmtree, folder, True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder  # read by the processes it starts
    uvicorn.run(
        "api.app:serve_app",
        factory=True,  # each process builds its own app (and pools) from the environment
        host=host or settings.api_host,
        port=port or settings.api_port,
        workers=workers,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        # LOG_FORMAT=json: uvicorn's loggers go to the root's JSON handler (setup_logging)
        log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
        access_log=False,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=int(settings.api_keepalive_s),
    )


@app.command()
def dispatcher(metrics_port: int | None = typer.Option(None, help="Serve /metrics here.")) -> None:
    """Move jobs from the tier streams to workers with free slots."""
    from dispatcher.loop import Dispatcher
    from tierq.redis_conn import connect

    setup_logging()
    settings = get_settings()
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=settings.metrics_host)

    async def main() -> None:
        r = await connect(settings, role="dispatcher")
        d = Dispatcher(settings, r)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, d.request_stop)
        try:
            await d.run()
        finally:
            await r.aclose()

    asyncio.run(main())


@app.command()
def worker(
    engine: str | None = typer.Option(
        None, help="vllm (default) or simulated (tests, benchmarks)."
    ),
    metrics_port: int | None = typer.Option(None, help="Serve /metrics here."),
    tenant_metrics_port: int | None = typer.Option(
        None, help="Serve the per-tenant series (tokens served) here, on METRICS_HOST."
    ),
    gpus: str | None = typer.Option(
        None,
        help="One engine per group of TENSOR_PARALLEL_SIZE GPUs, each a worker of its own "
        "(id <WORKER_ID or host>-gpu<indices>; metrics ports +1 each): 'all' "
        "(CUDA_VISIBLE_DEVICES, else nvidia-smi) or a list such as 0,1,2,3.",
    ),
) -> None:
    """Host an engine and run the jobs the dispatcher sends to this worker's inbox."""
    setup_logging()
    settings = get_settings()
    if engine:
        settings = settings.model_copy(update={"engine": engine})
    if gpus is not None:
        from launch.gpu_workers import run_gpu_workers

        raise SystemExit(run_gpu_workers(settings, gpus, engine, metrics_port, tenant_metrics_port))
    from prometheus_client import start_http_server

    from tierq import metrics
    from workers.engine.factory import make_engine
    from workers.worker import Worker, run_worker

    metrics.bound_tenant_labels(settings.tenant_metrics_max)
    if metrics_port:  # the series without a tenant label only
        start_http_server(metrics_port, addr=settings.metrics_host)
    if tenant_metrics_port:  # scraped as the admin API is: keep it off public networks
        start_http_server(
            tenant_metrics_port, addr=settings.metrics_host, registry=metrics.TENANT_REGISTRY
        )

    async def install(w: Worker) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, w.request_stop)

    async def main() -> None:
        await run_worker(settings, make_engine, install)

    from launch.exits import EXIT_ENGINE_DEAD, EXIT_WORKER_ID_TAKEN
    from workers.engine.base import EngineDead
    from workers.identity import WorkerIdTaken

    try:
        asyncio.run(main())
    except EngineDead as exc:
        # Every job went back to its tier; the supervisor (tierq run, compose) restarts us.
        log.error("exiting: %s", exc)
        raise SystemExit(EXIT_ENGINE_DEAD) from None
    except WorkerIdTaken as exc:
        log.error("refusing to start: %s", exc)
        raise SystemExit(EXIT_WORKER_ID_TAKEN) from None


@app.command()
def migrate(
    revision: str = typer.Option("head", help="Target revision."),
    down: bool = typer.Option(False, "--down", help="Downgrade to the revision instead."),
    wait: float = typer.Option(
        0.0,
        min=0.0,
        help="Seconds to keep retrying while the database or the object store cannot be "
        "reached (a deployment's first start, its services still coming up).",
    ),
) -> None:
    """Apply the Alembic migrations to the configured database, and make the file store
    ready (its folder, or its S3 bucket if missing): once per deployment (concurrent runs
    wait for each other's lock)."""
    import migrations
    from models.db import is_unavailable
    from tierq.file_store import StoreUnavailable, file_store
    from tierq.retry import Backoff

    settings = get_settings()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url
    deadline = time.monotonic() + wait
    backoff = Backoff(0.5, 2.0)
    while True:
        try:
            pooling = settings.database_transaction_pooling
            if down:
                migrations.downgrade(url, revision if revision != "head" else "base", pooling)
                return
            migrations.upgrade(url, revision, pooling)
            typer.echo(file_store(settings).prepare(), err=True)
            return
        except Exception as exc:
            if not (is_unavailable(exc) or isinstance(exc, StoreUnavailable | OSError)):
                raise
            if time.monotonic() >= deadline:
                raise
            typer.echo(f"waiting for the database and the object store: {exc}", err=True)
            time.sleep(min(backoff.next_s(), max(0.0, deadline - time.monotonic())))


@app.command("rebuild-usage-days")
def rebuild_usage_days(
    tenant: str | None = typer.Option(None, help="One tenant's days only (default: all)."),
) -> None:
    """Recompute the ledger's day and hour sums from its records, after records were loaded
    around tierq (an import, a repair); job endings wait while it runs. Prints the day rows
    written."""
    from models import billing
    from models.db import Database

    async def main() -> int:
        db = Database.for_settings(get_settings())
        try:
            async with db.transaction() as s:
                return await billing.rebuild_days(s, tenant)
        finally:
            await db.close()

    typer.echo(asyncio.run(main()))


@app.command("prepare-model")
def prepare_model() -> None:
    """Convert the bundled model once (cached); prints its folder."""
    from workers.engine.bundled_model import prepare_bundled_model

    setup_logging()
    typer.echo(prepare_bundled_model(get_settings()))


@app.command("create-tenant")
def create_tenant(
    name: str,
    key_file: Path | None = typer.Option(None, help="Write the key here (mode 0600)."),
) -> None:
    """Create a tenant with one API key (printed once), or a new key for an existing one."""
    from services.bootstrap import ensure_tenant_key

    key = asyncio.run(ensure_tenant_key(get_settings(), name, key_file))
    typer.echo(json.dumps({"tenant": name, "key": key}))


@app.command()
def reference(
    page: str = typer.Argument("settings", help="The page to render: settings or api."),
    write: bool = typer.Option(False, help="Write it to docs/ instead of printing it."),
) -> None:
    """Render a reference page of the docs from the code: the settings (their descriptions)
    or the HTTP API (its OpenAPI document)."""
    from cli import reference as rendering

    pages = {
        "settings": (rendering.render, rendering.PAGE),
        "api": (rendering.render_api, rendering.API_PAGE),
    }
    if page not in pages:
        raise typer.BadParameter(" or ".join(pages), param_hint="PAGE")
    render, target = pages[page]
    text = render()
    if write:
        target.write_text(text)
    else:
        print(text, end="")


@app.command()
def calibrate() -> None:
    """Fit the simulated engine's cost model to the real engine here (its calibration.json)."""
    from benchmarks.calibrate import calibrate as run_calibration

    setup_logging("WARNING")
    typer.echo(json.dumps(run_calibration(get_settings()), indent=2))


@bench_app.command("overhead")
def bench_overhead(
    url: str | None = URL_OPTION,
    n: int = typer.Option(64, help="Number of identical chat jobs."),
    max_tokens: int = typer.Option(64),
    key_file: Path | None = typer.Option(
        None, help="The tenant's API key (default: STATE_DIR/dev-api-key)."
    ),
    tier: str = typer.Option("standard"),
    rounds: int = typer.Option(3, help="Alternating rounds of each; medians are compared."),
    mixed: bool = typer.Option(
        False, "--mixed", help="Seeded mixed prompt lengths and max_tokens, the same each side."
    ),
) -> None:
    """Platform vs the raw engine (LLM.chat) on the same prompts; prints one JSON line last."""
    from benchmarks.overhead import run_overhead

    setup_logging("WARNING")
    settings = get_settings()
    key = (key_file or settings.dev_key_file).read_text().strip()
    result = run_overhead(settings, platform_url(url), key, n, max_tokens, tier, rounds, mixed)
    _emit(result)


@bench_app.command("serve")
def bench_serve(
    rate: float = typer.Option(2.0, help="Requests per second of the paced scenario."),
    n: int = typer.Option(96, min=1, help="Requests of the paced scenario."),
    burst: int = typer.Option(128, min=1, help="Requests of the burst (all at once)."),
    input_len: int = typer.Option(64, min=1, help="Prompt tokens (random dataset)."),
    output_len: int = typer.Option(64, min=2, help="Output tokens (ignore_eos)."),
    seed: int = typer.Option(0, help="The client's seed: the same prompts and arrivals."),
    vllm_scheduler: str = typer.Option(
        "stock", help="vllm serve's scheduler: stock (vLLM's own) or tierq (tierq's policy)."
    ),
    order: str = typer.Option(
        "vllm,tierq",
        help="The servers, in the order they run (one, or a repeat: vllm,tierq,vllm).",
    ),
    keep_dir: Path | None = typer.Option(
        None, help="Keep the client's result files and tierq's logs in this folder."
    ),
) -> None:
    """vLLM's serving benchmark client against `vllm serve` (the worker's engine settings),
    then against `tierq run`; prints one JSON line last."""
    from benchmarks.serve import ServeConfig, run_serve

    setup_logging("WARNING")
    if vllm_scheduler not in ("stock", "tierq"):
        raise typer.BadParameter("stock or tierq", param_hint="--vllm-scheduler")
    servers = _names(order, ("vllm", "tierq"), "--order")
    cfg = ServeConfig(
        rate=rate,
        n_rate=n,
        n_burst=burst,
        input_len=input_len,
        output_len=output_len,
        seed=seed,
        vllm_scheduler=vllm_scheduler,
        servers=servers,
        keep_dir=keep_dir,
    )

    _interrupt_on_sigterm()
    try:
        result = run_serve(get_settings(), cfg)
    except KeyboardInterrupt:
        typer.echo("interrupted: every process it started is stopped", err=True)
        raise typer.Exit(130) from None
    _emit(result)


@bench_app.command("peers")
def bench_peers(
    duration: float = typer.Option(90.0, min=5.0, help="Seconds of arrivals per run."),
    overload: str = typer.Option(
        "1.5,3", help="Batch backlogs, comma-separated: each x the engine's capacity x duration."
    ),
    interactive_rate: float = typer.Option(1.0, min=0.0, help="Interactive chats per second."),
    standard_rate: float = typer.Option(0.2, min=0.0, help="Standard requests per second."),
    ttft_slo: float | None = typer.Option(
        None, help="Interactive TTFT SLO, ms (default: twice the idle TTFT measured first)."
    ),
    capacity: float | None = typer.Option(
        None, help="The engine's output tokens/s (default: measured first on `vllm serve`)."
    ),
    servers: str = typer.Option(
        "vllm-fcfs,vllm-priority,tierq", help="The servers, in the order they run."
    ),
    seed: int = typer.Option(0, help="Seeds the trace: the same requests at the same times."),
    repeats: int = typer.Option(
        1, min=1, help="Rounds per load, the servers' order reversed every other round."
    ),
) -> None:
    """tierq against `vllm serve` (FCFS) and `vllm serve --scheduling-policy priority` on
    one trace: interactive chats arriving while a batch backlog fills the engine; prints
    one JSON line last."""
    from benchmarks.peers import SERVERS, PeersConfig, run_peers

    setup_logging("WARNING")
    overloads = _numbers(overload, "--overload")
    if any(x <= 0 for x in overloads):
        raise typer.BadParameter("positive numbers", param_hint="--overload")
    chosen = _names(servers, SERVERS, "--servers")
    cfg = PeersConfig(
        duration_s=duration,
        overloads=overloads,
        interactive_rate=interactive_rate,
        standard_rate=standard_rate,
        ttft_slo_ms=ttft_slo,
        capacity_tokens_per_s=capacity,
        servers=chosen,
        seed=seed,
        repeats=repeats,
    )

    _interrupt_on_sigterm()
    _run_platform_bench(run_peers(get_settings(), cfg))


def _names(value: str, allowed: Sequence[str], hint: str) -> tuple[str, ...]:
    """A comma-separated list of names, each one of `allowed` (repeats kept, in order)."""
    chosen = tuple(name.strip() for name in value.split(","))
    if any(name not in allowed for name in chosen):
        raise typer.BadParameter(f"among {', '.join(allowed)}, comma-separated", param_hint=hint)
    return chosen


def _numbers(value: str, hint: str) -> tuple[float, ...]:
    """Comma-separated numbers (`1e5` too), at least one."""
    try:
        return tuple(float(x) for x in value.split(","))
    except ValueError:
        raise typer.BadParameter("numbers, comma-separated", param_hint=hint) from None


def _sizes(value: str, hint: str) -> tuple[int, ...]:
    """Comma-separated positive sizes, in increasing order (`1e5` is 100000)."""
    numbers = _numbers(value, hint)
    if not all(1 <= x < math.inf for x in numbers):  # NaN and infinity too
        raise typer.BadParameter("positive and increasing", param_hint=hint)
    sizes = tuple(int(x) for x in numbers)
    if list(sizes) != sorted(set(sizes)):
        raise typer.BadParameter("positive and increasing", param_hint=hint)
    return sizes


@bench_app.command("curves")
def bench_curves(
    parts: str = typer.Option("ledger,dispatch,streams", help="Which curves, comma-separated."),
    ledger_sizes: str = typer.Option(
        "1e3,1e4,1e5,1e6,1e7", help="Usage records in the tenant's ledger."
    ),
    jobs_cap: int = typer.Option(1_000_000, min=0, help="The jobs table grows up to this."),
    admission_n: int = typer.Option(1000, min=10, help="Admissions measured at each size."),
    tenant_counts: str = typer.Option(
        "10,100,1000,1e4,1e5", help="Tenants with queued work (dispatch)."
    ),
    tenants_queue: int = typer.Option(100_000, min=1, help="Queued jobs at every tenant count."),
    queue_lengths: str = typer.Option("1e3,1e4,1e5,1e6", help="Queued jobs (dispatch)."),
    streams: int = typer.Option(200, min=10, max=256, help="SSE streams held open at once."),
    keep_logs: bool = typer.Option(False, "--keep-logs", help="Keep the processes' logs."),
) -> None:
    """How tierq's costs grow with its work: admission and usage reports against the
    ledger's size, the dispatcher against tenants and queue length, memory per open
    stream; each as a curve with its fitted growth; prints one JSON line last."""
    from benchmarks.curves import PARTS, CurvesConfig, run_curves

    setup_logging("INFO")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    chosen = _names(parts, PARTS, "--parts")
    cfg = CurvesConfig(
        ledger_sizes=_sizes(ledger_sizes, "--ledger-sizes"),
        jobs_cap=jobs_cap,
        admission_n=admission_n,
        tenant_counts=_sizes(tenant_counts, "--tenant-counts"),
        tenants_queue=tenants_queue,
        queue_lengths=_sizes(queue_lengths, "--queue-lengths"),
        streams=streams,
        parts=chosen,
        keep_logs=keep_logs,
    )
    _run_platform_bench(run_curves(get_settings(), cfg))


@bench_app.command("qos")
def bench_qos(
    engine: str = typer.Option("simulated", help="simulated (calibrated) or vllm (scaled down)."),
    speedup: float = typer.Option(
        5.0, help="Time compression of the simulated engine (vllm: its measured speed)."
    ),
    seed: int = typer.Option(1),
    duration: float | None = typer.Option(
        None, help="Seconds of arrivals in the calibration's time (vllm: wall s x its speed)."
    ),
    policies: str = typer.Option(
        "tierq,fcfs,engine-priority", help="The policies to run after the idle baseline."
    ),
) -> None:
    """tierq vs fcfs vs engine-priority on one seeded workload; prints one JSON line last."""
    from benchmarks.qos import POLICIES, run_qos

    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    unknown = sorted(set(chosen) - set(POLICIES))
    if unknown or not chosen:
        raise typer.BadParameter(f"policies are among {', '.join(POLICIES)}; not {unknown}")
    setup_logging("WARNING")
    result = asyncio.run(run_qos(get_settings(), engine, speedup, seed, duration, chosen))
    _emit(result)


@bench_app.command("scale")
def bench_scale(
    workers: int = typer.Option(8, help="Simulated workers, in this process."),
    slots: int = typer.Option(32, help="MAX_NUM_SEQS of each simulated engine."),
    duration: float = typer.Option(30.0, help="Wall seconds of arrivals per run."),
    seed: int = typer.Option(1),
    speedup: float = typer.Option(4.0, help="Time compression of the simulated engines."),
    load: float = typer.Option(1.5, help="Offered load, in capacities without cache hits."),
    cache_entries: int = typer.Option(6, help="Prefixes each simulated prefix cache holds."),
    lease: float = typer.Option(5.0, help="DISPATCH_LEASE_S of the two dispatchers."),
    engine: str = typer.Option(
        "simulated", help="simulated, or vllm: real engines with the bundled model."
    ),
) -> None:
    """Cache-affine vs free-slot placement, dispatch rate, failover, autoscaling signal
    (simulated or real engines, real Redis and PostgreSQL); one JSON line last on stdout."""
    from benchmarks.scale import ScaleConfig, run_scale

    setup_logging("WARNING")
    cfg = ScaleConfig(
        workers=workers,
        slots=slots,
        duration_s=duration,
        seed=seed,
        speedup=speedup,
        load=load,
        cache_entries=cache_entries,
        lease_s=lease,
        engine=engine,
    )
    if engine not in ("simulated", "vllm"):
        raise typer.BadParameter("--engine is simulated or vllm")
    _run_platform_bench(run_scale(get_settings(), cfg))


@bench_app.command("steps")
def bench_steps(
    slots: int = typer.Option(32, help="MAX_NUM_SEQS of the engine; all but one run batch work."),
    interactive: int = typer.Option(40, help="Interactive requests measured."),
    prompt_repeat: int = typer.Option(60, help="Batch prompt length, in ~10-token sentences."),
) -> None:
    """tierq's scheduler inside vLLM vs vLLM's stock one (real engine); one JSON line last."""
    from benchmarks.steps import run_steps

    setup_logging("WARNING")
    result = asyncio.run(run_steps(get_settings(), slots, interactive, prompt_repeat))
    _emit(result)


@bench_app.command("chaos")
def bench_chaos(
    duration: float = typer.Option(60.0, help="Seconds of load, with faults."),
    seed: int = typer.Option(0, help="Seeds the fault schedule, the load and engine faults."),
    engine: str = typer.Option("simulated", help="simulated (default) or vllm (the real one)."),
    rate: float | None = typer.Option(None, help="Jobs per second [8; 2 with vllm]."),
    fault_every: float = typer.Option(4.0, help="Seconds between scheduled faults."),
    workers: int | None = typer.Option(None, help="Worker processes [2; 1 with vllm]."),
    engine_fault_rate: float = typer.Option(0.02, help="Fraction of requests the engine fails."),
    settle: float = typer.Option(60.0, help="After the load: how long jobs may take to finish."),
    keep_logs: bool = typer.Option(False, "--keep-logs", help="Keep the processes' logs."),
) -> None:
    """Kill components and Redis under load; lost, double-billed, double-streamed jobs and
    recovery time (simulated engine by default); prints one JSON line last."""
    from benchmarks.chaos import ChaosConfig, run_chaos

    setup_logging("INFO")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = ChaosConfig(
        duration_s=duration,
        seed=seed,
        engine=engine,
        rate=rate or (8.0 if engine == "simulated" else 2.0),
        fault_every_s=fault_every,
        workers=workers or (2 if engine == "simulated" else 1),
        engine_fault_rate=engine_fault_rate,
        settle_s=settle,
        keep_logs=keep_logs,
    )
    _run_platform_bench(run_chaos(get_settings(), cfg))


@bench_app.command("soak")
def bench_soak(
    duration: float = typer.Option(600.0, help="Seconds of mixed load, with faults."),
    seed: int = typer.Option(0, help="Seeds the load and the fault schedule."),
    rate: float = typer.Option(6.0, help="Submissions per second (jobs, cancels, hang-ups)."),
    workers: int = typer.Option(3, help="Worker processes (simulated engines)."),
    fault_every: float = typer.Option(10.0, help="Seconds between faults."),
    settle: float = typer.Option(90.0, help="After the load: how long work may take to end."),
    keep_logs: bool = typer.Option(False, "--keep-logs", help="Keep the processes' logs."),
    faults: str = typer.Option(
        "sigterm_worker,kill_worker,pubsub_drop,redis_restart",
        help="The kinds of fault, taken in turn (a subset tells which costs what).",
    ),
) -> None:
    """A long mixed run (jobs, SSE, cancels, hang-ups, batches) while workers are restarted
    and killed, pub/sub dropped and Redis restarted (simulated engine); one JSON line last."""
    from benchmarks.soak import FAULT_KINDS, SoakConfig, run_soak

    kinds = tuple(k.strip() for k in faults.split(",") if k.strip())
    if not kinds or set(kinds) - set(FAULT_KINDS):
        raise typer.BadParameter(f"kinds among {', '.join(FAULT_KINDS)}", param_hint="--faults")

    setup_logging("INFO")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = SoakConfig(
        duration_s=duration,
        seed=seed,
        rate=rate,
        workers=workers,
        fault_every_s=fault_every,
        settle_s=settle,
        keep_logs=keep_logs,
        fault_kinds=kinds,
    )
    _run_platform_bench(run_soak(get_settings(), cfg))


@bench_app.command("isolation")
def bench_isolation(
    duration: float = typer.Option(
        90.0,
        help="Seconds of load: the quiet tenant alone (25 %), beside a good neighbour "
        "(25 %), then under the noise.",
    ),
    seed: int = typer.Option(0, help="Seeds the noisy tenant's workload."),
    engine: str = typer.Option("simulated", help="simulated (default) or vllm (the real one)."),
    streams: int = typer.Option(3000, help="SSE streams the noisy tenant tries to open."),
    quiet_rate: float = typer.Option(
        2.0, help="The quiet tenant's interactive requests per second."
    ),
    job_rate: float = typer.Option(10.0, help="The noisy tenant's job submissions per second."),
    noisy_nice: int = typer.Option(
        10,
        min=0,
        max=19,
        help="The noisy tenant's client's niceness: it stands for clients on machines of "
        "their own (0: it competes with the platform for this machine's CPU).",
    ),
    api_workers: int = typer.Option(
        1, min=1, help="API processes behind the one port (`tierq api --workers`)."
    ),
    settle: float = typer.Option(60.0, help="After the load: how long leftovers may take."),
    keep_logs: bool = typer.Option(False, "--keep-logs", help="Keep the processes' logs."),
) -> None:
    """A noisy tenant within its allowance against a quiet one: interactive TTFT alone,
    beside the same tenant behaving well, and under its noise, Redis peaks, server errors,
    unbilled tokens (simulated engine by default); prints one JSON line last."""
    from benchmarks.isolation import IsolationConfig, run_isolation

    setup_logging("INFO")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = IsolationConfig(
        duration_s=duration,
        seed=seed,
        engine=engine,
        streams=streams,
        quiet_rate=quiet_rate,
        job_rate=job_rate,
        noisy_nice=noisy_nice,
        api_workers=api_workers,
        settle_s=settle,
        keep_logs=keep_logs,
    )
    _run_platform_bench(run_isolation(get_settings(), cfg))


@bench_app.command("admission")
def bench_admission(
    clients: int = typer.Option(32, min=1, help="Concurrent clients."),
    n: int = typer.Option(5000, min=1, help="Measured requests per phase."),
    api_workers: int = typer.Option(1, min=1, help="API processes (`tierq api --workers`)."),
    tenants: int = typer.Option(8, min=1, help="Tenants the clients are spread over."),
    quota: bool = typer.Option(False, "--quota", help="Give each tenant a quota (exact path)."),
    keep_logs: bool = typer.Option(False, "--keep-logs", help="Keep the API's log."),
) -> None:
    """Jobs admitted per second by the real API on PostgreSQL and Redis (no engine), and
    the OpenAI chat path's admission; prints one JSON line last."""
    from benchmarks.admission import AdmissionConfig, run_admission

    setup_logging("INFO")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = AdmissionConfig(
        clients=clients,
        n=n,
        api_workers=api_workers,
        tenants=tenants,
        quota=quota,
        keep_logs=keep_logs,
    )
    _run_platform_bench(run_admission(get_settings(), cfg))


def _interrupt_on_sigterm() -> None:
    """SIGTERM as Ctrl-C, for a bench that runs in this thread: either stops every process
    it started."""

    def on_term(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)


def _run_platform_bench(run: Coroutine[Any, Any, dict[str, Any]]) -> None:
    """A benchmark that starts the platform's processes: its JSON line last on stdout;
    Ctrl-C or SIGTERM stops every process it started (exit 130)."""
    try:
        result = asyncio.run(run)
    except (KeyboardInterrupt, asyncio.CancelledError):
        typer.echo("interrupted: every process it started is stopped", err=True)
        raise typer.Exit(130) from None
    _emit(result)


@batch_app.command("submit")
def batch_submit(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="The JSONL requests."),
    endpoint: str = typer.Option("/v1/chat/completions", help="Every line's url."),
    wait: bool = typer.Option(False, "--wait", help="Follow it to the end with a progress bar."),
    url: str | None = URL_OPTION,
    key: str | None = KEY_OPTION,
) -> None:
    """Upload FILE and start a batch; prints the batch (JSON) when it starts or ends."""
    from client.batches import BatchClient, resolve_key

    client = BatchClient(platform_url(url), resolve_key(key, get_settings()))
    try:
        uploaded = client.upload(file)
        batch = client.create(uploaded["id"], endpoint)
        typer.echo(
            f"{batch['id']}: {batch['status']} ({uploaded['bytes']} bytes uploaded)", err=True
        )
        if wait:
            batch = _follow(client, batch["id"])
    finally:
        client.close()
    typer.echo(json.dumps(batch, indent=2))
    if batch["status"] in ("failed", "expired", "cancelled"):
        raise typer.Exit(1)


def _follow(client: BatchClient, batch_id: str) -> dict[str, Any]:
    """A live progress bar of completed and failed requests, with an ETA."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("[bold]{task.fields[status]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("ok {task.fields[ok]}  failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    from rich.console import Console

    # On stderr, so that stdout carries only the batch's JSON (pipe it to jq).
    with Progress(*columns, transient=False, console=Console(stderr=True)) as progress:
        task = progress.add_task(batch_id, total=None, status="validating", ok=0, failed=0)

        def update(batch: dict[str, Any]) -> None:
            counts = batch["request_counts"]
            progress.update(
                task,
                total=counts["total"] or None,
                completed=counts["completed"] + counts["failed"],
                status=batch["status"],
                ok=counts["completed"],
                failed=counts["failed"],
            )

        return client.wait(batch_id, update)


@batch_app.command("download")
def batch_download(
    batch_id: str,
    out: Path = typer.Option(Path("."), help="Folder for <batch>_output.jsonl and _errors.jsonl."),
    url: str | None = URL_OPTION,
    key: str | None = KEY_OPTION,
) -> None:
    """Write a finished batch's output and error files."""
    from client.batches import BatchClient, resolve_key

    client = BatchClient(platform_url(url), resolve_key(key, get_settings()))
    try:
        batch = client.get(batch_id)
        if batch["status"] not in ("completed", "expired", "cancelled", "failed"):
            typer.echo(f"{batch_id} is {batch['status']}: nothing to download yet", err=True)
            raise typer.Exit(1)
        out.mkdir(parents=True, exist_ok=True)
        for kind in ("output", "error"):
            file_id = batch[f"{kind}_file_id"]
            if file_id is None:
                continue
            target = out / f"{batch_id}_{kind}.jsonl"
            size = client.download(file_id, target)
            typer.echo(f"{target} ({size} bytes)")
        if batch["errors"]:
            typer.echo(json.dumps(batch["errors"], indent=2))
    finally:
        client.close()


@bench_app.command("report")
def bench_report(
    results: Path = typer.Option(Path("benchmarks/results"), help="The kept results."),
    page: Path = typer.Option(Path("docs/benchmarks.md"), help="The page whose table it writes."),
    readme: Path = typer.Option(Path("README.md"), help="The README whose headline it writes."),
    write: bool = typer.Option(
        False, help="Write the page's table and plots and the README's headline table."
    ),
) -> None:
    """The latest kept result of each bench as the docs' table and plots (between the
    page's results markers) and the README's headline table (between its headline
    markers); without --write, both tables are printed."""
    from benchmarks import results as kept

    records = kept.load(results)
    if write:
        kept.write_report(page, records)
        kept.write_headline(readme, records)
        typer.echo(f"{page}, {readme}: {len(kept.latest(records))} benches", err=True)
    else:
        typer.echo(kept.render(records))
        typer.echo(kept.render_headline(records), nl=False)


@bench_app.command("batch")
def bench_batch(
    url: str | None = URL_OPTION,
    key: str | None = KEY_OPTION,
    n: int = typer.Option(96, help="Chat requests in the JSONL file."),
    max_tokens: int = typer.Option(32),
    rounds: int = typer.Option(2, help="Alternating rounds of each; medians are compared."),
) -> None:
    """Platform batches vs vLLM's run_batch on the same file; prints one JSON line last."""
    from benchmarks.batch import run_bench
    from client.batches import resolve_key

    setup_logging("WARNING")
    result = run_bench(
        get_settings(), platform_url(url), resolve_key(key, get_settings()), n, max_tokens, rounds
    )
    _emit(result)


def main() -> None:
    from tierq.redis_conn import EvictingRedis

    try:
        app(prog_name="tierq")
    except EvictingRedis as exc:  # a deployment mistake, said in one line, not a traceback
        typer.echo(f"tierq: refusing to start: {exc}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
