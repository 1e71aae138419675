"""`tierq bench ...`: the benchmarks' commands. Each prints its figures as one JSON line,
last on stdout (logs go to stderr); `--save` keeps that line under benchmarks/results/.

This distribution (`tierq-benchmarks`, benchmarks/pyproject.toml) is not part of the
`tierq` wheel: it is installed from a checkout (`make install`) and adds its commands to
the `tierq` command through the `tierq.commands` entry point.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import typer

from tierq.cli.options import KEY_OPTION, URL_OPTION, platform_url
from tierq.core.logs import setup as setup_logging
from tierq.core.settings import get_settings

app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures.")


# Where a bench keeps its result (`tierq bench --save ...`; None: printed only), and which
# bench runs.
_KEEP: dict[str, Any] = {"to": None, "bench": "bench"}


@app.callback()
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


@app.command("calibrate")
def calibrate() -> None:
    """Fit the simulated engine's cost model to the real engine here (its calibration.json)."""
    from benchmarks.calibrate import calibrate as run_calibration

    setup_logging("WARNING")
    typer.echo(json.dumps(run_calibration(get_settings()), indent=2))


@app.command("overhead")
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


@app.command("serve")
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


@app.command("peers")
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


@app.command("curves")
def bench_curves(
    parts: str = typer.Option(
        "ledger,backlog,dispatch,streams", help="Which curves, comma-separated."
    ),
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
    backlog_sizes: str = typer.Option(
        "1e2,1e3,1e4,1e5", help="Queued jobs of one tenant under budgets (backlog)."
    ),
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
        backlog_sizes=_sizes(backlog_sizes, "--backlog-sizes"),
        streams=streams,
        parts=chosen,
        keep_logs=keep_logs,
    )
    _run_platform_bench(run_curves(get_settings(), cfg))


@app.command("qos")
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


@app.command("scale")
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


@app.command("steps")
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


@app.command("chaos")
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


@app.command("soak")
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


@app.command("isolation")
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
    control: bool = typer.Option(
        False,
        "--control",
        help="Then a control run: the noise phase without the noise, a process of the noisy "
        "client's niceness burning the CPU that client used instead (what the load "
        "generator's CPU alone costs on this machine), and the TTFT ratio accounted for it.",
    ),
) -> None:
    """A noisy tenant within its allowance against a quiet one: interactive TTFT alone,
    beside the same tenant behaving well, and under its noise, Redis peaks, server errors,
    unbilled tokens (simulated engine by default); prints one JSON line last."""
    from benchmarks.isolation import IsolationConfig, run_isolation, run_isolation_with_control

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
    run = run_isolation_with_control if control else run_isolation
    _run_platform_bench(run(get_settings(), cfg))


@app.command("admission")
def bench_admission(
    clients: int = typer.Option(32, min=1, help="Concurrent clients."),
    n: int = typer.Option(5000, min=1, help="Measured requests per phase."),
    api_workers: int = typer.Option(1, min=1, help="API processes (`tierq api --workers`)."),
    tenants: int = typer.Option(8, min=1, help="Tenants the clients are spread over."),
    quota: bool = typer.Option(
        False, "--quota", help="Give each tenant a quota (jobs counted first)."
    ),
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


@app.command("report")
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


@app.command("batch")
def bench_batch(
    url: str | None = URL_OPTION,
    key: str | None = KEY_OPTION,
    n: int = typer.Option(96, help="Chat requests in the JSONL file."),
    max_tokens: int = typer.Option(32),
    rounds: int = typer.Option(2, help="Alternating rounds of each; medians are compared."),
) -> None:
    """Platform batches vs vLLM's run_batch on the same file; prints one JSON line last."""
    from benchmarks.batch import run_bench
    from tierq.client.batches import resolve_key

    setup_logging("WARNING")
    result = run_bench(
        get_settings(), platform_url(url), resolve_key(key, get_settings()), n, max_tokens, rounds
    )
    _emit(result)
