"""One crash-matrix trial: run a job, SIGKILL one process at a random moment, restart, check.

Order of :func:`run_trial` (real processes, real daemons, real ZeroMQ, real files), on *hosts*
(:class:`Hosts`: this machine's loopback, :class:`LoopbackHosts`, or namespace nodes,
tools/harness/netns_hosts.py, which add victims of their own):

1. *run*: start every rank (:func:`tools.harness.crash_job.trainer`); their local rank 0s start the
   node daemons. Once every rank saved once, wait a random moment and SIGKILL the victim: a
   trainer rank, a non-coordinator node daemon, or node 0's daemon (which hosts the coordinator),
   or let the hosts' fault strike (a whole machine, a partitioned link).
   The survivors train on a little longer (daemons get restarted by the next save), then the
   harness SIGKILLs every trainer, as a launcher tears a failed job down.
2. heal what the hosts' fault broke (a killed machine boots again, empty); wait until the live
   daemons finished everything in flight (commits or aborts), unless the trial relaunches at once
   (``relaunch_at_once``: the restart's resume settles what is in flight, ckptd.client.settle);
3. *restart*: start every rank again (a launch of its own, with a gloo group); they resume
   (``Checkpointer.resume()``, rank 0's choice on every rank), check the loaded state bit for
   bit, save new steps and wait until each committed;
4. stop the daemons and check the root (:func:`check_root`): every step any rank saw COMMITTED is
   loadable bit-exact unless retention removed it legitimately, the tracker's checkpoint loads
   bit-exact, no partial checkpoint is visible, ``ckptd verify`` passes on every committed one,
   and no shared memory or daemon process is left behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, Protocol

import torch

import ckptd
from ckptd.catalog import EntryState
from ckptd.cli import main as ckptd_cli
from ckptd.client import admin
from ckptd.config import CkptdConfig
from ckptd.control.endpoints import Endpoints
from ckptd.control.pidfile import daemon_alive, daemon_pid
from ckptd.errors import DaemonError
from ckptd.format.rootlayout import step_dir_name
from ckptd.recovery import resolve_latest
from ckptd.s3catalog import scan_any
from ckptd.staging.segment import list_segments, unlink_segments
from ckptd.storage.url import Location, parse_location
from tools.harness import crash_job as cj
from tools.harness.daemons import DaemonsDidNotStop, daemon_processes, signal_process, stop_daemons
from tools.harness.ports import free_port
from tools.harness.ranks import launch_store, process_context, stop_process_context  # noqa: F401 - the trial API

VICTIMS = ("rank", "node", "coordinator")
MULTI_NODE_VICTIMS = ("node", "link")  # victims that need another node than node 0
KEEP_LAST = 3
# Every rank waits for all others before its first save (crash_job._barrier), so the commit does
# not wait for a node daemon being started; these only bound how long survivors wait for the dead.
COMMIT_TIMEOUT_S = 2.5
COORDINATOR_TIMEOUT_S = 3.0
STOP_TIMEOUT_S = 20.0  # from SIGTERM until every daemon of the job exited


@dataclass
class TrialResult:
    seed: int
    victim: str
    victim_detail: str = ""
    kill_at_s: float = 0.0
    commits: int = 0  # distinct steps some rank saw COMMITTED (both phases)
    aborted: int = 0  # distinct steps some rank saw fail
    recovered: bool = False  # every restarted rank resumed bit-exact and its new saves committed
    corrupt: list[str] = field(default_factory=list)
    lost_committed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.recovered and not self.corrupt and not self.lost_committed and not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def failures(results: list[TrialResult]) -> list[str]:
    """One line per failed trial: its seed, victim and what went wrong (empty: all passed)."""
    return [
        f"seed {r.seed} ({r.victim_detail}): corrupt={r.corrupt} lost={r.lost_committed} problems={r.problems}"
        for r in results
        if not r.ok
    ]


# --- daemons ---------------------------------------------------------------------------------
def daemon_status(ep: Endpoints, config: CkptdConfig, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """A live daemon's STATUS (None when none answers)."""
    if not daemon_alive(ep.pid_path):
        return None
    try:
        return admin.daemon_status(admin.LocalDaemon(ep.node, ep, daemon_pid(ep.pid_path)), config, timeout_s)
    except DaemonError:
        return None


def quiesce(spec: cj.JobSpec, timeout_s: float) -> str | None:
    """Wait until no live daemon has a write, commit or step in flight; None, or what is stuck."""
    config = CkptdConfig.from_env(spec.env)
    deadline = time.monotonic() + timeout_s
    busy = "?"
    while time.monotonic() < deadline:
        busy = ""
        for node in range(spec.nodes):
            info = daemon_status(spec.endpoints(node), config)
            if info is None:
                continue
            coord = (info.get("coordinator") or {}).get("steps") or {}
            if info["jobs_in_flight"] or info["pending_steps"] or coord:
                busy += (
                    f" node {node}: writes {info['jobs_in_flight']}, pending {info['pending_steps']}, "
                    f"coordinator {sorted(coord)};"
                )
        if not busy:
            return None
        time.sleep(0.1)
    return f"daemons still busy after {timeout_s:.0f} s:{busy}"


# --- checks ------------------------------------------------------------------------------------
def _verify_all(root: Location) -> dict[str, Any]:
    """``ckptd verify ROOT --all --json``, run in this process (the command's own code path)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = ckptd_cli(["verify", str(root), "--all", "--json"])
    report = json.loads(out.getvalue())
    report["rc"] = rc
    return report


def check_checkpoint(path: Location, step: int, world: int) -> str | None:
    """None when ``path`` holds exactly the job's state of ``step`` for every rank; else what is
    wrong (a load that refuses damage, a checksum mismatch, is reported too)."""
    try:
        return _check_checkpoint(path, step, world)
    except ckptd.CkptdError as exc:
        return f"{path.name}: {exc}"


def _check_checkpoint(path: Location, step: int, world: int) -> str | None:
    full = cj.full_tensors(step, world)
    plain = ckptd.load_plain_tensors(path)
    for k, t in full.items():
        if k not in plain or plain[k].dtype != t.dtype or not torch.equal(plain[k], t):
            return f"{path.name}: tensor {k!r} differs from step {step}'s values"
    for rank in range(world):
        bad = cj.mismatch(ckptd.load(cj.load_request(rank, world), path), rank, world, step)
        if bad:
            return f"{path.name}: {bad}"
    return None


def committed_steps(events: list[cj.Event], result: TrialResult) -> list[int]:
    """The steps any rank saw COMMITTED (counted in ``result`` with the aborted ones)."""
    committed = sorted({e.step for e in events if e.ev == "committed" and e.step is not None})
    result.commits = len(committed)
    result.aborted = len({e.step for e in events if e.ev == "aborted" and e.step is not None})
    return committed


def check_root(spec: cj.JobSpec, events: list[cj.Event], result: TrialResult) -> None:
    root = parse_location(spec.root)  # a directory, or an s3:// root
    committed = committed_steps(events, result)
    cat = scan_any(root)
    on_disk = {e.step: e for e in cat.entries if e.state is EntryState.COMMITTED and e.step >= 0}
    for e in cat.entries:
        if e.state is EntryState.INCOMPLETE:
            result.corrupt.append(f"{e.name}: a final checkpoint name without its commit marker")
    verify = _verify_all(root) if cat.committed else {"rc": 0}
    if verify["rc"] != 0:
        bad = [
            f"{c['checkpoint']}: {[f['message'] for f in c['findings'] if f['severity'] == 'error']}"
            for c in verify["checkpoints"]
            if not c["ok"]
        ]
        result.corrupt.append(f"ckptd verify exited {verify['rc']}: {bad or verify['findings']}")
    for step, entry in sorted(on_disk.items()):
        bad = check_checkpoint(entry.path, step, spec.ranks)
        if bad:
            result.corrupt.append(bad)
    for step in committed:
        if step in on_disk:
            continue
        newer = [s for s in on_disk if s > step]
        if len(newer) < KEEP_LAST:  # retention keeps the newest KEEP_LAST: this one was lost
            result.lost_committed.append(
                f"step {step} was reported COMMITTED but {step_dir_name(step)} "
                f"is gone (only {len(newer)} newer checkpoints exist)"
            )
    choice = resolve_latest(root)
    if choice is None:
        if committed:
            result.lost_committed.append("the root has no loadable latest checkpoint")
        return
    if choice.fallback_reason is not None:
        result.corrupt.append(f"the tracker is not valid: {choice.fallback_reason}")
    if committed and (choice.step or -1) < committed[-1]:
        result.lost_committed.append(
            f"the tracker names step {choice.step}, older than the committed step {committed[-1]}"
        )


def run_committed(events: list[cj.Event]) -> set[int]:
    """The steps a rank saw COMMITTED before the kill."""
    return {e.step for e in events if e.phase == "run" and e.ev == "committed" and e.step is not None}


def check_restart(spec: cj.JobSpec, events: list[cj.Event], result: TrialResult, newest_before: int | None) -> None:
    """Each restarted rank resumed from a committed, bit-exact checkpoint (not older than
    ``newest_before``: the newest step a rank saw COMMITTED that must have survived; None: none)
    and its saves committed."""
    ok = True
    for rank in range(spec.ranks):
        mine = [e for e in events if e.phase == "restart" and e.rank == rank]
        resumed = [e for e in mine if e.ev == "resumed"]
        if newest_before is not None and not resumed:
            result.lost_committed.append(f"restarted rank {rank} found no checkpoint to resume from")
            ok = False
        for e in resumed:
            info = json.loads(e.detail)
            if info["mismatch"]:
                result.corrupt.append(f"restarted rank {rank} loaded step {e.step}: {info['mismatch']}")
            if info["path"].endswith(".tmp") or Path(info["path"]).name != step_dir_name(e.step or 0):
                result.corrupt.append(f"restarted rank {rank} loaded {info['path']}")
            if newest_before is not None and (e.step or 0) < newest_before:
                result.lost_committed.append(
                    f"rank {rank} resumed from step {e.step}, older than the committed step {newest_before}"
                )
        saved = {e.step for e in mine if e.ev == "saved"}
        done = {e.step for e in mine if e.ev == "committed"}
        if len(saved) != spec.restart_steps or saved != done:
            errors = [f"{e.ev} {e.step}: {e.detail}" for e in mine if e.ev in ("save_error", "aborted")]
            result.problems.append(f"restarted rank {rank}: saved {sorted(saved)}, committed {sorted(done)} {errors}")
            ok = False
    result.recovered = ok


# --- where the job runs ------------------------------------------------------------------------
class TrialProcess(Protocol):
    """A trainer process as the trial handles it (multiprocessing.Process has this interface)."""

    pid: int | None
    exitcode: int | None

    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def kill(self) -> None: ...


class Hosts(Protocol):
    """Where a trial's processes run: this machine's loopback (:class:`LoopbackHosts`), or
    namespace nodes (tools/harness/netns_hosts.py). Used in this order: :meth:`open`,
    :meth:`job_fields` (what the job spec needs: runtime directory and coordinator port, node 0's
    address...), :meth:`start` once per phase, :meth:`fault` for a victim of the hosts' own kinds,
    :meth:`heal` before the restart, :meth:`segments`, :meth:`logs`, and always :meth:`close`."""

    victims: tuple[str, ...]  # kinds of victim, the common VICTIMS first

    def open(self, nodes: int) -> None: ...
    def job_fields(self) -> dict[str, Any]:
        """What the hosts add to the job: its ``env``, and where they decide it its ``root``."""
        ...

    def start(self, spec: cj.JobSpec, phase: str) -> list[TrialProcess]: ...
    def fault(self, victim: str, spec: cj.JobSpec, rng: random.Random) -> str: ...
    def heal(self) -> None: ...
    def segments(self, prefix: str) -> list[str]: ...
    def logs(self) -> list[Path]: ...
    def close(self, prefix: str) -> None: ...


@dataclass
class LoopbackHosts:
    """Every node on this machine: daemons with distinct node ids over loopback, one runtime
    directory and one /dev/shm; trainers are forkserver children (``ctx``: :func:`process_context`)."""

    ctx: BaseContext
    victims: tuple[str, ...] = VICTIMS
    runtime: Path | None = None
    store: Any = None  # the running launch's rendezvous store (torchrun's agent store)

    def open(self, nodes: int) -> None:
        self.runtime = Path(tempfile.mkdtemp(prefix="ckc", dir="/tmp"))  # short: ipc paths are limited

    def job_fields(self) -> dict[str, Any]:
        return {"env": {"CKPTD_RUNTIME_DIR": str(self.runtime), "CKPTD_COORDINATOR_PORT": str(free_port())}}

    def start(self, spec: cj.JobSpec, phase: str) -> list[TrialProcess]:
        # Each phase is a launch with its own store, the ranks' gloo group's (as torchrun's).
        self.store = launch_store()
        launch = replace(
            spec, env={**spec.env, "MASTER_PORT": str(self.store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        )
        procs = [self.ctx.Process(target=cj.trainer, args=(r, launch, phase), daemon=True) for r in range(spec.ranks)]
        for p in procs:
            p.start()
        return procs  # type: ignore[return-value]

    def fault(self, victim: str, spec: cj.JobSpec, rng: random.Random) -> str:
        raise ValueError(f"no victim {victim!r} on loopback nodes")

    def heal(self) -> None:
        pass

    def segments(self, prefix: str) -> list[str]:
        return list_segments(prefix)

    def logs(self) -> list[Path]:
        return sorted(self.runtime.glob("*.log")) if self.runtime else []

    def close(self, prefix: str) -> None:
        self.store = None
        unlink_segments(prefix)
        if self.runtime is not None:
            shutil.rmtree(self.runtime, ignore_errors=True)


# --- the trial ---------------------------------------------------------------------------------
def job_spec(
    workdir: Path,
    ranks: int,
    nodes: int,
    rng: random.Random,
    fields: dict[str, Any],
    root: str | None = None,
    write_delay_s: tuple[float, float] = (0.0, 0.12),
) -> cj.JobSpec:
    """The job of one trial; ``fields``: what its hosts add (:meth:`Hosts.job_fields`); ``root``:
    where it saves (default: a directory of the trial; an ``s3://`` root runs the trial on object
    storage, whose client settings come from this process's AWS_* variables); ``write_delay_s``:
    the range of the daemons' delay before each file they write."""
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_") or k.startswith("CKPTD_S3_")}
    env = {
        **(aws if root is not None and root.startswith("s3://") else {}),
        **fields.pop("env", {}),
        "CKPTD_HEARTBEAT_S": "0.1",
        "CKPTD_COORDINATOR_TIMEOUT_S": str(COORDINATOR_TIMEOUT_S),
        "CKPTD_COMMIT_TIMEOUT_S": str(COMMIT_TIMEOUT_S),
        "CKPTD_REQUEST_TIMEOUT_S": "10",
        "CKPTD_IN_FLIGHT_WAIT_TIMEOUT_S": "20",
        "CKPTD_DAEMON_START_TIMEOUT_S": "40",
        "CKPTD_IDLE_EXIT_S": "120",
        "CKPTD_SHUTDOWN_GRACE_S": "5",
        "CKPTD_KEEP_LAST": str(KEEP_LAST),
        # Writes take a random while, so that kills land inside writes and commits.
        "CKPTD_DEBUG_WRITE_DELAY_S": f"{rng.uniform(*write_delay_s):.3f}",
    }
    events = workdir / "events"
    events.mkdir(parents=True)
    root = fields.pop("root", root)
    return cj.JobSpec(root or str(workdir / "ckpts"), str(events), ranks, nodes, env, **fields)


def _wait_for(cond: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _kill_victim(spec: cj.JobSpec, victim: str, procs: list[TrialProcess], rng: random.Random) -> str:
    if victim == "rank":
        rank = rng.randrange(spec.ranks)
        if procs[rank].pid:
            signal_process(procs[rank].pid, signal.SIGKILL)
        return f"rank {rank} (pid {procs[rank].pid})"
    node = 0 if victim == "coordinator" else rng.randrange(1, spec.nodes)
    ep = spec.endpoints(node)
    # A daemon that is being restarted right now has no pid yet: wait for it.
    _wait_for(lambda: daemon_alive(ep.pid_path) and daemon_pid(ep.pid_path), 20)
    pid = daemon_pid(ep.pid_path)
    if pid:
        signal_process(pid, signal.SIGKILL)
    return f"node {node} daemon (pid {pid})"


def run_trial(
    seed: int,
    hosts: Hosts,
    *,
    ranks: int = 2,
    nodes: int = 2,
    victim: str | None = None,
    workdir: str | os.PathLike | None = None,
    keep: bool = False,
    root: str | None = None,
    relaunch_at_once: bool = False,
) -> TrialResult:
    """One trial (see the module docstring) on ``hosts``; ``victim`` None picks one at random
    among the hosts' kinds (those needing several nodes only when there are). ``relaunch_at_once``:
    step 2 does not wait for the daemons, and their writes are slower (0.3-0.8 s a file), so the
    restart's resume finds saves of the killed launch in flight (ckptd.client.settle): it must
    resume what committed and save on without a refused step."""
    if ranks % nodes:
        raise ValueError(f"{ranks} ranks do not split evenly over {nodes} nodes")
    rng = random.Random(seed)
    kinds = [v for v in hosts.victims if nodes > 1 or v not in MULTI_NODE_VICTIMS]
    victim = victim if victim is not None else rng.choice(kinds)
    if victim not in kinds:
        raise ValueError(f"victim {victim!r} is not one of {kinds} here")
    t0 = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix=f"crash{seed}-", dir=workdir))
    result = TrialResult(seed, victim)
    procs: list[TrialProcess] = []
    job = ""
    try:
        hosts.open(nodes)
        delay_s = (0.3, 0.8) if relaunch_at_once else (0.0, 0.12)
        spec = job_spec(base, ranks, nodes, rng, hosts.job_fields(), root, delay_s)
        job = spec.endpoints(0).job
        procs = hosts.start(spec, "run")
        started = _wait_for(
            lambda: all(
                any(e.ev == "saved" and e.rank == r for e in cj.read_events(spec.events)) for r in range(ranks)
            ),
            60,
        )
        if not started:
            result.problems.append("the job did not start saving within 60 s")
        result.kill_at_s = rng.uniform(0.0, spec.steps * spec.interval_s * 0.8)
        time.sleep(result.kill_at_s)
        if victim in VICTIMS:
            result.victim_detail = _kill_victim(spec, victim, procs, rng)
        else:
            result.victim_detail = hosts.fault(victim, spec, rng)
        time.sleep(rng.uniform(0.2, 1.0))  # survivors train on, then the launcher tears the job down
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        hosts.heal()
        stuck = None if relaunch_at_once else quiesce(spec, COMMIT_TIMEOUT_S + COORDINATOR_TIMEOUT_S + 10)
        if stuck:
            result.problems.append(stuck)
        procs = hosts.start(spec, "restart")
        for p in procs:
            p.join(120)
        for r, p in enumerate(procs):
            if p.exitcode != 0:
                result.problems.append(f"restarted rank {r} exited with {p.exitcode}; see {spec.events}")
        # A daemon launched by a trainer killed meanwhile may still be starting: wait for the job's.
        pid_paths = [spec.endpoints(node).pid_path for node in range(spec.nodes)]
        try:
            stop_daemons(pid_paths, STOP_TIMEOUT_S, job=job)
        except DaemonsDidNotStop as exc:
            result.problems.append(str(exc))
        events = cj.read_events(spec.events)
        node_local = getattr(hosts, "node_local", None)
        if node_local is not None:
            # it imports this module
            from tools.harness.crash_nodelocal import check_node_local, unrecoverable_as_expected

            surviving = check_node_local(
                node_local.disks(spec.root),
                node_local.mirror,
                spec.ranks,
                committed_steps(events, result),
                node_local.replaced,
                result,
            )
            newest = max(run_committed(events) & surviving, default=None)
            if not unrecoverable_as_expected(events, spec.ranks, newest, node_local.replaced, result):
                check_restart(spec, events, result, newest)
        else:
            check_restart(spec, events, result, max(run_committed(events), default=None))
            check_root(spec, events, result)
        left = hosts.segments(f"ckptd-{job}-")
        if left:
            result.problems.append(f"shared-memory segments left behind: {left}")
        if daemon_processes(job):
            result.problems.append(f"daemon processes left behind: {daemon_processes(job)}")
    except Exception as exc:  # noqa: BLE001 - a harness failure fails the trial, with the reason
        result.problems.append(f"harness error: {type(exc).__name__}: {exc}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for pid in daemon_processes(job) if job else []:
            signal_process(pid, signal.SIGKILL)
        if not result.ok:
            for log_file in hosts.logs():
                shutil.copy(log_file, base / f"daemon-{log_file.name}")
        hosts.close(f"ckptd-{job}-")
        if not keep and result.ok:
            shutil.rmtree(base, ignore_errors=True)
        elif not result.ok:
            result.problems.append(f"(trial files kept in {base})")
    result.duration_s = time.monotonic() - t0
    return result
