"""Crash-matrix trials across namespace nodes (``tools/crash_matrix.py --netns``).

:class:`NetnsHosts` runs the trial of :mod:`tools.harness.crash_trial` on a fresh
:class:`~tools.harness.netns.Cluster` per trial: each node has its own network, /dev/shm and
runtime directory, the ranks reach node 0 at its address, and the job token is a random one. Two
victims only real nodes have join the common ones (a trainer rank, a node daemon, node 0's daemon
with the coordinator):

- ``machine``: every process of a random node is SIGKILLed (its trainers, snapshot children and
  daemon, and on node 0 the coordinator); the node boots again, empty, before the restart;
- ``link``: a random node is partitioned off inside the network for 0.5-4 s while the job saves.

With ``node_local`` (``--node-local``) the root is each node's own disk (``CKPTD_NODE_LOCAL``:
ckptd.roots.nodelocal) with a mirror in a real object store (SeaweedFS on the host's address on
the trial's bridge, started per trial), and a killed machine boots with an empty disk: a
replaced node. Its checks: tools/harness/crash_nodelocal.py.

The trainers are forked from the preloaded forkserver into their node (:mod:`tools.harness.nodeprocs`),
each writing its output to ``<phase>.r<rank>.out`` among the trial's events. Only this module ties
the crash matrix to namespaces.
"""

from __future__ import annotations

import os
import random
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.staging.segment import list_segments
from tools.harness import crash_job as cj
from tools.harness.crash_trial import VICTIMS
from tools.harness.netns import Cluster
from tools.harness.nodeprocs import NodeChild, start_in_node
from tools.harness.seaweed import SeaweedServer

REPO = str(Path(__file__).resolve().parents[2])
COORDINATOR_PORT = 29501  # each node has its own ports
NETNS_VICTIMS = (*VICTIMS, "machine", "link")


@dataclass
class NodeLocalDisks:
    """A trial's node-local layout, for its checks: each node's disk as the host reaches it, the
    mirror, and the nodes whose machines were killed (booted with empty disks)."""

    cluster: Cluster
    mirror: str
    replaced: list[int] = field(default_factory=list)

    def disks(self, root: str) -> list[Path]:
        return [n.path(root) for n in self.cluster.nodes]


@dataclass
class NetnsHosts:
    victims: tuple[str, ...] = NETNS_VICTIMS
    cluster: Cluster | None = None
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    down: list[int] = field(default_factory=list)  # nodes killed as machines, booted by heal()
    with_node_local: bool = False
    node_local: NodeLocalDisks | None = None
    store: SeaweedServer | None = None

    def open(self, nodes: int) -> None:
        self.cluster = Cluster.create(nodes, cwd=REPO)
        if self.with_node_local:
            workdir = Path(tempfile.mkdtemp(prefix="crash-weed-"))
            self.store = SeaweedServer(workdir, ip=self.cluster.host_address())
            self.store.start()  # kept first: close() removes its directory even if this fails
            self.store.create_bucket("crash")
            os.environ.update(self.store.env())  # the checks read the mirror from this process
            self.node_local = NodeLocalDisks(self.cluster, "s3://crash/job")

    def _cluster(self) -> Cluster:
        if self.cluster is None:
            raise RuntimeError("open() the hosts first")
        return self.cluster

    def job_fields(self) -> dict[str, Any]:
        c = self._cluster()
        env = {
            "CKPTD_RUNTIME_DIR": str(c.runtime_dir),
            "CKPTD_COORDINATOR_PORT": str(COORDINATOR_PORT),
            "CKPTD_JOB_TOKEN": self.token,
            # The trainers' gloo group (the ranks agree on the checkpoint to resume from through
            # it): node 0's address (MASTER_ADDR), each node has its own ports.
            "MASTER_PORT": "29500",
            "GLOO_SOCKET_IFNAME": "eth0",
        }
        fields: dict[str, Any] = {}
        if self.node_local is not None and self.store is not None:
            # A copy round (and a resume waiting for one) gets far longer than the trial's commit timeout.
            env.update(
                {
                    **self.store.env(),
                    "CKPTD_NODE_LOCAL": "1",
                    "CKPTD_MIRROR": self.node_local.mirror,
                    "CKPTD_MIRROR_TIMEOUT_S": "60",
                }
            )
            fields["root"] = str(c.local_disk / "ckpts")
        return {
            **fields,
            "env": env,
            "master_addr": c.nodes[0].address,
            "node_runtime_dirs": tuple(str(n.path(c.runtime_dir)) for n in c.nodes),
        }

    def start(self, spec: cj.JobSpec, phase: str) -> list[NodeChild]:
        c = self._cluster()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return [
            start_in_node(
                c.nodes[rank // spec.per_node],
                cj.trainer,
                (rank, spec, phase),
                env,
                output=str(Path(spec.events) / f"{phase}.r{rank}.out"),
            )
            for rank in range(spec.ranks)
        ]

    def fault(self, victim: str, spec: cj.JobSpec, rng: random.Random) -> str:
        c = self._cluster()
        if victim == "machine":
            node = rng.randrange(spec.nodes)
            c.nodes[node].kill()
            self.down.append(node)
            if self.node_local is not None:
                self.node_local.replaced.append(node)
            return f"node {node} machine (every process)"
        if victim == "link":
            node = rng.randrange(spec.nodes)
            partition_s = rng.uniform(0.5, 4.0)
            c.nodes[node].isolate()
            try:
                time.sleep(partition_s)  # the fault's random length (the job saves meanwhile)
            finally:
                c.nodes[node].rejoin()
            return f"node {node} partitioned off for {partition_s:.1f} s"
        raise ValueError(f"no victim {victim!r} on namespace nodes")

    def heal(self) -> None:
        c = self._cluster()
        while self.down:
            c.nodes[self.down.pop()].boot()

    def segments(self, prefix: str) -> list[str]:
        """Segments left in any node's /dev/shm, and in the host's (where none may ever be)."""
        c = self._cluster()
        found = [f"host:{n}" for n in list_segments(prefix)]
        for node in c.nodes:
            if node.up:
                found += [f"node{node.index}:{n}" for n in os.listdir(node.path("/dev/shm")) if n.startswith(prefix)]
        return found

    def logs(self) -> list[Path]:
        if self.cluster is None:  # open() failed: nothing ran, and the trial's own error is the one to show
            return []
        c = self.cluster
        return [p for n in c.nodes if n.up for p in sorted(n.path(c.runtime_dir).glob("*.log"))]

    def close(self, prefix: str) -> None:
        if self.cluster is not None:
            self.cluster.destroy()
            self.cluster = None
        if self.store is not None:
            self.store.kill()
            self.store.remove()
            self.store = None
