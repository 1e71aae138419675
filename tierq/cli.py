"""The `tierq` command line: one entry point for every component and tool."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import typer

from tierq.logs import setup as setup_logging
from tierq.settings import Settings, get_settings

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures.")
app.add_typer(bench_app, name="bench")


@app.command()
def run(
    verbose: bool = typer.Option(False, help="Show every process's log in this terminal."),
) -> None:
    """Run the whole platform on this machine (embedded SQLite and Redis unless URLs are set)."""
    from tierq.embedded import run_platform

    setup_logging()
    raise typer.Exit(run_platform(get_settings(), verbose=verbose))


@app.command()
def api(host: str | None = typer.Option(None), port: int | None = typer.Option(None)) -> None:
    """Serve the HTTP API."""
    import uvicorn

    from api.app import build_app

    setup_logging()
    settings = get_settings()
    uvicorn.run(
        build_app(settings),
        host=host or settings.api_host,
        port=port or settings.api_port,
        log_level="warning",
        timeout_graceful_shutdown=10,
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

        start_http_server(metrics_port, addr="127.0.0.1")

    async def main() -> None:
        r = await connect(settings)
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
) -> None:
    """Host an engine and run the jobs the dispatcher sends to this worker's inbox."""
    from workers.worker import Worker, run_worker

    setup_logging()
    settings = get_settings()
    if engine:
        settings = settings.model_copy(update={"engine": engine})
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr="127.0.0.1")

    async def install(w: Worker) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, w.request_stop)

    async def main() -> None:
        await run_worker(settings, make_engine, install)

    asyncio.run(main())


def make_engine(settings: Settings):
    if settings.engine == "simulated":
        from workers.simulated_engine import CostModel, SimulatedEngine

        return SimulatedEngine(
            CostModel(slots=settings.max_num_seqs, max_model_len=settings.max_model_len)
        )
    from workers.vllm_engine import VllmEngine

    return VllmEngine(settings)


@app.command()
def migrate(
    revision: str = typer.Option("head", help="Target revision."),
    down: bool = typer.Option(False, "--down", help="Downgrade to the revision instead."),
) -> None:
    """Apply the Alembic migrations to the configured database."""
    import migrations

    settings = get_settings()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url
    if down:
        migrations.downgrade(url, revision if revision != "head" else "base")
    else:
        migrations.upgrade(url, revision)


@app.command("prepare-model")
def prepare_model() -> None:
    """Convert the bundled model once (cached); prints its folder."""
    from tierq.bundled_model import prepare_bundled_model

    setup_logging()
    typer.echo(prepare_bundled_model(get_settings()))


@app.command("create-tenant")
def create_tenant(
    name: str,
    key_file: Path | None = typer.Option(None, help="Write the key here (mode 0600)."),
) -> None:
    """Create a tenant with one API key (printed once), or a new key for an existing one."""
    from tierq.bootstrap import ensure_tenant_key

    key = asyncio.run(ensure_tenant_key(get_settings(), name, key_file))
    typer.echo(json.dumps({"tenant": name, "key": key}))


@app.command()
def calibrate() -> None:
    """Fit the simulated engine's cost model to the real engine here (tierq/calibration.json)."""
    from tierq.calibration import calibrate as run_calibration

    setup_logging("WARNING")
    typer.echo(json.dumps(run_calibration(get_settings()), indent=2))


@bench_app.command("overhead")
def bench_overhead(
    url: str = typer.Option("http://127.0.0.1:8000", help="The running platform."),
    n: int = typer.Option(64, help="Number of identical chat jobs."),
    max_tokens: int = typer.Option(64),
    key_file: Path = typer.Option(Path(".tierq/dev-api-key"), help="The tenant's API key."),
    tier: str = typer.Option("standard"),
    rounds: int = typer.Option(3, help="Alternating rounds of each; medians are compared."),
) -> None:
    """Platform vs the raw engine (LLM.chat) on the same prompts; prints one JSON line last."""
    from tierq.bench_overhead import run_overhead

    setup_logging("WARNING")
    key = key_file.read_text().strip()
    result = run_overhead(get_settings(), url, key, n, max_tokens, tier, rounds)
    typer.echo(json.dumps(result))


@bench_app.command("qos")
def bench_qos(
    engine: str = typer.Option("simulated", help="simulated (calibrated) or vllm (scaled down)."),
    speedup: float = typer.Option(5.0, help="Time compression of the simulated engine."),
    seed: int = typer.Option(1),
    duration: float | None = typer.Option(None, help="Simulated seconds of arrivals."),
) -> None:
    """tierq vs fcfs vs engine-priority on one seeded workload; prints one JSON line last."""
    from tierq.bench_qos import run_qos

    setup_logging("WARNING")
    result = asyncio.run(run_qos(get_settings(), engine, speedup, seed, duration))
    typer.echo(json.dumps(result, separators=(",", ":")))


def main() -> None:
    app(prog_name="tierq")


if __name__ == "__main__":
    main()
