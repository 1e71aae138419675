"""Hosts for the fleet test: each a Linux network namespace (iproute2's `ip netns`) with its
own address on a bridge in the root namespace, its own state folder, and the processes it
runs. Cutting a host off is setting its link down, as a pulled cable would."""

from __future__ import annotations

import os
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import stop_group


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class Host:
    name: str
    address: str
    namespace: str
    link: str  # the root namespace's end of its veth pair
    folder: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def prefix(self) -> list[str]:
        """Run a command on this host."""
        return ["ip", "netns", "exec", self.namespace]

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """A process of this host, in a session of its own; its output in `<name>.log`."""
        with (self.folder / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [*self.prefix, *argv],
                env=env,
                cwd=self.folder,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.prefix, *argv], env=env, cwd=self.folder, capture_output=True, text=True
        )

    def log(self, name: str) -> str:
        path = self.folder / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def cut(self) -> None:
        """Its link down: nothing reaches it, it reaches nothing (its processes run on)."""
        ip("link", "set", self.link, "down")

    def reconnect(self) -> None:
        ip("link", "set", self.link, "up")

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_group(proc, grace_s=10)


class Network:
    """A bridge in the root namespace and the hosts on it (10.<a>.<b>.0/24, chosen at
    random so that two runs on one machine do not meet)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.tag = f"{random.randrange(1 << 16):04x}"
        a, b = random.randrange(100, 250), random.randrange(1, 250)
        self.subnet = f"10.{a}.{b}"
        self.bridge = f"tqb{self.tag}"
        self.hosts: dict[str, Host] = {}
        self._made: list[tuple[str, str]] = [("link", self.bridge)]
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    @property
    def gateway(self) -> str:
        """The root namespace's (the test's) address on the bridge."""
        return f"{self.subnet}.1"

    def add(self, name: str) -> Host:
        index = len(self.hosts) + 2
        namespace, link = f"tq{self.tag}-{name}", f"tqv{self.tag}{index:02d}"
        self._made.append(("netns", namespace))  # removed however far this gets
        ip("netns", "add", namespace)
        self._made.append(("link", link))
        ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        ip("link", "set", link, "master", self.bridge, "up")
        address = f"{self.subnet}.{index}"
        ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        folder = self.folder / name
        folder.mkdir(parents=True)
        os.chmod(folder, 0o755)
        host = Host(name, address, namespace, link, folder)
        self.hosts[name] = host
        return host

    def remove(self) -> None:
        for host in self.hosts.values():
            host.stop()
        for kind, name in reversed(self._made):
            what = ["netns", "del", name] if kind == "netns" else ["link", "del", name]
            subprocess.run(["ip", *what], capture_output=True)
