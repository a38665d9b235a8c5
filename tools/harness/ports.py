"""Free TCP ports on loopback for tests, harnesses and benchmarks.

``free_port()`` is a port the kernel just handed out as free: free now, so the caller binds it
soon (another process could take it meanwhile; the kernel's ephemeral allocator makes that rare).
``port_is_free(port)`` says whether a given port can be bound now (a server that needs several
ports in a fixed relation, tools/harness/seaweed.py, checks each).
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port on ``host`` that no socket holds now."""
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
