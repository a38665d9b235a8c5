"""Fixtures of the namespace-node tests: a job across N nodes, always cleaned up.

Every test here skips, with the reason, where namespaces cannot be made (not root, ``ip`` or
``nsenter`` missing, the kernel refusing); the loopback multi-node tests of tests/fault run anyway.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.control.endpoints import default_job_id
from ckptd.staging.segment import list_segments
from ckptd.storage.url import Location, S3Location
from tools.harness.netns import Cluster, NetnsUnavailable, unavailable_reason
from tools.harness.seaweed import SeaweedServer

from .job import NetnsJob

REPO = str(Path(__file__).resolve().parents[2])
# Short bounds, so that every fault resolves within seconds: link timeout max(4 x 0.1, 3 / 3) = 1 s.
FAST = {
    "CKPTD_HEARTBEAT_S": "0.1",
    "CKPTD_COMMIT_TIMEOUT_S": "4",
    "CKPTD_COORDINATOR_TIMEOUT_S": "3",
    "CKPTD_IDLE_EXIT_S": "120",
    "CKPTD_REQUEST_TIMEOUT_S": "20",
}


@pytest.fixture(scope="session")
def netns_available() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"namespace nodes unavailable: {reason}")


@pytest.fixture
def make_job(netns_available: None, tmp_path: Path) -> Iterator[Callable[..., NetnsJob]]:
    """``make_job(nnodes, per_node=1, s3=False, local=False, mirror=False, **settings)``: a cluster
    and a job on it, ranks launched; with ``s3`` the root is an ``s3://`` prefix of a real server
    (SeaweedFS) on the host's address on the nodes' bridge (``job.store``), with ``local`` a
    directory on each node's own local disk (the same path everywhere, different contents), and
    with ``mirror`` as well that local root is node-local (``CKPTD_NODE_LOCAL``) with a mirror on
    such a server (``job.mirror``).
    At the end: logs copied to ``tmp_path/logs``, ranks stopped, everything the cluster made
    removed; the test fails if anything of it, or a staging segment in the host's /dev/shm, is
    left."""
    clusters: list[Cluster] = []
    made: list[NetnsJob] = []

    def make(
        nnodes: int,
        per_node: int = 1,
        launch: bool = True,
        s3: bool = False,
        local: bool = False,
        mirror: bool = False,
        **settings: str,
    ) -> NetnsJob:
        try:
            cluster = Cluster.create(nnodes, cwd=REPO)
        except NetnsUnavailable as exc:
            pytest.skip(f"namespace nodes unavailable: {exc}")
        clusters.append(cluster)  # destroyed at the end even if the store below fails to start
        root: Location = cluster.local_disk / "ckpts" if local else tmp_path / "ckpts"
        store = None
        url = None
        if s3 or mirror:  # a real S3 server on the host's address on the bridge: a node's link down cuts it off
            store = SeaweedServer(tmp_path / "weed", ip=cluster.host_address())
            stores.append(store)
            store.start()
            bucket = f"n{secrets.token_hex(6)}"
            store.create_bucket(bucket)
            url = S3Location(bucket=bucket, prefix="job")
            if mirror:
                settings = {"CKPTD_MIRROR": str(url), "CKPTD_NODE_LOCAL": "1", **settings}
            else:
                root = url
            settings = {**store.env(), **settings}
        job = NetnsJob(cluster, root, per_node, {**FAST, **settings}, store=store, mirror=url if mirror else None)
        made.append(job)
        if launch:
            job.launch()
        return job

    stores: list[SeaweedServer] = []
    yield make
    problems: list[str] = []
    # Each step on its own: one that fails must not leave the others' jobs running or the
    # clusters' bridges behind (a later test on this worker could not make its own then).
    steps: list[tuple[str, Callable[[], Any]]] = []
    for job in made:
        steps += [("collect logs", lambda job=job: job.collect_logs(tmp_path / "logs")), ("close job", job.close)]
    # a store's data is the test's: SIGKILL (SIGTERM waits 15 s on a store cut off mid-save)
    steps += [("kill store", store.kill) for store in stores]
    steps += [("destroy cluster", lambda c=c: problems.extend(c.destroy() + c.leftovers())) for c in clusters]
    steps += [
        ("segments", lambda job=job: problems.extend(list_segments(f"ckptd-{default_job_id(job.root)}-")))
        for job in made
    ]
    for what, step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - reported below, after every other step ran
            problems.append(f"{what}: {type(exc).__name__}: {exc}")
    assert not problems, f"left behind: {problems}"
