"""Redis under Sentinel for the tests: a primary, a replica and three sentinels (Debian's
redis-server, run as `redis-server --sentinel` for the sentinels), each its own process,
folder and port. The sentinels judge the primary down after DOWN_AFTER_MS and fail over
to the replica."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from benchmarks.ports import free_port
from tests.helpers import stop_group

PRIMARY = "tierq"
DOWN_AFTER_MS = 1000
START_S = 30.0


class SentinelRedis:
    def __init__(self, folder: Path, ip: str = "127.0.0.1", prefix: Sequence[str] = ()) -> None:
        """`ip`: the address every node listens on; `prefix`: the command they run under (a
        host's network namespace: `ip netns exec NAME`)."""
        self.folder, self.ip, self.prefix = folder, ip, list(prefix)
        self.ports = {"a": free_port(), "b": free_port()}  # the two data nodes
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        nodes = ",".join(f"{self.ip}:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{nodes}/{PRIMARY}/0"

    def _start(self, name: str, args: list[str]) -> None:
        folder = self.folder / name
        folder.mkdir(parents=True, exist_ok=True)
        log = (folder / "log").open("ab")
        self.procs[name] = subprocess.Popen(
            [*self.prefix, "redis-server", *args],
            cwd=folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start(self) -> None:
        a, b = self.ports["a"], self.ports["b"]
        # Protected mode refuses clients of a non-loopback address without a password.
        common = ["--bind", self.ip, "--protected-mode", "no", "--save", "", "--appendonly", "no"]
        self._start("a", ["--port", str(a), *common])
        self._start("b", ["--port", str(b), *common, "--replicaof", self.ip, str(a)])
        for i, port in enumerate(self.sentinel_ports):
            folder = self.folder / f"sentinel-{i}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "sentinel.conf").write_text(
                f"port {port}\nbind {self.ip}\nprotected-mode no\n"
                f"sentinel monitor {PRIMARY} {self.ip} {a} 2\n"
                f"sentinel down-after-milliseconds {PRIMARY} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {PRIMARY} 10000\n"
                f"sentinel parallel-syncs {PRIMARY} 1\n"
            )
            self._start(f"sentinel-{i}", [str(folder / "sentinel.conf"), "--sentinel"])
        deadline = time.monotonic() + START_S
        while not self._ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis under Sentinel did not start:\n{self.logs()}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            replica = redis.Redis(self.ip, self.ports["b"], socket_timeout=1)
            linked = replica.info("replication").get("master_link_status") == "up"
            known = [
                redis.Redis(self.ip, p, socket_timeout=1).sentinel_slaves(PRIMARY)
                for p in self.sentinel_ports
            ]
            return linked and all(len(k) == 1 for k in known)
        except redis.RedisError:
            return False

    def primary_port(self) -> int:
        """The port of the data node the sentinels name the primary now."""
        sentinel = redis.Redis(self.ip, self.sentinel_ports[0], socket_timeout=2)
        _host, port = sentinel.sentinel_get_master_addr_by_name(PRIMARY)
        return int(port)

    def node(self, port: int) -> str:
        return next(name for name, p in self.ports.items() if p == port)

    def kill(self, name: str) -> None:
        """SIGKILL a data node (its process group)."""
        proc = self.procs[name]
        proc.kill()
        proc.wait(10)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.parent.name}\n" + p.read_text(errors="replace")[-1500:]
            for p in sorted(self.folder.glob("*/log"))
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_group(proc, grace_s=5)
