"""The job's coordinator: collects every rank's WRITTEN, commits the step, announces the outcome.

It lives in node 0's daemon and shares its loop (a CurveZMQ ROUTER socket on ``tcp://``; node
daemons, node 0's included, connect with DEALER sockets). Every report names a step and an
attempt (ckptd.control.attempt); each attempt of a step is a small state machine of its own::

    COLLECTING --(all world_size ranks WRITTEN)--> COMMITTING --(commit ok)--> COMMITTED
        |                                              |
        +--(FAILED / SKIP / bad records / timeout)-----+--(commit error)-----> ABORTED

COMMITTED and ABORTED are announced to every node daemon (``STEP_COMMITTED`` / ``STEP_ABORTED``
with the step, the attempt and the reason); an aborted attempt's ``<step>.<attempt>.tmp`` is
removed, earlier checkpoints are untouched. Commits run one at a time on the commit thread, in the
order attempts complete. A report about a finished attempt (a late FAILED, a duplicate) is
answered with that attempt's outcome again, and any tmp dir it may have re-created is removed: it
is never counted for another attempt, so a step aborted a moment ago can be saved again at once.

Once every rank reported, one copy of each plain item several ranks wrote is kept, and a commit
that would not store every key some rank holds (replicas only) aborts, naming the key
(ckptd.format.coverage); the verdict tells the ranks whether they all hold the same plain keys
(ckptd.statedict.holdings).

Two attempts of one step collecting at the same time mean that its ranks disagree on the attempt
(or a restarted job re-saved a step its predecessor was still saving): both abort, naming ranks and
attempts. Before it renames an attempt's directory the commit checks that every rank's data file
is there with the size its writer reported (ckptd.daemon.commit).
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

from ..config import CkptdConfig
from ..control.channel import Endpoint, link_timeout_s, make_socket, replace_dead_links
from ..control.keys import CurveKeys
from ..control.protocol import (
    Codec,
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
from ..control.security import HandshakeWatch
from ..errors import ProtocolError, ShardingError, StorageError
from ..format.coverage import settle, uniform_digest
from ..format.finalize import serialize_common
from ..format.records import ItemRecord
from ..format.rootlayout import step_dir_name, tmp_dir_name
from ..gcpause import gc_paused
from ..roots.base import CommitOutcome, RootStore
from ..statedict.digest import differing_ranks
from .loop import serve_requests
from .workers import CleanupFinished, CommitFinished, WorkerPools

log = logging.getLogger(__name__)

_FINISHED_MEMORY = 1024
Key = tuple[int, str]  # (step, attempt)


class Phase(str, enum.Enum):
    COLLECTING = "collecting"
    COMMITTING = "committing"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass
class AttemptState:
    step: int
    attempt: str
    world_size: int
    started_s: float
    records: dict[int, list[ItemRecord]] = field(default_factory=dict)
    file_nbytes: dict[int, int] = field(default_factory=dict)  # rank -> its data file's size
    nodes: dict[int, int] = field(default_factory=dict)  # rank -> node that reported it
    common: bytes | None = None
    digests: dict[int, str] = field(default_factory=dict)  # rank -> digest of its common state
    plain: dict[int, str] = field(default_factory=dict)  # rank -> digest of its plain keys
    held: dict[int, list[str]] = field(default_factory=dict)  # rank -> keys it holds, not stores
    warnings: list[str] = field(default_factory=list)  # what the commit noticed (plain copies)
    phase: Phase = Phase.COLLECTING
    reporters: set[bytes] = field(default_factory=set)
    adopted: bool = False  # found as <step>.<attempt>.tmp when this coordinator started

    @property
    def key(self) -> Key:
        return (self.step, self.attempt)

    def describe(self) -> str:
        ranks = sorted(self.records)
        nodes = sorted(set(self.nodes.values()))
        return f"ranks {ranks} (nodes {nodes}) saved attempt {self.attempt}"


class Coordinator:
    def __init__(
        self,
        ctx: zmq.Context,
        codec: Codec,
        keys: CurveKeys,
        bind: str,
        store: RootStore,
        config: CkptdConfig,
        workers: WorkerPools,
        instance: str,
        adopt: list[Key] | None = None,
    ) -> None:
        self.store = store
        self.root = store.location
        self.config = config
        self.workers = workers
        self.instance = instance
        sock = make_socket(ctx, zmq.ROUTER, codec, keys, server=True)
        replace_dead_links(sock, config.heartbeat_s, link_timeout_s(config.heartbeat_s, config.coordinator_timeout_s))
        if bind.startswith("tcp://[") or bind.count(":") > 2:
            sock.setsockopt(zmq.IPV6, 1)
        if bind.endswith(":0"):
            bind = bind[: -len(":0")] + ":*"
        self.watch = HandshakeWatch(sock, "coordinator")  # before bind: no connection unwatched
        sock.bind(bind)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ep = Endpoint(sock, codec, "coordinator")
        self.duplicates = 0  # repeated WRITTENs ignored (identical to the one counted)
        self.nodes: dict[bytes, int] = {}
        self.attempts: dict[Key, AttemptState] = {}
        self.finished: OrderedDict[Key, Message] = OrderedDict()
        now = time.monotonic()
        for step, attempt in adopt or []:
            # Another node may still be writing it (it may even commit); if it does not complete
            # within the commit timeout, it aborts like any attempt and its tmp dir is removed.
            self.attempts[(step, attempt)] = AttemptState(step, attempt, 0, now, adopted=True)
        log.info("coordinator of %s listening on %s", store.display(), self.address)

    @property
    def busy(self) -> bool:
        """Attempts are in flight (adopted leftovers nobody reported on do not count)."""
        return any(not st.adopted or st.reporters for st in self.attempts.values())

    # --- messages -----------------------------------------------------------------------------
    def on_readable(self) -> None:
        serve_requests(self.ep, self._dispatch)

    def _dispatch(self, identity: bytes, msg: Message, _peer: str | None) -> None:
        if isinstance(msg, Ping):
            self.nodes.setdefault(identity, -1)
            self.ep.send(Pong(msg.nonce, self.instance, os.getpid()), identity)
        elif isinstance(msg, Written):
            self.nodes[identity] = msg.node
            self._on_written(identity, msg)
        elif isinstance(msg, Failed):
            self.nodes[identity] = msg.node
            self._on_failed(identity, msg)
        elif isinstance(msg, Status):
            self.ep.send(StatusReply(self.status()), identity)
        else:
            raise ProtocolError(f"the coordinator does not accept {msg.TYPE.name}")

    def _finished_reply(self, identity: bytes, key: Key) -> bool:
        """Answer a report about a finished attempt with its outcome; False if it is not finished."""
        outcome = self.finished.get(key)
        if outcome is None:
            return False
        if isinstance(outcome, StepCommitted) and not self.store.holds_commit(*key):
            # The verdict stands for files that are gone (the root was emptied) or hold another
            # save (a relaunch repeated the attempt id): this report is a new attempt's, never
            # answered from memory, and its files are not junk.
            log.warning(
                "step %d attempt %s: reported again, but %s no longer holds that commit; collecting it anew",
                key[0],
                key[1],
                self.store.display(step_dir_name(key[0])),
            )
            del self.finished[key]
            return False
        self.ep.send(outcome, identity)
        # A late writer may have re-created the tmp dir; the attempt is decided, so it is junk.
        step, attempt = key
        self.workers.cleanup(step, attempt, lambda: self.store.abort(step, attempt))
        return True

    def _new_attempt(self, identity: bytes, step: int, attempt: str, world_size: int, who: str) -> AttemptState | None:
        """Start collecting ``(step, attempt)``; None when it aborted at once (the step committed
        already, or another attempt of it is in flight)."""
        st = self.attempts[(step, attempt)] = AttemptState(step, attempt, world_size, time.monotonic())
        st.reporters.add(identity)
        if self.store.committed_once(step):
            self._abort(
                st,
                f"step {step} is committed already; {who} saved it again as attempt {attempt} (save under a new step)",
            )
            return None
        for other in [o for o in self.attempts.values() if o.step == step and o is not st]:
            if other.adopted and not other.reporters:
                continue  # a leftover of a crashed coordinator: it times out on its own
            if other.phase is Phase.COMMITTING:
                self._abort(
                    st,
                    f"step {step}: {who} saved attempt {attempt} while attempt "
                    f"{other.attempt} of that step is being committed",
                )
                return None
            reason = (
                f"step {step}: ranks disagree on the save attempt: {other.describe()}, but {who} "
                f"saved attempt {attempt}. Every rank of one launch must derive the same attempt "
                "id (set CKPTD_RUN_ID to one value per launch on every rank); a job restarted "
                "while its predecessor was still saving this step ends here too, and its next "
                "step saves normally"
            )
            self._abort(other, reason)
            self._abort(st, reason)
            return None
        return st

    def _on_written(self, identity: bytes, msg: Written) -> None:
        key = (msg.step, msg.attempt)
        if self._finished_reply(identity, key):
            return
        who = f"rank {msg.rank} (node {msg.node})"
        st = self.attempts.get(key)
        if st is None:
            st = self._new_attempt(identity, msg.step, msg.attempt, msg.world_size, who)
            if st is None:
                return
        st.reporters.add(identity)
        if st.world_size == 0:  # adopted: the first report tells
            st.world_size = msg.world_size
        if st.phase is not Phase.COLLECTING:
            log.warning(
                "step %d attempt %s: WRITTEN from rank %d while %s; ignored",
                msg.step,
                msg.attempt,
                msg.rank,
                st.phase.value,
            )
            return
        try:
            if msg.world_size != st.world_size:
                raise ProtocolError(
                    f"world size {msg.world_size}, other ranks of attempt {msg.attempt} "
                    f"said {st.world_size}; every rank of the job must use one "
                    "Checkpointer setup"
                )
            if not 0 <= msg.rank < st.world_size:
                raise ProtocolError(f"rank {msg.rank} outside world size {st.world_size}")
            records = [ItemRecord.from_wire(r) for r in msg.records]
            if msg.rank in st.records:
                if (
                    records == st.records[msg.rank]
                    and msg.file_nbytes == st.file_nbytes[msg.rank]
                    and (msg.rank != 0 or msg.common == st.common)
                ):
                    self.duplicates += 1
                    log.warning(
                        "step %d attempt %s: ignored a repeated WRITTEN of rank %d (node %d)",
                        msg.step,
                        msg.attempt,
                        msg.rank,
                        msg.node,
                    )
                    return
                raise ProtocolError(
                    f"rank {msg.rank} reported attempt {msg.attempt} of step {msg.step} twice, differently"
                )
            name = self.store.data_file_name(msg.attempt, msg.rank)
            for r in records:
                if r.rank != msg.rank:
                    raise ProtocolError(f"rank {msg.rank} sent records of rank {r.rank}")
                if r.relative_path != name:
                    raise ProtocolError(
                        f"rank {msg.rank} sent a record stored in {r.relative_path!r}, not in its data file {name}"
                    )
            end = max((r.file_offset + r.length for r in records), default=0)
            if msg.file_nbytes < end:
                raise ProtocolError(
                    f"rank {msg.rank}'s data file {name} has {msg.file_nbytes} bytes, but its records address {end}"
                )
        except ProtocolError as exc:
            self._abort(st, f"{who}: {exc}")
            return
        st.records[msg.rank] = records
        st.file_nbytes[msg.rank] = msg.file_nbytes
        st.nodes[msg.rank] = msg.node
        st.digests[msg.rank] = msg.common_digest
        st.plain[msg.rank] = msg.plain_digest
        st.held[msg.rank] = msg.held
        if msg.rank == 0:
            st.common = msg.common
        if len(st.records) == st.world_size and self._settle(st):
            self._start_commit(st)

    def _on_failed(self, identity: bytes, msg: Failed) -> None:
        key = (msg.step, msg.attempt)
        if self._finished_reply(identity, key):
            return
        who = f"rank {msg.rank} (node {msg.node})" if msg.rank >= 0 else f"node {msg.node}"
        st = self.attempts.get(key)
        if st is None:
            if msg.rank < 0:
                # A node's local abort (it lost its coordinator) of an attempt this coordinator
                # never saw: record the outcome, so reports of it are answered, and clean up.
                self._remember(key, StepAborted(msg.step, msg.attempt, f"{who}: {msg.reason}"))
                self._finished_reply(identity, key)
                return
            st = self._new_attempt(identity, msg.step, msg.attempt, msg.world_size, who)
            if st is None:
                return
        st.reporters.add(identity)
        self._abort(st, f"{who}: {msg.reason}", skipped=msg.skipped)

    # --- the state machine ----------------------------------------------------------------
    def _settle(self, st: AttemptState) -> bool:
        """Keep one copy of each plain item several ranks wrote and check that every key a rank
        holds is stored (ckptd.format.coverage); False when the attempt aborted instead."""
        try:
            st.records, st.warnings = settle(st.records, st.held, st.plain)
        except ShardingError as exc:
            self._abort(st, f"the coordinator refused the commit: {exc}")
            return False
        for warning in st.warnings:
            log.warning("step %d attempt %s: %s", st.step, st.attempt, warning)
        return True

    def _start_commit(self, st: AttemptState) -> None:
        st.phase = Phase.COMMITTING
        records = [r for rank in sorted(st.records) for r in st.records[rank]]
        common = st.common if st.common is not None else serialize_common({})
        files = {self.store.data_file_name(st.attempt, rank): (rank, n) for rank, n in st.file_nbytes.items()}
        step, attempt = st.key

        def run() -> CommitOutcome:
            try:
                with gc_paused():  # ~20 objects per record (see ckptd.gcpause)
                    return self.store.commit(step, attempt, records, common, files)
            except OSError as exc:
                self.store.abort(step, attempt)
                raise StorageError.from_oserror(exc, self.store.display(tmp_dir_name(step, attempt))) from exc
            except BaseException:
                self.store.abort(step, attempt)
                raise

        log.info("step %d attempt %s: all %d ranks wrote; committing", step, attempt, st.world_size)
        self.workers.commit(step, attempt, run)

    def on_done(self, done: CommitFinished | CleanupFinished) -> None:
        """Handle a finished commit-thread job."""
        if isinstance(done, CleanupFinished):
            return
        step, attempt = done.step, done.attempt
        st = self.attempts.get((step, attempt))
        if st is None:
            return
        if done.error is None:
            st.phase = Phase.COMMITTED
            outcome: CommitOutcome = done.result
            warnings = _common_warnings(st) + st.warnings + list(outcome.warnings)
            uniform = uniform_digest(st.plain, st.world_size)
            self._finish(st, StepCommitted(step, attempt, outcome.name, warnings, plain_digest=uniform))
            log.info("step %d committed as %s (attempt %s)", step, outcome.name, attempt)
        else:
            st.phase = Phase.ABORTED
            self._finish(st, StepAborted(step, attempt, f"commit failed: {done.reason}"))

    def _abort(self, st: AttemptState, reason: str, *, skipped: bool = False) -> None:
        """End a collecting attempt everywhere; ``skipped``: a rank skipped it by policy, so the
        ranks resolve it as SKIPPED (ckptd.control.protocol.StepAborted)."""
        if st.phase is not Phase.COLLECTING:
            log.warning(
                "step %d attempt %s: ignoring failure while %s: %s", st.step, st.attempt, st.phase.value, reason
            )
            return
        st.phase = Phase.ABORTED
        log.warning("step %d attempt %s aborted: %s", st.step, st.attempt, reason)
        step, attempt = st.key
        self.workers.cleanup(step, attempt, lambda: self.store.abort(step, attempt))
        self._finish(st, StepAborted(step, attempt, reason, skipped))

    def _remember(self, key: Key, outcome: Message) -> None:
        self.finished[key] = outcome
        while len(self.finished) > _FINISHED_MEMORY:
            self.finished.popitem(last=False)

    def _finish(self, st: AttemptState, outcome: Message) -> None:
        self.attempts.pop(st.key, None)
        self._remember(st.key, outcome)
        for identity in set(self.nodes) | st.reporters:
            self.ep.send(outcome, identity, block=False)

    def tick(self, now: float) -> None:
        for st in list(self.attempts.values()):
            if st.phase is Phase.COLLECTING and now - st.started_s > self.config.commit_timeout_s:
                missing = sorted(set(range(st.world_size)) - set(st.records))
                self._abort(
                    st,
                    f"ranks {missing} did not report within {self.config.commit_timeout_s:g} s "
                    "(CKPTD_COMMIT_TIMEOUT_S): their trainer or node daemon may have died, or "
                    "their storage is too slow (raise the timeout if so)",
                )

    def rejected(self) -> dict[str, int]:
        """Rejections on the coordinator's port, by kind."""
        return {"malformed": self.ep.rejected, "duplicate": self.duplicates, **self.watch.counts()}

    def status(self) -> dict[str, Any]:
        rejected = self.rejected()
        return {
            "address": self.address,
            "nodes": sorted(n for n in self.nodes.values() if n >= 0),
            "steps": {
                f"{s}/{a}": {
                    "step": s,
                    "attempt": a,
                    "phase": st.phase.value,
                    "written": sorted(st.records),
                    "world_size": st.world_size,
                }
                for (s, a), st in self.attempts.items()
            },
            "rejected_messages": sum(rejected.values()),
            "rejected": rejected,
        }

    def close(self) -> None:
        self.watch.close()
        self.ep.close()


def _common_warnings(st: AttemptState) -> list[str]:
    """A warning when some ranks' common state differs from rank 0's (only rank 0's is saved)."""
    differing = differing_ranks([st.digests.get(r) or None for r in range(st.world_size)])
    if not differing:
        return []
    text = (
        f"step {st.step}: the common state of ranks {differing} differs from rank 0's; only rank 0's "
        "is saved (keep per-rank values in ShardedObjects)"
    )
    log.warning("%s", text)
    return [text]
