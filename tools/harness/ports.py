"""Free TCP ports on loopback for tests, harnesses and benchmarks.

``free_port()`` is a port no socket holds now, chosen below the kernel's ephemeral range
(``ip_local_port_range``): the caller hands it to a server that binds it later (a coordinator's
``CKPTD_COORDINATOR_PORT``, a benchmark's rendezvous). A port the kernel hands out as free
(``bind(("", 0))``) is in that range, where any socket's ``bind(0)`` or outgoing connection
(a gloo rank's, a store client's, an S3 client's) may be given it before the server binds it.
Below the range only another caller of this module can take it, at random among ~20,000 ports.
``port_is_free(port)`` says whether a given port can be bound now (a server that needs several
ports in a fixed relation, tools/harness/seaweed.py, checks each).
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
LOWEST_PORT = 10000  # below: well-known and registered services' ports


def ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (``bind(0)``, outgoing connections)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = LOOPBACK) -> int:
    """A port on ``host`` that no socket holds now, below the kernel's ephemeral range (else, with
    an unusual range, one the kernel chose)."""
    high = ephemeral_low()
    if high - LOWEST_PORT >= 1000:
        for _ in range(200):
            port = LOWEST_PORT + secrets.randbelow(high - LOWEST_PORT)
            if port_is_free(port, host):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """``port`` on ``host`` can be bound now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
