"""A checkpointing job across namespace nodes, driven step by step from the test.

:class:`NetnsJob` launches ``per_node`` trainer ranks (:mod:`tests.netns.agent`, forked from the
preloaded forkserver into the node: tools.harness.nodeprocs) on every node of
a :class:`~tools.harness.netns.Cluster` with the variables torchrun gives them (``GROUP_RANK``,
``MASTER_ADDR`` = node 0's address, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``) plus one random ``CKPTD_JOB_TOKEN``; each node's local rank 0 starts that
node's daemon, node 0's hosts the coordinator. The test then sends commands to chosen ranks
(:meth:`call`), switches a node's disk faults (:meth:`fault`, the daemon's
``CKPTD_DEBUG_FAULT_FILE``), and watches each node's daemon through its status (:meth:`status`,
what ``ckptd status`` shows, asked over the daemon's own socket in the node's private runtime
directory) to act inside a chosen window of a save: every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptd.client.admin import LocalDaemon, daemon_status
from ckptd.config import CkptdConfig
from ckptd.control.endpoints import Endpoints, JobEnv
from ckptd.control.pidfile import daemon_alive, daemon_pid
from ckptd.errors import DaemonError
from ckptd.storage.url import Location, S3Location
from tools.harness.netns import Cluster, Node
from tools.harness.nodeprocs import NodeChild, start_in_node
from tools.harness.seaweed import SeaweedServer

from . import agent

REPO = str(Path(__file__).resolve().parents[2])
MASTER_PORT = 29500  # each node has its own ports: no clash with the host or other clusters
LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "LOCAL_ADDR",
)
START_TIMEOUT_S = 90.0
REPLY_TIMEOUT_S = 60.0


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05) -> Any:
    """Poll ``cond`` until it returns something true (returned); AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def base_env() -> dict[str, str]:
    """This process's environment without any launcher's or ckptd's settings."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CKPTD_", "TORCHELASTIC_", "SLURM_")) and k not in LAUNCH_VARS
    }


@dataclass
class RankProc:
    """One trainer rank on a node, spoken to through its stdin/stdout (one JSON line each way)."""

    rank: int
    node: Node
    proc: NodeChild
    buffer: bytes = b""

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def reply(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"rank {self.rank} (node {self.node.index}) did not answer within {timeout_s:.0f} s"
                )
            if select.select([fd], [], [], remaining)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(
                        f"rank {self.rank} (node {self.node.index}) exited ({self.proc.poll()}) without answering"
                    )
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        out = json.loads(line)
        if not out.get("ok"):
            raise AssertionError(f"rank {self.rank} (node {self.node.index}): {out.get('error')}\n{out.get('tb', '')}")
        return out

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.reply(timeout_s)
                self.proc.wait(timeout_s)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait(timeout_s)


@dataclass
class NetnsJob:
    cluster: Cluster
    root: Location
    per_node: int = 1
    settings: dict[str, str] = field(default_factory=dict)  # CKPTD_* of ranks and daemons
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    launches: int = 0
    ranks: list[RankProc] = field(default_factory=list)
    store: SeaweedServer | None = None  # the S3 server of an s3:// root or of a mirror
    mirror: S3Location | None = None  # a node-local root's mirror

    @property
    def world(self) -> int:
        return self.per_node * self.cluster.nnodes

    @property
    def base(self) -> Path:
        assert self.cluster.base is not None
        return self.cluster.base

    def fault_file(self, node: int) -> Path:
        return self.base / f"faults-n{node}"

    def log_file(self, rank: int) -> Path:
        return self.base / f"launch{self.launches}-rank{rank}.log"

    def rank_env(self, rank: int) -> dict[str, str]:
        node = rank // self.per_node
        return {
            **base_env(),
            **self.settings,
            "PYTHONPATH": REPO,
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "eth0",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % self.per_node),
            "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(self.per_node),
            "GROUP_RANK": str(node),
            "MASTER_ADDR": self.cluster.nodes[0].address,
            "MASTER_PORT": str(MASTER_PORT),
            "CKPTD_JOB_TOKEN": self.token,
            "CKPTD_RUNTIME_DIR": str(self.cluster.runtime_dir),
            "CKPTD_DEBUG_FAULT_FILE": str(self.fault_file(node)),
            "CKPTD_RUN_ID": f"launch{self.launches}",
            "CKN_LOG": str(self.log_file(rank)),
        }

    # --- ranks ------------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start every rank (a new launch: its own CKPTD_RUN_ID), wait until each is ready."""
        self.stop_ranks()
        self.launches += 1
        self.ranks = []
        for rank in range(self.world):
            node = self.cluster.nodes[rank // self.per_node]
            proc = start_in_node(node, agent.main, (str(self.root),), self.rank_env(rank))
            self.ranks.append(RankProc(rank, node, proc))
        for r in self.ranks:
            r.reply(START_TIMEOUT_S)

    def call(
        self, op: str, ranks: Iterable[int] | None = None, reply_timeout_s: float = REPLY_TIMEOUT_S, **args: Any
    ) -> list[dict[str, Any]]:
        """Send ``op`` to ``ranks`` (default: all) at once, then collect their replies in order."""
        chosen = [self.ranks[r] for r in (range(self.world) if ranks is None else ranks)]
        for r in chosen:
            r.send({"op": op, **args})
        return [r.reply(reply_timeout_s) for r in chosen]

    def on_node(self, node: int) -> list[int]:
        return [r for r in range(self.world) if r // self.per_node == node]

    def save(self, step: int, ranks: Iterable[int] | None = None) -> None:
        self.call("save", ranks, step=step)

    def outcomes(self, step: int, ranks: Iterable[int] | None = None, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        return self.call("wait", ranks, reply_timeout_s=timeout_s + 10, step=step, timeout_s=timeout_s)

    def committed(self, step: int, ranks: Iterable[int] | None = None, timeout_s: float = 60.0) -> None:
        """Require that every rank's save of ``step`` commits."""
        for r, out in enumerate(self.outcomes(step, ranks, timeout_s)):
            assert out["outcome"] == "committed", f"rank {r}: step {step} {out['outcome']}: {out['reason']}"

    def check(self, step: int, ranks: Iterable[int] | None = None) -> None:
        """Require that ``step`` loads bit-exact on every rank."""
        for out in self.call("check", ranks, step=step):
            assert out["mismatch"] is None, out["mismatch"]

    def kill_ranks(self, ranks: Iterable[int]) -> None:
        for r in ranks:
            self.ranks[r].proc.kill()
            self.ranks[r].proc.wait(10)

    def stop_ranks(self) -> None:
        for r in self.ranks:
            r.stop()

    # --- daemons, seen from the host --------------------------------------------------------------
    def endpoints(self, node: int) -> tuple[Endpoints, CkptdConfig]:
        """Node ``node``'s daemon endpoints with its private runtime directory reached from here."""
        n = self.cluster.nodes[node]
        config = CkptdConfig.from_env({}, runtime_dir=str(n.path(self.cluster.runtime_dir)), job_token=self.token)
        return replace(Endpoints.for_job(self.root, JobEnv(), config), node=node), config

    def status(self, node: int, timeout_s: float = 5.0) -> dict[str, Any] | None:
        """Node ``node``'s daemon STATUS (as ``ckptd status`` shows it), None when none runs."""
        if not self.cluster.nodes[node].up:
            return None
        ep, config = self.endpoints(node)
        if not daemon_alive(ep.pid_path):
            return None
        try:
            return daemon_status(LocalDaemon(node, ep, daemon_pid(ep.pid_path)), config, timeout_s)
        except DaemonError:
            return None

    def coordinator_steps(self) -> dict[str, Any]:
        info = self.status(0)
        return ((info or {}).get("coordinator") or {}).get("steps") or {}

    def fault(self, node: int, rules: str) -> None:
        """Set node ``node``'s daemon disk faults (ckptd.daemon.faults) to ``rules`` ('' clears)."""
        path = self.fault_file(node)
        if rules:
            tmp = path.with_suffix(".new")
            tmp.write_text(rules + "\n")
            tmp.rename(path)  # the daemon reads it at every open: never half a rule
        else:
            path.unlink(missing_ok=True)

    def quiet(self, timeout_s: float = 30.0) -> None:
        """Wait until no live daemon has a write, a step or a commit in flight."""

        def idle() -> bool:
            for node in range(self.cluster.nnodes):
                info = self.status(node)
                if info and (
                    info["jobs_in_flight"] or info["pending_steps"] or (info.get("coordinator") or {}).get("steps")
                ):
                    return False
            return True

        wait_until(idle, timeout_s, "every daemon to finish its writes and steps")

    def collect_logs(self, dest: Path) -> None:
        """Copy every rank's log and every live node's daemon logs (in its private runtime
        directory) to ``dest``, for the story of a failure."""
        dest.mkdir(parents=True, exist_ok=True)
        for path in self.base.glob("*.log"):
            shutil.copy(path, dest / path.name)
        for node in self.cluster.nodes:
            if node.up:
                for path in node.path(self.cluster.runtime_dir).glob("*.log"):
                    shutil.copy(path, dest / f"node{node.index}-{path.name}")

    def close(self) -> None:
        self.stop_ranks()
        self.ranks = []
