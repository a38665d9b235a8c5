"""Crash-matrix trials across namespace nodes (``tools/crash_matrix.py --netns``).

:class:`NetnsHosts` runs the trial of :mod:`tools.harness.crash_trial` on a fresh
:class:`~tools.harness.netns.Cluster` per trial: each node has its own network, /dev/shm and
runtime directory, the ranks reach node 0 at its address, and the job token is a random one. Two
victims only real nodes have join the common ones (a trainer rank, a node daemon, node 0's daemon
with the coordinator):

- ``machine``: every process of a random node is SIGKILLed (its trainers, snapshot children and
  daemon, and on node 0 the coordinator); the node boots again, empty, before the restart;
- ``link``: a random node is partitioned off inside the network for 0.5-4 s while the job saves.

The trainers are forked from the preloaded forkserver into their node (:mod:`tools.harness.nodeprocs`),
each writing its output to ``<phase>.r<rank>.out`` among the trial's events. Only this module ties
the crash matrix to namespaces.
"""

from __future__ import annotations

import os
import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.staging.segment import list_segments
from tools.harness import crash_job as cj
from tools.harness.crash_trial import VICTIMS
from tools.harness.netns import Cluster
from tools.harness.nodeprocs import NodeChild, start_in_node

REPO = str(Path(__file__).resolve().parents[2])
COORDINATOR_PORT = 29501  # each node has its own ports
NETNS_VICTIMS = (*VICTIMS, "machine", "link")


@dataclass
class NetnsHosts:
    victims: tuple[str, ...] = NETNS_VICTIMS
    cluster: Cluster | None = None
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    down: list[int] = field(default_factory=list)  # nodes killed as machines, booted by heal()

    def open(self, nodes: int) -> None:
        self.cluster = Cluster.create(nodes, cwd=REPO)

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
        }
        return {
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
        c = self._cluster()
        return [p for n in c.nodes if n.up for p in sorted(n.path(c.runtime_dir).glob("*.log"))]

    def close(self, prefix: str) -> None:
        if self.cluster is not None:
            self.cluster.destroy()
            self.cluster = None
