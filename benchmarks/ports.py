"""Ports for the servers a bench or a test starts."""

from __future__ import annotations

import contextlib
import random
import socket
from functools import cache
from pathlib import Path

SPAN = 12_000  # how many ports below the ephemeral range are drawn from


@cache
def _below_ephemeral() -> tuple[int, int]:
    """The range drawn from: the SPAN ports under the kernel's ephemeral range (Linux's
    ip_local_port_range; 32768 where it cannot be read), never below 1024."""
    try:
        start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = 32768
    return max(1024, start - SPAN), start


def free_ports(n: int) -> int:
    """The first of `n` consecutive ports free on 127.0.0.1, drawn below the kernel's
    ephemeral range. A port `bind(0)` hands out is one the kernel may also give an outgoing
    connection as its source before the server that was told it binds it (SeaweedFS's filer
    lost its gRPC port to one of its own connections that way); below the range no outgoing
    connection takes one meanwhile."""
    low, high = _below_ephemeral()
    for _ in range(200):
        first = random.randrange(low, high - n)
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + n):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return first
    raise RuntimeError(f"no {n} consecutive free ports")


def free_port() -> int:
    """A port free on 127.0.0.1 for a server to be started (see `free_ports`)."""
    return free_ports(1)
