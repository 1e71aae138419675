"""Ports for the servers a bench or a test starts."""

from __future__ import annotations

import contextlib
import random
import socket


def free_ports(n: int) -> int:
    """The first of `n` consecutive ports free on 127.0.0.1, drawn below the kernel's
    ephemeral range. A port `bind(0)` hands out is one the kernel may also give an outgoing
    connection as its source before the server that was told it binds it (SeaweedFS's filer
    lost its gRPC port to one of its own connections that way); below the range no outgoing
    connection takes one meanwhile."""
    for _ in range(200):
        first = random.randrange(20000, 32000 - n)
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
