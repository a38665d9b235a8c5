"""A job across namespace nodes works as on real machines, and the harness leaves nothing behind.

- 2 nodes x 2 ranks, each node its own network, /dev/shm and runtime directory, one shared root:
  the ranks' gloo collective crosses the namespaces, each node's local rank 0 starts that node's
  daemon, a save commits and loads bit-exact on every rank; the coordinator listens on node 0's
  address at MASTER_PORT + 1 and nowhere else (not on loopback); each node's staging segments and
  daemon files live only in that node's private mounts, none in the host's /dev/shm;
- a root on each node's own disk (mounted alike everywhere, no shared filesystem) cannot hold a
  multi-node checkpoint: every save aborts on every rank with a reason that says so and what to
  use instead (a shared filesystem or s3://), and nothing is committed on either disk;
- the harness removes what it made, and sweeps what a killed harness left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ckptd.control.endpoints import default_job_id
from ckptd.format.commitrecord import read_commit_record
from ckptd.roots.nodelocal import NODE_FILES
from ckptd.s3catalog import committed_at, read_s3_commit_record
from ckptd.storage.s3client import S3Client
from tools.harness.netns import Cluster, sweep_stale
from tools.harness.waiting import wait_until

from .job import MASTER_PORT

_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)"


@pytest.mark.timeout(150)
def test_job_across_namespaces(make_job):
    job = make_job(2, per_node=2)
    cluster = job.cluster
    assert [o["sum"] for o in job.call("train")] == [10.0] * 4  # gloo all_reduce across the nodes
    job.save(1)
    job.committed(1)
    job.check(1)
    assert [o["latest"] for o in job.call("latest")] == [1] * 4

    node0 = cluster.nodes[0].address
    coordinator = job.status(0)["coordinator"]
    assert coordinator["address"] == f"tcp://{node0}:{MASTER_PORT + 1}"
    assert coordinator["nodes"] == [0, 1]
    assert job.status(1)["coordinator"] is None
    # Bound to node 0's address only: node 0's own loopback does not reach it, node 1 does.
    port = str(MASTER_PORT + 1)
    refused = cluster.nodes[0].run([sys.executable, "-c", _CONNECT, "127.0.0.1", port])
    assert refused.returncode != 0 and "Connection refused" in refused.stderr
    assert cluster.nodes[1].run([sys.executable, "-c", _CONNECT, node0, port]).returncode == 0

    job_id = default_job_id(job.root)
    for node in cluster.nodes:
        segments = sorted(os.listdir(node.path("/dev/shm")))
        assert segments and all(s.startswith(f"ckptd-{job_id}-n{node.index}-") for s in segments), segments
        files = sorted(os.listdir(node.path(cluster.runtime_dir)))
        assert f"{job_id}-n{node.index}.sock" in files and all(f"-n{node.index}." in f for f in files), files
    assert not [s for s in os.listdir("/dev/shm") if s.startswith(f"ckptd-{job_id}")]


@pytest.mark.timeout(120)
def test_a_root_on_each_nodes_own_disk_aborts_every_save_saying_why(make_job):
    job = make_job(2, local=True)
    job.save(1)
    for out in job.outcomes(1, timeout_s=30):
        assert out["outcome"] == "aborted", out
        assert "is missing, though its node reported it written" in out["reason"], out["reason"]
        assert "shared filesystem" in out["reason"] and "s3://" in out["reason"], out["reason"]
    assert [o["latest"] for o in job.call("latest")] == [None, None]
    # Nothing committed on either disk. The coordinator removes the aborted attempt's directory on
    # its own node's disk; the other node's stays until `ckptd gc` runs there.
    left = [[p for p in os.listdir(node.path(job.root)) if p.startswith("iter_")] for node in job.cluster.nodes]
    assert left[0] == [] and [p.endswith(".tmp") for p in left[1]] == [True], left


@pytest.mark.timeout(60)
def test_harness_removes_and_sweeps_everything(netns_available):
    cluster = Cluster.create(2)
    try:
        pids = [n.anchor_pid for n in cluster.nodes]
        assert cluster.leftovers() and all(cluster.nodes[i].pids() == [pids[i]] for i in range(2))
        cluster.nodes[1].kill()
        assert not cluster.nodes[1].up and not cluster.nodes[1].pids()
        cluster.nodes[1].boot()
        assert cluster.nodes[1].up
    finally:
        assert cluster.destroy() == []
    assert cluster.leftovers() == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)

    # What a harness killed outright leaves: found by the dead pid in its names, and removed.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"ckn{dead.pid}"
    subprocess.run(["ip", "netns", "add", f"{stale}-n0"], check=True)
    subprocess.run(["ip", "link", "add", f"{stale}b", "type", "bridge"], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"{stale}-n0", "sleep", "600"])

    def in_namespace() -> bool:  # ip has entered it (the sweep kills what is inside, not on the way)
        out = subprocess.run(["ip", "netns", "pids", f"{stale}-n0"], capture_output=True, text=True, check=False)
        return str(sleeper.pid) in out.stdout.split()

    wait_until(in_namespace, 30, "the sleeper in its namespace")
    stale_dir = Path(tempfile.gettempdir()) / f"{stale}-x"
    stale_dir.mkdir()
    try:
        removed = sweep_stale()
        assert {f"{stale}-n0", f"{stale}b", str(stale_dir)} <= set(removed)
        assert sleeper.wait(10) == -9
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
        assert stale not in names and stale not in links
    finally:
        sleeper.kill()
        subprocess.run(["ip", "netns", "del", f"{stale}-n0"], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", f"{stale}b"], capture_output=True, check=False)
    assert not stale_dir.exists()


@pytest.mark.timeout(180)
def test_a_node_local_root_commits_on_every_disk_mirrors_and_resumes_a_replaced_node(make_job, monkeypatch):
    """CKPTD_NODE_LOCAL (ckptd.roots.nodelocal): the same disks as above commit every save; each
    node's directory holds its own rank's file and the same metadata files, and both name it
    latest. Every node's daemon uploads its own file, and node 0's commits the mirror's copy.
    Each rank loads from its own disk; a replaced node's ranks read theirs from the mirror."""
    job = make_job(2, local=True, mirror=True)
    assert job.store is not None and job.mirror is not None
    for k, v in job.store.env().items():
        monkeypatch.setenv(k, v)
    job.save(1)
    job.committed(1)
    meta = []
    for node in job.cluster.nodes:
        disk = node.path(job.root)
        assert sorted(os.listdir(disk / "iter_0000001")) == sorted([f"__{node.index}_0.distcp", *NODE_FILES])
        assert (disk / "latest").read_text().strip() == "iter_0000001"
        meta.append({n: (disk / "iter_0000001" / n).read_bytes() for n in NODE_FILES})
    assert meta[0] == meta[1]
    mirror = job.mirror
    wait_until(lambda: committed_at(mirror, 1), 60, "the mirror's copy of step 1")
    local = read_commit_record(job.cluster.nodes[0].path(job.root) / "iter_0000001")
    copy = read_s3_commit_record(S3Client(mirror), "iter_0000001")
    assert local is not None and copy is not None and copy.source == {"seq": local.seq, "attempt": local.attempt}
    assert sorted(n for n in (copy.objects or {}) if n.endswith(".distcp")) == [
        f"__{r}_0.{copy.attempt}.distcp" for r in (0, 1)
    ]
    shown = wait_until(
        lambda: ((job.status(1) or {}).get("mirror") or {}).get("last_upload") and job.status(1)["mirror"],
        10,
        "node 1's mirror status to name its upload",
    )
    assert shown["node"] == 1 and shown["last_upload"]["step"] == 1 and shown["error"] is None, shown
    job.check(1)  # each rank reads its own node's disk (ckptd.storage.nodeview)

    # Node 1's machine is replaced: its disk comes back empty. The job resumes from step 1, rank 1
    # reading its file from the mirror, and saves on both disks again.
    job.save(2)
    job.committed(2)
    wait_until(lambda: committed_at(mirror, 2), 60, "the mirror's copy of step 2")
    job.stop_ranks()
    job.cluster.nodes[1].kill()
    job.cluster.nodes[1].boot()
    job.launch()
    assert [(o["step"], o["mismatch"]) for o in job.call("resume")] == [(2, None), (2, None)]
    job.save(3)
    job.committed(3)
    assert "__1_0.distcp" in os.listdir(job.cluster.nodes[1].path(job.root) / "iter_0000003")
