"""Debian's PgBouncer in transaction mode in front of the test PostgreSQL, for the tests: its
own folder and port, trust authentication (as the server behind it)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.ports import free_port
from tests.helpers import stop_group

PGBOUNCER = "/usr/sbin/pgbouncer"  # Debian's package (`make pgbouncer`)
START_S = 20.0


class PgBouncer:
    def __init__(
        self,
        folder: Path,
        pg_host: str,
        pg_port: int,
        ip: str = "127.0.0.1",
        prefix: Sequence[str] = (),
    ) -> None:
        """Every database of the server behind it, by its own name, in pools of 20 server
        connections. `ip`: where it listens; `prefix`: the command it runs under (a host's
        network namespace: `ip netns exec NAME`)."""
        self.folder, self.ip, self.prefix = folder, ip, list(prefix)
        self.port = free_port()
        self.pg_host, self.pg_port = pg_host, pg_port
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str) -> str:
        return f"postgresql+asyncpg://postgres@{self.ip}:{self.port}/{database}"

    def start(self) -> None:
        if not Path(PGBOUNCER).exists():
            raise RuntimeError("no pgbouncer: `make fleet-tools` installs Debian's package")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o777)  # it drops to the postgres user (it never runs as root)
        (self.folder / "users.txt").write_text('"postgres" ""\n')
        server = f"host={self.pg_host} port={self.pg_port}"
        (self.folder / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = {server}\n"
            "[pgbouncer]\n"
            f"listen_addr = {self.ip}\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.folder / 'users.txt'}\n"
            "admin_users = postgres\n"
            "pool_mode = transaction\n"
            "default_pool_size = 20\n"
            "max_client_conn = 1000\n"
            f"logfile = {self.folder / 'pgbouncer.log'}\n"
            f"pidfile = {self.folder / 'pgbouncer.pid'}\n"
        )
        for name in ("pgbouncer.ini", "users.txt"):
            shutil.chown(self.folder / name, "postgres")
        self.proc = subprocess.Popen(
            [*self.prefix, PGBOUNCER, "-u", "postgres", str(self.folder / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_S
        while self.admin("SHOW VERSION") is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PgBouncer did not start:\n{self.log()}")
            time.sleep(0.2)

    def admin(self, command: str) -> list[list[str]] | None:
        """A command of its admin console (psql: the console speaks the simple protocol
        only); its rows, or None if it does not answer."""
        got = subprocess.run(
            [
                *("psql", "-h", self.ip, "-p", str(self.port), "-U", "postgres"),
                *("-At", "-F", "\t", "-c", command, "pgbouncer"),
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if got.returncode != 0:
            return None
        return [row.split("\t") for row in got.stdout.splitlines()]

    def log(self) -> str:
        path = self.folder / "pgbouncer.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        stop_group(self.proc)
