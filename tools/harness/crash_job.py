"""The training job of the crash matrix: what one rank does, and the state it saves.

A job is ``ranks`` trainer processes spread over ``nodes`` nodes (distinct GROUP_RANKs on this
machine, or namespace nodes: tools/harness/netns_hosts.py), each with its own node daemon, node 0's
hosting the coordinator. Every rank saves a small sharded state whose every value is a function of
the step, so any checkpoint can be checked bit for bit without remembering what was saved. Each
rank appends what it observes to its own event file *as it happens* (one ``O_APPEND`` write per
line, so a SIGKILL never leaves half a line): ``saved``, ``committed``, ``aborted``,
``save_error``, ``resumed``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import ckptd
from ckptd import ShardedObject, ShardedTensor
from ckptd.config import CkptdConfig
from ckptd.control.endpoints import Endpoints, JobEnv
from tools.harness.waiting import wait_until

ROWS_PER_RANK, COLS = 4, 32
BIG_ROWS_PER_RANK, BIG_COLS = 32, 256  # 32 KiB per rank: writes take real time


@dataclass(frozen=True)
class JobSpec:
    """Everything a rank process needs (picklable: it crosses into forkserver children)."""

    root: str
    events: str  # directory of the per-rank event files
    ranks: int
    nodes: int
    env: dict[str, str]  # CKPTD_* knobs shared by ranks and the daemons they start
    steps: int = 12  # saves per phase-1 rank
    interval_s: float = 0.08  # training time between saves
    restart_steps: int = 2  # saves after a restart, each of which must commit
    master_addr: str = "127.0.0.1"  # node 0's address, as the ranks reach it
    # Each node's runtime directory as the harness reaches it, where nodes do not share one
    # (namespace nodes: tools/harness/netns.py); empty: CKPTD_RUNTIME_DIR of ``env`` for every node.
    node_runtime_dirs: tuple[str, ...] = ()

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes

    def rank_env(self, rank: int, phase: str) -> dict[str, str]:
        """torchrun's variables for ``rank``, plus the job's CKPTD_* knobs; each phase is a launch
        of its own (CKPTD_RUN_ID), as a launcher restarting the job would make it."""
        return {
            **self.env,
            "RANK": str(rank),
            "WORLD_SIZE": str(self.ranks),
            "LOCAL_RANK": str(rank % self.per_node),
            "LOCAL_WORLD_SIZE": str(self.per_node),
            "GROUP_RANK": str(rank // self.per_node),
            "MASTER_ADDR": self.master_addr,
            "CKPTD_RUN_ID": f"{Path(self.root).name}-{phase}",
        }

    def endpoints(self, node: int) -> Endpoints:
        """Node ``node``'s daemon files as the harness reaches them."""
        job = JobEnv(
            rank=node * self.per_node,
            local_rank=0,
            world_size=self.ranks,
            local_world_size=self.per_node,
            node=node,
            master_addr="127.0.0.1",
            master_port=0,
        )
        config = CkptdConfig.from_env(self.env)
        if self.node_runtime_dirs:
            config = config.replace(runtime_dir=self.node_runtime_dirs[node])
        return Endpoints.for_job(self.root, job, config)


# --- the state: every value derived from the step ------------------------------------------------
def full_tensors(step: int, world: int) -> dict[str, torch.Tensor]:
    w = torch.arange(world * ROWS_PER_RANK * COLS, dtype=torch.float32).reshape(-1, COLS) * 0.25 + step * 1000
    b = (torch.arange(8 * world, dtype=torch.float32) / 8 + step).to(torch.bfloat16)
    e = torch.arange(15, dtype=torch.int64).reshape(3, 5) * (step + 1)
    g = torch.Generator().manual_seed(step)
    big = torch.randn(world * BIG_ROWS_PER_RANK, BIG_COLS, generator=g)
    return {"w": w, "b": b, "e": e, "big": big}


def _rows(name: str) -> int:
    return {"w": ROWS_PER_RANK, "b": 8, "big": BIG_ROWS_PER_RANK}[name]


def rank_state(rank: int, world: int, step: int) -> dict[str, torch.Tensor]:
    """This rank's live tensors at ``step`` (fresh copies: training mutates them in place)."""
    full = full_tensors(step, world)
    out = {k: full[k][rank * _rows(k) : (rank + 1) * _rows(k)].clone() for k in ("w", "b", "big")}
    out["e"] = full["e"].clone()
    return out


def sharded(state: dict[str, torch.Tensor], rank: int, world: int, step: int) -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", state["w"], (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", state["b"], (0, rank, world)),
        "big": ShardedTensor.from_rank_offsets("big", state["big"], (0, rank, world)),
        "e": ShardedTensor.from_rank_offsets("e", state["e"], replica_id=rank),
        "o": ShardedObject("o", {"rank": rank, "step": step}, (world,), (rank,)),
        "iteration": step,
    }


def load_request(rank: int, world: int) -> dict[str, Any]:
    st = rank_state(rank, world, 0)
    for t in st.values():
        t.fill_(-7)
    return sharded(st, rank, world, -1)


def mismatch(loaded: dict[str, Any], rank: int, world: int, step: int) -> str | None:
    """None when ``loaded`` holds exactly rank ``rank``'s state of ``step``; else what differs."""
    want = rank_state(rank, world, step)
    for k, t in want.items():
        got = loaded.get(k)
        if not isinstance(got, torch.Tensor) or got.dtype != t.dtype or not torch.equal(got, t):
            return f"tensor {k!r} of rank {rank} differs from step {step}'s"
    if loaded.get("o") != {"rank": rank, "step": step}:
        return f"object 'o' of rank {rank} is {loaded.get('o')!r}, not step {step}'s"
    if loaded.get("iteration") != step:
        return f"common 'iteration' is {loaded.get('iteration')!r}, not {step}"
    return None


# --- event files ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    phase: str
    rank: int
    ev: str  # saved | committed | aborted | save_error | resumed | finished
    step: int | None = None
    detail: str = ""
    t: float = 0.0


class EventLog:
    def __init__(self, directory: str, phase: str, rank: int) -> None:
        self.phase, self.rank = phase, rank
        path = Path(directory) / f"{phase}.r{rank}.jsonl"
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def add(self, ev: str, step: int | None = None, detail: str = "") -> None:
        line = json.dumps(asdict(Event(self.phase, self.rank, ev, step, detail[:500], time.time()))) + "\n"
        os.write(self.fd, line.encode())


def read_events(directory: str | os.PathLike) -> list[Event]:
    out = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(Event(**json.loads(line)))
    return out


# --- one rank ----------------------------------------------------------------------------------
def _poll(handles: dict[int, ckptd.SaveHandle], log: EventLog) -> None:
    """Record every save that finished since the last poll (and observe its failure)."""
    for step, h in list(handles.items()):
        if not h.done():
            continue
        del handles[step]
        if h.committed:
            log.add("committed", step)
            continue
        try:
            h.wait(0)
        except ckptd.CkptdError as exc:
            log.add("aborted", step, str(exc))


def _barrier(spec: JobSpec, phase: str, rank: int, timeout_s: float = 90.0) -> None:
    """Wait until every rank got here. Real jobs synchronize through their collectives, so no rank
    saves before every rank's Checkpointer is up (node 0's local rank 0 starts the coordinator)."""
    marks = Path(spec.events)
    (marks / f"ready.{phase}.r{rank}").touch()
    wait_until(
        lambda: len(list(marks.glob(f"ready.{phase}.r*"))) >= spec.ranks,
        timeout_s,
        f"every rank to start (rank {rank})",
    )


def _await_coordinator(spec: JobSpec, phase: str, rank: int, ckpt: ckptd.Checkpointer, timeout_s: float = 30.0) -> None:
    """Wait until this rank's node daemon knows the coordinator now running: a node daemon learns
    a just-restarted coordinator at its next ping, and a report sent before that would be
    aborted (real jobs train a while before their first save). Rank 0, on node 0 whose daemon
    runs the coordinator, names its instance in a mark file. A daemon the trial killed meanwhile
    ends the wait: the saves then report what happened."""
    mark = Path(spec.events) / f"coordinator.{phase}"

    def instance_known() -> bool:
        try:
            return ckpt.status()["upstream"]["instance"] == mark.read_text()
        except ckptd.CkptdError:
            return True

    try:
        if rank == 0:
            tmp = mark.with_suffix(".tmp")
            tmp.write_text(ckpt.status()["instance"])
            os.replace(tmp, mark)
        wait_until(mark.exists, timeout_s, "rank 0 to name the coordinator's instance")
        wait_until(instance_known, timeout_s, f"rank {rank}'s node daemon to learn the coordinator")
    except (ckptd.CkptdError, AssertionError) as exc:
        logging.getLogger(__name__).warning("rank %d: saving without knowing the coordinator: %s", rank, exc)


def trainer(rank: int, spec: JobSpec, phase: str) -> None:
    """A rank: resume from the latest checkpoint (checked bit-exact), then save periodically.

    Every rank waits for all others before its first save, as collectives make a real job do.
    Phase ``"run"`` saves steps 1..spec.steps and is SIGKILLed by the harness at some point.
    Phase ``"restart"`` resumes, saves ``restart_steps`` new steps and waits for each to commit.
    """
    os.environ.update(spec.rank_env(rank, phase))
    logging.basicConfig(
        filename=str(Path(spec.events) / f"{phase}.r{rank}.log"),
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    log = EventLog(spec.events, phase, rank)
    world = spec.ranks
    if os.environ.get("MASTER_PORT"):
        # A launch's gloo group, as a real job has (the hosts hold its store, as torchrun's agent
        # does): the ranks agree on the checkpoint to resume from through it. Without one, ranks
        # that read the tracker while the previous launch's daemon moved it resumed different steps.
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ckpt = ckptd.Checkpointer(spec.root)
    # Every rank resumes (a collective): rank 0 chooses, every rank loads its choice, or gets None
    # when there is none, or the same error. latest() is what this rank reads now: while the
    # previous launch's daemon finishes a commit, ranks can read different steps, or one none,
    # and skip the load the others enter. The step to go on from is the one loaded.
    try:
        loaded = ckpt.resume(load_request(rank, world))
    except ckptd.CorruptCheckpointError as exc:
        # Node-local disks: every commit went with a replaced machine's disk before it was
        # mirrored; the resume must say so (tools/harness/crash_nodelocal.py checks it did).
        log.add("unrecoverable", None, str(exc))
        ckpt.close()
        return
    latest = None
    if loaded is not None:
        iteration = loaded.get("iteration")
        latest = iteration if isinstance(iteration, int) and iteration >= 0 else None
        bad = mismatch(loaded, rank, world, latest if latest is not None else -1)
        path = ckpt.checkpoint_dir(latest) if latest is not None else None
        log.add("resumed", latest, json.dumps({"path": str(path), "mismatch": bad}))
    _barrier(spec, phase, rank)
    _await_coordinator(spec, phase, rank, ckpt)
    first = 1 if phase == "run" else (latest or 0) + 1
    count = spec.steps if phase == "run" else spec.restart_steps
    handles: dict[int, ckptd.SaveHandle] = {}
    for step in range(first, first + count):
        state = rank_state(rank, world, step)
        try:
            handles[step] = ckpt.save(sharded(state, rank, world, step), step=step)
            log.add("saved", step)
        except ckptd.CkptdError as exc:
            log.add("save_error", step, f"{type(exc).__name__}: {exc}")
        for t in state.values():  # training goes on: the staged copy must not change
            t.fill_(-1)
        _poll(handles, log)
        time.sleep(spec.interval_s)
    deadline = time.monotonic() + 60
    while handles and time.monotonic() < deadline:
        _poll(handles, log)
        time.sleep(0.02)
    try:
        ckpt.close(wait=False)
    except ckptd.SaveFailedError as exc:  # pending saves of a daemon that died meanwhile
        log.add("aborted", None, str(exc))
    log.add("finished", None, json.dumps({"unresolved": sorted(handles)}))
