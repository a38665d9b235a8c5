"""The test server itself: its ports stay clear of the kernel's ephemeral range, and a port taken
between the choice and weed's bind (by any process on the machine) starts it on other ports
instead of failing the test that needed a store (a CI run lost four tests to that)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tools.harness.seaweed import SeaweedServer, _port_range


def test_ports_and_their_grpc_twins_lie_below_the_ephemeral_range():
    low, high = _port_range()
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert 1024 <= low < high
    if ephemeral_low >= 21000:  # room below it for 1000 pairs (Linux's default: 32768)
        assert high + 10000 <= ephemeral_low
    else:
        assert high + 10000 <= 65536


@pytest.mark.timeout(120)
def test_a_port_taken_before_weed_binds_it_starts_the_server_on_other_ports(tmp_path):
    server = SeaweedServer(tmp_path / "weed")
    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", server.ports["filer"]))
        squatter.listen()
        taken = server.ports["filer"]
        server.start(timeout_s=60)
        assert server.ports["filer"] != taken
        assert server.endpoint.endswith(f":{server.ports['s3']}")
        server.create_bucket("after-a-taken-port")
        assert b"Port allocation failed" in (tmp_path / "weed" / "weed.log").read_bytes()
    finally:
        squatter.close()
        server.remove()
