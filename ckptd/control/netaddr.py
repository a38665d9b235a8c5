"""Where the coordinator listens: on the interface that reaches MASTER_ADDR, never on all of them.

Node daemons reach the coordinator at ``MASTER_ADDR`` (or ``CKPTD_COORDINATOR_HOST``). Node 0's
daemon binds the local address of this machine's route to that host: the host itself when it is
one of this machine's addresses, loopback when it is loopback, and loopback for single-node jobs.
Other networks of the machine (a management network, a public interface) never see the port.
"""

from __future__ import annotations

import ipaddress
import socket

from ..errors import CkptdError

LOOPBACK = "127.0.0.1"


def coordinator_bind_host(host: str, nnodes: int) -> str:
    """The address node 0's coordinator binds for a job of ``nnodes`` nodes reaching it at ``host``."""
    if nnodes <= 1:
        return LOOPBACK
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise CkptdError(
            f"cannot resolve the coordinator host {host!r} (MASTER_ADDR or CKPTD_COORDINATOR_HOST): {exc}"
        ) from None
    family, _, _, _, sockaddr = infos[0]
    ip = str(sockaddr[0])
    if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
        return ip
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            # A UDP connect sends nothing: the kernel only picks the route and its source address.
            probe.connect((ip, 9) if family == socket.AF_INET else (ip, 9, 0, 0))
        except OSError as exc:
            raise CkptdError(
                f"no route from this machine to the coordinator host {host} ({ip}): {exc}; "
                "set MASTER_ADDR (or CKPTD_COORDINATOR_HOST) to an address node 0 has"
            ) from None
        return str(probe.getsockname()[0])


def tcp_address(host: str, port: int) -> str:
    """``tcp://host:port``, with an IPv6 literal in brackets as ZeroMQ wants it."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def is_ipv6(address: str) -> bool:
    """Whether ``tcp://...`` names an IPv6 endpoint (a socket binding or connecting to it needs
    ZeroMQ's IPV6 option set first)."""
    return address.startswith("tcp://[") or address.count(":") > 2


def tcp_port(address: str) -> int:
    """The port of a ``tcp://HOST:PORT`` address (0: any free port); CkptdError for anything else."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not (address.startswith("tcp://") and sep and host and port.isascii() and port.isdigit() and int(port) < 65536):
        raise CkptdError(f"coordinator address {address!r}: use tcp://HOST:PORT")
    return int(port)
