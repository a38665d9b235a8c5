"""The job's coordinator: collects every rank's WRITTEN, commits the step, announces the outcome.

It lives in node 0's daemon and shares its loop (a ROUTER socket on ``tcp://``; node daemons,
node 0's included, connect with DEALER sockets). Each step is a small state machine::

    COLLECTING --(all world_size ranks WRITTEN)--> COMMITTING --(commit ok)--> COMMITTED
        |                                              |
        +--(FAILED / SKIP / bad records / timeout)-----+--(commit error)-----> ABORTED

COMMITTED and ABORTED are announced to every node daemon (``STEP_COMMITTED`` / ``STEP_ABORTED``
with the reason); an aborted step's ``<step>.tmp`` is removed, earlier checkpoints are untouched.
Commits run one at a time on the commit thread, in the order steps complete. Messages about a
finished step (a late FAILED after an abort, say) are answered with its outcome again, and any
``<step>.tmp`` they may have re-created is removed.

An aborted step may be saved again (a job restarted from an older checkpoint reaches that step
once more): a WRITTEN for it starts a new attempt, because node daemons never report a write as
WRITTEN once its step was decided (a late write is reported as FAILED). Only within
:data:`_ABORT_QUARANTINE_HEARTBEATS` heartbeats of the abort is a WRITTEN still taken for one of
the old attempt that crossed the abort on the wire.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from ..config import CkptdConfig
from ..control.channel import Endpoint, make_socket
from ..control.protocol import (
    Codec,
    ErrorReply,
    Failed,
    Message,
    Ping,
    Pong,
    Status,
    StatusReply,
    StepAborted,
    StepCommitted,
    Written,
)
from ..errors import ProtocolError, StorageError
from ..format.durable import default_opener
from ..format.finalize import serialize_common
from ..format.records import ItemRecord
from .commit import commit_step, remove_tmp
from .faults import fault_opener
from .workers import Done, WorkerPools

log = logging.getLogger(__name__)

_FINISHED_MEMORY = 1024
_ABORT_QUARANTINE_HEARTBEATS = 3


class Phase(str, enum.Enum):
    COLLECTING = "collecting"
    COMMITTING = "committing"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass
class StepState:
    step: int
    world_size: int
    started_s: float
    records: dict[int, list[ItemRecord]] = field(default_factory=dict)
    common: bytes | None = None
    phase: Phase = Phase.COLLECTING
    reporters: set[bytes] = field(default_factory=set)
    adopted: bool = False  # found as <step>.tmp when this coordinator started


class Coordinator:
    def __init__(self, ctx: zmq.Context, codec: Codec, bind: str, root: Path, config: CkptdConfig,
                 workers: WorkerPools, instance: str, adopt_steps: list[int] = ()) -> None:  # type: ignore[assignment]
        self.root = root
        self.config = config
        self.workers = workers
        self.instance = instance
        # Test hook: the fault file also reaches the commit's files (see ckptd.daemon.faults).
        self.opener = fault_opener(config.debug_fault_file) if config.debug_fault_file else default_opener
        sock = make_socket(ctx, zmq.ROUTER, codec)
        host_port = bind.removeprefix("tcp://")
        if host_port.endswith(":0"):
            bind = bind[: -len(":0")] + ":*"
        sock.bind(bind)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ep = Endpoint(sock, codec, "coordinator")
        self.nodes: dict[bytes, int] = {}
        self.steps: dict[int, StepState] = {}
        self.finished: OrderedDict[int, Message] = OrderedDict()
        self.finished_at: dict[int, float] = {}  # monotonic time each finished step was decided
        now = time.monotonic()
        for step in adopt_steps:
            # Another node may still be writing it (it may even commit); if it does not complete
            # within the commit timeout, it aborts like any step and its tmp dir is removed.
            self.steps[step] = StepState(step, 0, now, adopted=True)
        log.info("coordinator of %s listening on %s", root, self.address)

    @property
    def busy(self) -> bool:
        """Steps are in flight (adopted leftovers nobody reported on do not count)."""
        return any(not st.adopted or st.reporters for st in self.steps.values())

    # --- messages -----------------------------------------------------------------------------
    def on_readable(self) -> None:
        while True:
            try:
                identity, msg = self.ep.recv()
            except zmq.Again:
                return
            if msg is None or identity is None:
                continue
            try:
                self._dispatch(identity, msg)
            except Exception as exc:  # noqa: BLE001 - one node's odd report must not stop the coordinator
                log.exception("coordinator: %s from %r could not be handled", msg.TYPE.name, identity)
                self.ep.send(ErrorReply(f"the coordinator could not handle {msg.TYPE.name}: "
                                        f"{type(exc).__name__}: {exc}", getattr(msg, "step", None)),
                             identity, block=False)

    def _dispatch(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Ping):
            self.nodes.setdefault(identity, -1)
            self.ep.send(Pong(msg.nonce, self.instance, _pid()), identity)
        elif isinstance(msg, Written):
            self.nodes[identity] = msg.node
            self._on_written(identity, msg)
        elif isinstance(msg, Failed):
            self.nodes[identity] = msg.node
            st = self._step_for(identity, msg.step, msg.world_size, new_attempt=False)
            if st is not None:
                st.reporters.add(identity)
                who = f"rank {msg.rank} (node {msg.node})" if msg.rank >= 0 else f"node {msg.node}"
                self._abort(st, f"{who}: {msg.reason}")
        elif isinstance(msg, Status):
            self.ep.send(StatusReply(self.status()), identity)
        else:
            log.warning("coordinator: unexpected %s from %r", msg.TYPE.name, identity)
            self.ep.send(ErrorReply(f"the coordinator does not accept {msg.TYPE.name}", None), identity)

    def _step_for(self, identity: bytes, step: int, world_size: int, new_attempt: bool) -> StepState | None:
        """The live state of ``step`` (created on first report); None when it already finished.

        ``new_attempt``: the report is a WRITTEN, which may start a new attempt of an aborted step.
        """
        if step in self.finished:
            outcome = self.finished[step]
            age_s = time.monotonic() - self.finished_at.get(step, 0.0)
            if (new_attempt and isinstance(outcome, StepAborted)
                    and age_s > _ABORT_QUARANTINE_HEARTBEATS * self.config.heartbeat_s):
                log.info("step %d: saved again after its abort (%s); new attempt", step, outcome.reason)
                del self.finished[step]
                self.finished_at.pop(step, None)
            else:
                self.ep.send(outcome, identity)
                # A late writer may have re-created the tmp dir; the step is decided, so it is junk.
                self.workers.commit(("cleanup", step), lambda: remove_tmp(self.root, step))
                return None
        st = self.steps.get(step)
        if st is None:
            st = self.steps[step] = StepState(step, world_size, time.monotonic())
        elif st.world_size == 0:
            st.world_size = world_size
        elif world_size and st.world_size != world_size and st.phase is Phase.COLLECTING:
            self._abort(st, f"ranks disagree on the world size of step {step}: {st.world_size} "
                            f"and {world_size}; every rank of the job must use one Checkpointer setup")
            return None
        return st

    def _on_written(self, identity: bytes, msg: Written) -> None:
        st = self._step_for(identity, msg.step, msg.world_size, new_attempt=True)
        if st is None:
            return
        st.reporters.add(identity)
        if st.phase is not Phase.COLLECTING:
            log.warning("step %d: WRITTEN from rank %d while %s; ignored", msg.step, msg.rank, st.phase.value)
            return
        try:
            if not 0 <= msg.rank < st.world_size:
                raise ProtocolError(f"rank {msg.rank} outside world size {st.world_size}")
            if msg.rank in st.records:
                raise ProtocolError(f"rank {msg.rank} reported step {msg.step} twice")
            records = [ItemRecord.from_wire(r) for r in msg.records]
            bad = [r for r in records if r.rank != msg.rank]
            if bad:
                raise ProtocolError(f"rank {msg.rank} sent records of rank {bad[0].rank}")
        except ProtocolError as exc:
            self._abort(st, f"rank {msg.rank} (node {msg.node}): {exc}")
            return
        st.records[msg.rank] = records
        if msg.rank == 0:
            st.common = msg.common
        if len(st.records) == st.world_size:
            self._start_commit(st)

    # --- the state machine ----------------------------------------------------------------
    def _start_commit(self, st: StepState) -> None:
        st.phase = Phase.COMMITTING
        records = [r for rank in sorted(st.records) for r in st.records[rank]]
        common = st.common if st.common is not None else serialize_common({})
        cfg = self.config

        def run() -> str:
            try:
                return commit_step(self.root, st.step, records, common, fsync=cfg.fsync,
                                   keep_last=cfg.keep_last, megatron_tracker=cfg.megatron_tracker,
                                   opener=self.opener)
            except OSError as exc:
                remove_tmp(self.root, st.step)
                raise StorageError.from_oserror(exc, self.root) from exc
            except BaseException:
                remove_tmp(self.root, st.step)
                raise

        log.info("step %d: all %d ranks wrote; committing", st.step, st.world_size)
        self.workers.commit(("commit", st.step), run)

    def on_done(self, done: Done) -> bool:
        """Handle a finished commit-thread job; False when it is not the coordinator's."""
        if done.kind != "commit":
            return False
        kind, step = done.key
        if kind == "cleanup":
            return True
        st = self.steps.get(step)
        if st is None:
            return True
        if done.error is None:
            st.phase = Phase.COMMITTED
            self._finish(st, StepCommitted(step, str(done.result)))
            log.info("step %d committed as %s", step, done.result)
        else:
            st.phase = Phase.ABORTED
            self._finish(st, StepAborted(step, f"commit failed: {done.error}"))
        return True

    def _abort(self, st: StepState, reason: str) -> None:
        if st.phase is not Phase.COLLECTING:
            log.warning("step %d: ignoring failure while %s: %s", st.step, st.phase.value, reason)
            return
        st.phase = Phase.ABORTED
        log.warning("step %d aborted: %s", st.step, reason)
        self.workers.commit(("cleanup", st.step), lambda: remove_tmp(self.root, st.step))
        self._finish(st, StepAborted(st.step, reason))

    def _finish(self, st: StepState, outcome: Message) -> None:
        self.steps.pop(st.step, None)
        self.finished[st.step] = outcome
        self.finished_at[st.step] = time.monotonic()
        while len(self.finished) > _FINISHED_MEMORY:
            old, _ = self.finished.popitem(last=False)
            self.finished_at.pop(old, None)
        for identity in set(self.nodes) | st.reporters:
            self.ep.send(outcome, identity, block=False)

    def tick(self, now: float) -> None:
        for st in list(self.steps.values()):
            if st.phase is Phase.COLLECTING and now - st.started_s > self.config.commit_timeout_s:
                missing = sorted(set(range(st.world_size)) - set(st.records))
                self._abort(st, f"ranks {missing} did not report within {self.config.commit_timeout_s:g} s "
                                "(CKPTD_COMMIT_TIMEOUT_S): their trainer or node daemon may have died, or "
                                "their storage is too slow (raise the timeout if so)")

    def status(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "nodes": sorted(n for n in self.nodes.values() if n >= 0),
            "steps": {str(s): {"phase": st.phase.value, "written": sorted(st.records),
                               "world_size": st.world_size} for s, st in self.steps.items()},
            "rejected_messages": self.ep.rejected,
        }

    def close(self) -> None:
        self.ep.close()


def _pid() -> int:
    import os

    return os.getpid()
