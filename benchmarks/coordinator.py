"""How the coordinator scales with the number of ranks: ``ckptd bench coordinator``.

A load generator plays R ranks on R / ``ranks_per_node`` node daemons against a real coordinator:
node 0's daemon started as ``ckptd daemon`` (its own process, default settings, fsync on, but not
niced, so that what is measured is the coordinator's work rather than the CPU left to it), reached
over real ``tcp://`` sockets with real CurveZMQ handshakes (keys from a random job token), one
DEALER per played node, as node daemons connect. For each save every rank's data file is a real
one (written once per R with the daemon's own writer: DCP item serialization, CRC-32C per item,
then hard-linked into each save's ``iter_<step>.<attempt>.tmp/``), and its WRITTEN carries the
records that writer returned (``items_per_rank`` row shards of a global tensor per rank, each a
record; rank 0 adds the common state). The coordinator does everything it does for a real job:
decodes and checks every report, validates coverage, writes ``common.pt``, ``.metadata`` and
``metadata.json``, checks every data file's size, renames, fsyncs, moves ``latest`` and
announces the verdict to every node.

Measured per R over ``commits`` saves, each of a new step:

- ``latency_min_s`` / ``latency_s`` (median) / ``latency_max_s``: from the last WRITTEN sent to
  the first STEP_COMMITTED received;
- ``coordinator_cpu_s`` (median): CPU time (user + system, all threads) of the coordinator's process
  from the first WRITTEN to the last verdict received; ``rss_mib`` / ``peak_rss_mib``: its
  resident memory after the saves (the daemon includes torch's import, ~150 MiB);
- ``metadata_nbytes``: size of the committed ``.metadata``;
- ``messages``: messages per commit on the coordinator's port (R WRITTEN in, one verdict out per
  node connection) and ``wire_nbytes`` of the WRITTENs.

It also fits the least latency = a + b * R and extrapolates. Nothing is asserted unless
``--check``: exit 1 when the least latency at the largest R is 1 s or more, or grows faster than R
between two sizes (by more than 25 %). The least latency is the coordinator's cost; a machine
shared with other work only ever adds to it (the median shows how much).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import zmq

from ckptd.control.channel import Channel, make_socket
from ckptd.control.codec import Codec
from ckptd.control.keys import derive_keys
from ckptd.control.netaddr import tcp_address
from ckptd.control.protocol import (
    Message,
    Ping,
    Pong,
    StepAborted,
    StepCommitted,
    Written,
)
from ckptd.format.finalize import serialize_common
from ckptd.format.items import plan_tensor_items, write_data_file
from ckptd.format.layout import data_file_name
from ckptd.format.records import ItemRecord
from ckptd.format.rootlayout import step_dir_name, tmp_dir
from ckptd.mapping import ShardedTensor
from tools.harness.ports import free_port

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
COMMIT_TIMEOUT_S = 300.0
ROWS, COLS = 2, 16  # each record: a 2 x 16 float32 row shard (128 bytes of data)
TARGET_LATENCY_S = 1.0
LINEAR_SLACK = 1.25


@dataclass(frozen=True)
class Point:
    """One size's measurements (medians over the commits, where several)."""

    ranks: int
    nodes: int
    records: int
    latency_s: float  # median
    latency_min_s: float
    latency_max_s: float
    coordinator_cpu_s: float
    rss_mib: float
    peak_rss_mib: float
    metadata_nbytes: int
    messages: int
    wire_nbytes: int
    send_s: float  # how long the generator took to send every WRITTEN of a commit


# --- the played job ----------------------------------------------------------------------------
def rank_files(directory: Path, ranks: int, items_per_rank: int) -> tuple[list[list[ItemRecord]], list[int]]:
    """Write every rank's real data file into ``directory``; returns each rank's stored records and
    file size. Rank ``r`` holds rows ``[r*ROWS, (r+1)*ROWS)`` of ``items_per_rank`` global tensors."""
    records, nbytes = [], []
    for rank in range(ranks):
        items = []
        for i in range(items_per_rank):
            data = torch.full((ROWS, COLS), float(rank * items_per_rank + i))
            items += plan_tensor_items(ShardedTensor.from_rank_offsets(f"layers.{i}.w", data, (0, rank, ranks)), rank)
        name = data_file_name(rank)
        stored = write_data_file(directory, name, items, fsync=False)
        records.append(list(stored))
        nbytes.append((directory / name).stat().st_size)
    return records, nbytes


class Coordinator:
    """Node 0's daemon (with the job's coordinator) in a process of its own."""

    def __init__(self, root: Path, runtime: Path, token: str) -> None:
        port = free_port()
        self.address = tcp_address("127.0.0.1", port)
        self.log_path = runtime / "coordinator.log"
        # At normal priority (a daemon yields to training with nice 10): this measures the
        # coordinator's own work, not how much CPU other processes leave it.
        env = {
            **os.environ,
            "CKPTD_JOB_TOKEN": token,
            "CKPTD_RUNTIME_DIR": str(runtime),
            "CKPTD_JOB_ID": "bench",
            "CKPTD_COORDINATOR_PORT": str(port),
            "CKPTD_COMMIT_TIMEOUT_S": str(COMMIT_TIMEOUT_S),
            "CKPTD_DAEMON_NICE": "0",
        }
        cmd = [
            sys.executable,
            "-m",
            "ckptd.cli",
            "daemon",
            "--root",
            str(root),
            "--node",
            "0",
            "--nnodes",
            "2",
            "--coordinator-bind",
            self.address,
            "--coordinator-connect",
            self.address,
        ]
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf)
        self.ps = psutil.Process(self.proc.pid)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"the coordinator exited {self.proc.returncode}: {self.log_path.read_text(errors='replace')[-2000:]}"
            )

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def memory_mib(self) -> tuple[float, float]:
        """Resident and peak resident memory (VmHWM)."""
        peak = 0.0
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) / 1024
        return self.ps.memory_info().rss / 2**20, peak

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)


class PlayedNodes:
    """One DEALER per played node daemon, connected to the coordinator with the job's keys."""

    def __init__(self, address: str, token: str, nodes: int, check_peer: Any) -> None:
        self.check_peer = check_peer  # raises when the coordinator is gone
        self.codec = Codec("bench")
        self.ctx = zmq.Context()
        keys = derive_keys(token.encode())
        self.links: list[Channel] = []
        self.poller = zmq.Poller()
        self.instance = ""  # the coordinator's, which every WRITTEN is addressed to (from its PONG)
        for node in range(nodes):
            sock = make_socket(
                self.ctx, zmq.DEALER, self.codec, keys, server=False, identity=f"node{node}-bench{os.getpid()}".encode()
            )
            sock.connect(address)
            self.links.append(Channel(sock, self.codec, f"node{node}"))
            self.poller.register(sock, zmq.POLLIN)

    def handshake(self, timeout_s: float) -> int:
        """PING on every connection until each has its PONG; the coordinator's pid (and its
        instance in :attr:`instance`)."""
        pending = set(range(len(self.links)))
        for link in self.links:
            link.send(Ping(nonce=0))
        pid = 0
        for i, msg in self._replies(pending, timeout_s, "PONG"):
            if isinstance(msg, Pong):
                pid, self.instance = msg.pid, msg.instance
                pending.discard(i)
        return pid

    def verdicts(self, step: int, timeout_s: float) -> float:
        """Wait until every connection has the verdict on ``step``; when the first arrived."""
        pending = set(range(len(self.links)))
        first = 0.0
        for i, msg in self._replies(pending, timeout_s, f"the verdict on step {step}"):
            if isinstance(msg, StepAborted) and msg.step == step:
                raise RuntimeError(f"the coordinator aborted step {step}: {msg.reason}")
            if isinstance(msg, StepCommitted) and msg.step == step:
                first = first or time.perf_counter()
                pending.discard(i)
        return first

    def _replies(self, pending: set[int], timeout_s: float, what: str) -> Any:
        index = {link.sock: i for i, link in enumerate(self.links)}
        deadline = time.monotonic() + timeout_s
        while pending:
            self.check_peer()
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise TimeoutError(
                    f"{len(pending)} of {len(self.links)} connections got no {what} within {timeout_s:.0f} s"
                )
            for sock, _ in self.poller.poll(min(remaining_ms, 1000)):
                i = index[sock]
                while True:
                    try:
                        _, msg, _ = self.links[i].recv()
                    except zmq.Again:
                        break
                    if msg is not None:
                        yield i, msg

    def send(self, node: int, msg: Message) -> int:
        frames = self.codec.encode(msg)
        self.links[node].sock.send_multipart(frames, copy=False)
        return sum(len(f) for f in frames)

    def close(self) -> None:
        for link in self.links:
            link.close()
        self.ctx.term()


def measure(ranks: int, ranks_per_node: int, items_per_rank: int, commits: int, workdir: Path) -> Point:
    """Start a coordinator, play ``commits`` saves of ``ranks`` ranks, measure, stop it."""
    nodes = math.ceil(ranks / ranks_per_node)
    base = Path(tempfile.mkdtemp(prefix=f"bench-coord-{ranks}-", dir=workdir))
    root, template = base / "root", base / "files"
    for d in (root, template):
        d.mkdir(mode=0o700)
    # the ipc socket's path must fit in 107 bytes, however deep the work directory is
    runtime = Path(tempfile.mkdtemp(prefix="ckbc", dir="/tmp"))
    token = secrets.token_hex(32)
    records, file_nbytes = rank_files(template, ranks, items_per_rank)
    coord = Coordinator(root, runtime, token)
    played = PlayedNodes(coord.address, token, nodes, coord.check_alive)
    try:
        pid = played.handshake(START_TIMEOUT_S)
        if pid != coord.proc.pid:
            raise RuntimeError(f"the coordinator answering is pid {pid}, not the one started ({coord.proc.pid})")
        runs = []
        for step in range(1, commits + 1):
            attempt = f"{secrets.token_hex(6)}-1"
            tmp = tmp_dir(root, step, attempt)
            tmp.mkdir()
            for rank in range(ranks):
                os.link(template / data_file_name(rank), tmp / data_file_name(rank))
            common = serialize_common({"iteration": step})
            cpu0 = coord.cpu_s()
            t0 = time.perf_counter()
            wire = 0
            for rank in range(ranks):
                wire += played.send(
                    rank // ranks_per_node,
                    Written(
                        step=step,
                        attempt=attempt,
                        rank=rank,
                        world_size=ranks,
                        node=rank // ranks_per_node,
                        records=records[rank],
                        common=common if rank == 0 else None,
                        common_digest="",
                        file_nbytes=file_nbytes[rank],
                        coordinator_instance=played.instance,
                    ),
                )
            t_last = time.perf_counter()
            first = played.verdicts(step, COMMIT_TIMEOUT_S)
            runs.append((first - t_last, coord.cpu_s() - cpu0, wire, t_last - t0))
        rss, peak = coord.memory_mib()
        meta = (root / step_dir_name(commits) / ".metadata").stat().st_size
    finally:
        played.close()
        coord.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
    latencies = [r[0] for r in runs]
    return Point(
        ranks,
        nodes,
        sum(len(r) for r in records),
        statistics.median(latencies),
        min(latencies),
        max(latencies),
        statistics.median(r[1] for r in runs),
        round(rss, 1),
        round(peak, 1),
        meta,
        ranks + nodes,
        runs[-1][2],
        statistics.median(r[3] for r in runs),
    )


# --- the report ----------------------------------------------------------------------------------
def linear_fit(points: list[Point]) -> tuple[float, float]:
    """Least-squares ``latency_min_s = a + b * ranks``; ``(a, b)``."""
    xs, ys = [p.ranks for p in points], [p.latency_min_s for p in points]
    if len(points) < 2:
        return 0.0, ys[0] / xs[0]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def missed_targets(points: list[Point]) -> list[str]:
    """The targets, on the least latency of each size's commits (what the coordinator needs;
    a shared machine only ever adds to it): under 1 s at the largest size, and growing no faster
    than the ranks (25 % slack) from one size to the next."""
    missed = []
    last = points[-1]
    if last.latency_min_s >= TARGET_LATENCY_S:
        missed.append(f"latency {last.latency_min_s:.3f} s at {last.ranks} ranks (target < {TARGET_LATENCY_S} s)")
    for a, b in itertools.pairwise(points):
        if b.latency_min_s > a.latency_min_s * (b.ranks / a.ranks) * LINEAR_SLACK:
            missed.append(
                f"latency grows faster than the ranks from {a.ranks} to {b.ranks}: "
                f"{a.latency_min_s:.4f} -> {b.latency_min_s:.4f} s"
            )
    return missed


def table(points: list[Point]) -> str:
    head = (
        "ranks",
        "nodes",
        "records",
        "latency min s",
        "median s",
        "max s",
        "coord CPU s",
        "RSS MiB",
        "peak MiB",
        ".metadata B",
        "messages",
        "WRITTEN B",
        "send s",
    )
    rows = [
        (
            p.ranks,
            p.nodes,
            p.records,
            f"{p.latency_min_s:.4f}",
            f"{p.latency_s:.4f}",
            f"{p.latency_max_s:.4f}",
            f"{p.coordinator_cpu_s:.3f}",
            f"{p.rss_mib:.0f}",
            f"{p.peak_rss_mib:.0f}",
            p.metadata_nbytes,
            p.messages,
            p.wire_nbytes,
            f"{p.send_s:.3f}",
        )
        for p in points
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(r, widths)) for r in [head, *rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ckptd bench coordinator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="64,256,1024,4096", help="comma-separated rank counts (R)")
    ap.add_argument("--ranks-per-node", type=int, default=8, help="ranks per played node daemon")
    ap.add_argument("--items-per-rank", type=int, default=4, help="records in each rank's WRITTEN")
    ap.add_argument("--commits", type=int, default=5, help="saves per R (least, median and most latency)")
    ap.add_argument("--extrapolate", type=int, default=10_000, help="ranks to extrapolate the fit to")
    ap.add_argument("--dir", default=None, help="where roots are made (default: the system temp dir)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)
    try:
        sizes = sorted(int(r) for r in args.ranks.split(","))
    except ValueError:
        ap.error(f"--ranks {args.ranks!r}: give comma-separated integers")
    if not sizes or sizes[0] < 1 or args.ranks_per_node < 1 or args.items_per_rank < 1 or args.commits < 1:
        ap.error("ranks, --ranks-per-node, --items-per-rank and --commits must be positive")
    workdir = Path(args.dir or tempfile.gettempdir())
    points = []
    for ranks in sizes:
        points.append(measure(ranks, args.ranks_per_node, args.items_per_rank, args.commits, workdir))
        if not args.json:
            print(f"{ranks} ranks: latency {points[-1].latency_min_s:.4f} s", file=sys.stderr, flush=True)
    a, b = linear_fit(points)
    missed = missed_targets(points)
    if args.json:
        json.dump(
            {
                "points": [asdict(p) for p in points],
                "fit": {"intercept_s": a, "per_rank_s": b},
                "extrapolated": {"ranks": args.extrapolate, "latency_s": a + b * args.extrapolate},
                "settings": {
                    "ranks_per_node": args.ranks_per_node,
                    "items_per_rank": args.items_per_rank,
                    "commits": args.commits,
                },
                "missed": missed,
            },
            sys.stdout,
            indent=1,
        )
        print()
    else:
        print(table(points))
        print(
            f"\nfit of the least latencies: {a * 1000:.2f} ms + {b * 1e6:.2f} us x ranks; at "
            f"{args.extrapolate:,} ranks {a + b * args.extrapolate:.3f} s"
        )
        for m in missed:
            print(f"target missed: {m}")
    return 1 if args.check and missed else 0
