"""A fleet on one machine: each host a network namespace with its own address and folder,
nothing shared on disk. A services host (its own PostgreSQL cluster from initdb, Redis
with a replica and three sentinels, SeaweedFS's S3 gateway; PgBouncer in transaction
mode in the `pgbouncer` variant), HAProxy on a host of its own in front of two API hosts,
two dispatcher hosts, two worker hosts (the simulated engine: the engine is not the
subject here) and a Celery host (worker and beat).

The variants run: TIERQ_FLEET_VARIANTS (comma-separated; `direct` unless set):
`make test` runs `direct`, `make test-fleet` both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fleet.hosts import Host, Network
from tests.pgbouncer_server import PgBouncer
from tests.redis_sentinel import SentinelRedis
from tests.s3_server import BUCKET, SeaweedS3
from tierq.workers.celery_flags import QUIET_WORKER_FLAGS

VARIANTS = os.environ.get("TIERQ_FLEET_VARIANTS", "direct").split(",")
ADMIN_KEY = "fleet-admin-" + uuid.uuid4().hex
READY_S = 120.0
SETTINGS = {
    "REDIS_PREFIX": "fleet",
    "ENGINE": "simulated",
    "HEARTBEAT_INTERVAL_S": "0.5",
    "WORKER_DEAD_AFTER_S": "3",
    "RECONCILE_INTERVAL_S": "3",
    "RECONCILE_GRACE_S": "2",
    "BEAT_LEASE_S": "3",
    "BATCH_TICK_S": "0.5",
    "MAX_NUM_SEQS": "8",
    "LOG_LEVEL": "INFO",
}


class Fleet:
    def __init__(self, network: Network, variant: str) -> None:
        self.network, self.variant = network, variant
        self.hosts: dict[str, Host] = {}
        self.key = ""
        self.database_url = ""
        self.redis: SentinelRedis | None = None
        self.s3: SeaweedS3 | None = None
        self.env: dict[str, str] = {}
        self.tierq: list[str] = []

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def start_api(self, host: Host) -> None:
        host.start(
            "api", [*self.tierq, "api", "--host", "0.0.0.0", "--port", "8000"], self.env_of(host)
        )

    def url(self, name: str) -> str:
        """An API host's own address, or the balancer's (`lb`)."""
        return f"http://{self.hosts[name].address}:8000"

    def env_of(self, host: Host) -> dict[str, str]:
        env = {**self.env, "STATE_DIR": str(host.folder / "state")}
        if not host.name.startswith("w"):
            # The model is installed on the worker hosts only (this machine's model
            # cache): the others count prompts with the tokenizer the workers publish.
            env["MODEL_CACHE_DIR"] = str(host.folder / "models")
        return env

    def logs(self) -> str:
        return "\n".join(
            f"--- {h.name}/{name}\n{h.log(name)[-1500:]}"
            for h in self.hosts.values()
            for name in h.procs
        )


def _postgres(svc: Host, subnet: str) -> str:
    """Its own cluster (initdb), as the postgres user, on the services host's address."""
    data = svc.folder / "pg"
    data.mkdir()
    shutil.chown(data, "postgres")
    as_postgres = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
    initdb = shutil.which("initdb") or "initdb"
    subprocess.run(
        [*as_postgres, initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"],
        check=True,
        capture_output=True,
    )
    with (data / "pg_hba.conf").open("a") as hba:
        hba.write(f"host all all {subnet}.0/24 trust\n")
    postgres = Path(initdb).resolve().parent / "postgres"
    svc.start(
        "postgres",
        [
            *as_postgres,
            str(postgres),
            *("-D", str(data), "-c", f"listen_addresses={svc.address}", "-c", "port=5432"),
            *("-c", f"unix_socket_directories={data}", "-c", "fsync=off"),
            *("-c", "max_connections=500"),
        ],
        dict(os.environ),
    )
    deadline = time.monotonic() + 30
    while subprocess.run(["pg_isready", "-h", svc.address, "-q"]).returncode != 0:
        assert time.monotonic() < deadline, svc.log("postgres")
        time.sleep(0.2)
    subprocess.run(
        ["psql", "-h", svc.address, "-U", "postgres", "-c", "CREATE DATABASE tierq"],
        check=True,
        capture_output=True,
    )
    return f"postgresql+asyncpg://postgres@{svc.address}:5432/tierq"


def _haproxy(lb: Host, apis: list[Host]) -> None:
    servers = "".join(
        f"  server {h.name} {h.address}:8000 check inter 500 fall 2 rise 1\n" for h in apis
    )
    config = lb.folder / "haproxy.cfg"
    config.write_text(
        "global\n  maxconn 4000\n"
        "defaults\n  mode http\n  timeout connect 2s\n  timeout client 120s\n"
        "  timeout server 120s\n  retries 2\n  option redispatch\n"
        f"frontend api\n  bind {lb.address}:8000\n  default_backend apis\n"
        "backend apis\n  balance roundrobin\n  option httpchk GET /readyz\n"
        "  http-check expect status 200\n"
        "  http-response set-header X-Served-By %s\n"  # which replica answered
        f"{servers}"
        f"listen stats\n  bind {lb.address}:8404\n  stats enable\n  stats uri /stats\n"
    )
    lb.start("haproxy", ["haproxy", "-f", str(config), "-db"], dict(os.environ))


def _wait_ready(fleet: Fleet) -> None:
    deadline = time.monotonic() + READY_S
    while True:
        try:
            ok = all(
                httpx.get(f"{fleet.url(api)}/readyz?min_workers=2", timeout=2).status_code == 200
                for api in ("api1", "api2")
            )
            if ok and httpx.get(f"{fleet.url('lb')}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        for host in fleet.hosts.values():
            for name, proc in host.procs.items():
                assert proc.poll() is None, f"{host.name}/{name} exited:\n{host.log(name)}"
        assert time.monotonic() < deadline, f"the fleet is not ready:\n{fleet.logs()}"
        time.sleep(0.5)


@pytest.fixture(scope="module", params=VARIANTS)
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    root = Path(tempfile.mkdtemp(prefix="tierq-fleet-"))
    os.chmod(root, 0o755)  # the postgres user reaches its folders
    network: Network | None = None
    fleet: Fleet | None = None
    try:
        network = Network(root)
        fleet = Fleet(network, request.param)
        for name in ("svc", "lb", "api1", "api2", "d1", "d2", "w1", "w2", "celery"):
            fleet.hosts[name] = network.add(name)
        svc = fleet.host("svc")
        database_url = _postgres(svc, network.subnet)
        fleet.redis = SentinelRedis(svc.folder / "redis", svc.address, svc.prefix)
        fleet.redis.start()
        fleet.s3 = SeaweedS3(svc.folder / "s3", svc.address, svc.prefix)
        fleet.s3.start()
        fleet.database_url = database_url
        pooling = "false"
        if request.param == "pgbouncer":
            folder = svc.folder / "pgbouncer"
            folder.mkdir()
            bouncer = PgBouncer(folder, svc.address, 5432, svc.address, svc.prefix)
            try:
                bouncer.start()
            finally:  # stopped with the host, whether it started or not
                if bouncer.proc is not None:
                    svc.procs["pgbouncer"] = bouncer.proc
            database_url, pooling = bouncer.url("tierq"), "true"
        fleet.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TIERQ_"))},
            **SETTINGS,
            **fleet.s3.env,
            "DATABASE_URL": database_url,
            "DATABASE_TRANSACTION_POOLING": pooling,
            "REDIS_URL": fleet.redis.url,
            "FILES_URL": f"s3://{BUCKET}/fleet",
            "ADMIN_API_KEY": ADMIN_KEY,
        }
        tierq = [str(Path(sys.executable).parent / "tierq")]  # this virtual environment's
        api1 = fleet.host("api1")
        migrated = api1.run([*tierq, "migrate", "--wait", "30"], fleet.env_of(api1))
        assert migrated.returncode == 0, migrated.stderr
        made = api1.run([*tierq, "create-tenant", "acme"], fleet.env_of(api1))
        assert made.returncode == 0, made.stderr
        fleet.key = json.loads(made.stdout)["key"]
        fleet.tierq = tierq
        for name in ("api1", "api2"):
            fleet.start_api(fleet.host(name))
        for name in ("d1", "d2"):
            host = fleet.host(name)
            host.start("dispatcher", [*tierq, "dispatcher"], fleet.env_of(host))
        for name in ("w1", "w2"):
            host = fleet.host(name)
            # Named as a pod or a host would name it (the default, host name and state
            # folder, is unique too; a test reads these names back from the jobs).
            env = {**fleet.env_of(host), "WORKER_ID": name}
            host.start("worker", [*tierq, "worker", "--engine", "simulated"], env)
        celery = fleet.host("celery")
        celery.start(
            "celery",
            [
                *(sys.executable, "-m", "celery", "-A", "tierq.workers.celery_app", "worker", "-B"),
                *QUIET_WORKER_FLAGS,
                "--pool=solo",
                *("-Q", "fleet-celery,fleet-celery-reconcile", "--loglevel=INFO"),
                *("-s", str(celery.folder / "beat-schedule")),
            ],
            fleet.env_of(celery),
        )
        _haproxy(fleet.host("lb"), [fleet.host("api1"), fleet.host("api2")])
        _wait_ready(fleet)
        yield fleet
    finally:
        if network is not None:
            network.remove()
        if fleet is not None and fleet.redis is not None:
            fleet.redis.stop()
        if fleet is not None and fleet.s3 is not None:
            fleet.s3.stop()
        shutil.rmtree(root, ignore_errors=True)
