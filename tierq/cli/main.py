"""The `tierq` command line: one entry point for every component and tool."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from tierq.cli.admin import admin_app
from tierq.cli.options import KEY_OPTION, URL_OPTION, platform_url
from tierq.cli.top import top
from tierq.core.logs import setup as setup_logging
from tierq.core.settings import get_settings

if TYPE_CHECKING:
    from tierq.client.batches import BatchClient

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
batch_app = typer.Typer(no_args_is_help=True, help="OpenAI-style batches of JSONL requests.")
app.add_typer(batch_app, name="batch")
app.add_typer(admin_app, name="admin")
app.command()(top)


def _add_commands() -> None:
    """The command groups other installed distributions add through the `tierq.commands`
    entry point: `tierq bench` from the repository's benchmarks (benchmarks/pyproject.toml),
    which the `tierq` wheel does not ship. One that fails to load is left out, said on
    stderr: the platform's own commands (and the processes `tierq run` starts) never
    depend on it."""
    from importlib.metadata import entry_points

    for command in entry_points(group="tierq.commands"):
        try:
            group = command.load()
        except Exception as exc:
            print(f"tierq: leaving out `tierq {command.name}`: {exc!r}", file=sys.stderr)
            continue
        app.add_typer(group, name=command.name)


_add_commands()


@app.callback()
def _diagnostics(ctx: typer.Context) -> None:
    """MEMORY_SNAPSHOTS_DIR: snapshots of every tierq process on SIGUSR2 (a diagnostic)."""
    from tierq.core import memory_snapshots

    memory_snapshots.install(ctx.invoked_subcommand or "tierq")


log = logging.getLogger("tierq")


@app.command()
def run(
    verbose: bool = typer.Option(False, help="Show every process's log in this terminal."),
) -> None:
    """Run the whole platform on this machine (embedded SQLite and Redis unless URLs are set)."""
    from tierq.launch.supervisor import run_platform

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
        # Several processes behind one port: /metrics sums them all (tierq/core/metrics.py),
        # from a folder that starts empty and goes with this command.
        import atexit
        import os
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="tierq-api-metrics-")
        atexit.register(shutil.rmtree, folder, True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder  # read by the processes it starts
    uvicorn.run(
        "tierq.api.app:serve_app",
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
    from tierq.core.redis_conn import connect
    from tierq.dispatcher.loop import Dispatcher

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
        from tierq.launch.gpu_workers import run_gpu_workers

        raise SystemExit(run_gpu_workers(settings, gpus, engine, metrics_port, tenant_metrics_port))
    from prometheus_client import start_http_server

    from tierq.core import metrics
    from tierq.workers.engine.factory import make_engine
    from tierq.workers.worker import Worker, run_worker

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

    from tierq.launch.exits import EXIT_ENGINE_DEAD, EXIT_WORKER_ID_TAKEN
    from tierq.workers.engine.base import EngineDead
    from tierq.workers.identity import WorkerIdTaken

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
    from tierq import migrations
    from tierq.core.file_store import StoreUnavailable, file_store
    from tierq.core.retry import Backoff
    from tierq.models.db import is_unavailable

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
    from tierq.models import billing
    from tierq.models.db import Database

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
    from tierq.workers.engine.bundled_model import prepare_bundled_model

    setup_logging()
    typer.echo(prepare_bundled_model(get_settings()))


@app.command("create-tenant")
def create_tenant(
    name: str,
    key_file: Path | None = typer.Option(None, help="Write the key here (mode 0600)."),
) -> None:
    """Create a tenant with one API key (printed once), or a new key for an existing one."""
    from tierq.services.bootstrap import ensure_tenant_key

    key = asyncio.run(ensure_tenant_key(get_settings(), name, key_file))
    typer.echo(json.dumps({"tenant": name, "key": key}))


@app.command()
def reference(
    page: str = typer.Argument("settings", help="The page to render: settings or api."),
    write: bool = typer.Option(False, help="Write it to docs/ instead of printing it."),
) -> None:
    """Render a reference page of the docs from the code: the settings (their descriptions)
    or the HTTP API (its OpenAPI document)."""
    from tierq.cli import reference as rendering

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


@batch_app.command("submit")
def batch_submit(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="The JSONL requests."),
    endpoint: str = typer.Option("/v1/chat/completions", help="Every line's url."),
    wait: bool = typer.Option(False, "--wait", help="Follow it to the end with a progress bar."),
    url: str | None = URL_OPTION,
    key: str | None = KEY_OPTION,
) -> None:
    """Upload FILE and start a batch; prints the batch (JSON) when it starts or ends."""
    from tierq.client.batches import BatchClient, resolve_key

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
    from tierq.client.batches import BatchClient, resolve_key

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


def main() -> None:
    from tierq.core.redis_conn import EvictingRedis

    try:
        app(prog_name="tierq")
    except EvictingRedis as exc:  # a deployment mistake, said in one line, not a traceback
        typer.echo(f"tierq: refusing to start: {exc}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
