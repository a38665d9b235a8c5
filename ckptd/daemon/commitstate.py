"""The coordinator's decisions: a pure state machine over the job's save attempts.

:class:`CommitState` knows every attempt in flight and the outcome of recently finished ones;
``handle(event, now)`` applies one event and returns the actions that follow, in order. It reads no
clock (``now`` comes with the event), opens no socket and no file: the shell
(ckptd.daemon.coordinator) feeds it what arrived on the coordinator's port and what the commit
thread finished, asks the root what the machine needs to know first (:meth:`CommitState.asks_holds_commit`,
:meth:`CommitState.may_start`),
and executes the actions: sends, the commit itself (via the RootStore, on the commit thread) and
the removal of an attempt's files.

Each attempt of a step (ckptd.control.attempt)::

    COLLECTING --(all world_size ranks WRITTEN)--> COMMITTING --(commit ok)--> COMMITTED
        |                                              |
        +--(FAILED / SKIP / bad records / timeout)-----+--(commit error)-----> ABORTED

A WRITTEN whose records contradict its attempt or itself is bad (ckptd.daemon.reportcheck).

Only reports addressed to this coordinator instance count (``coordinator_instance``: the node
learnt it from a ``PONG``); one addressed to another instance is dropped and counted
(:attr:`CommitState.misaddressed`): it was sent to a predecessor that is gone, and its node takes
its attempt for lost (ckptd.daemon.uplinkstate), so counting it here could commit an attempt that
node's ranks were told aborted.

COMMITTED and ABORTED are announced to every node known and to the attempt's reporters
(``STEP_COMMITTED`` / ``STEP_ABORTED``); an aborted attempt's files are removed. A report about a
finished attempt (a late FAILED, a duplicate) is answered with that outcome again and its files,
which a late writer may have re-created, are removed: it is never counted for another attempt, so
a step aborted a moment ago can be saved again at once. A report the commit counted (a node's
resend) is answered with it whatever came since; a new save's report of that attempt id is
collected anew (ckptd.daemon.countedreports); one of unknown origin is answered from memory only
while the root still holds the commit (else it starts a new attempt).

Once every rank reported, one copy of each plain item several ranks wrote is kept, and a commit
that would not store every key some rank holds aborts, naming the key (ckptd.format.coverage).
Two attempts of one step collecting at the same time mean that its ranks disagree on the attempt:
both abort, naming ranks and attempts. A rank's FAILED of an attempt not known here (a write that
outlived its attempt's abort by a predecessor, reported as the step's retry collects) aborts that
attempt alone. A relaunch's abandon (a FAILED of a node carrying
``handed_off``: ckptd.client.settle) aborts a collecting attempt on every node, but keeps one whose
reports and the ranks found handed off make up its world (a node daemon that reported died since).
Attempts adopted at start (``<step>.<attempt>.tmp`` left by a crashed coordinator) are collected
like others and time out like others, but do not keep the daemon busy until someone reports on
them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..config import CkptdConfig
from ..control.protocol import Failed, Message, StepAborted, StepCommitted, Written
from ..control.wiretext import bounded_text, bounded_warnings
from ..errors import ProtocolError, ShardingError
from ..format.coverage import settle, uniform_digest
from ..format.finalize import serialize_common
from ..lineage import agreed_went_back, loads_agree
from ..statedict.digest import differing_ranks
from .commitevents import (
    Action,
    AttemptState,
    Commit,
    CommitEnded,
    Event,
    Key,
    NodeSeen,
    Phase,
    Remove,
    ReportIn,
    RootFacts,
    Send,
    Tick,
)
from .countedreports import CountedReports
from .reportcheck import checked_records

log = logging.getLogger(__name__)

FINISHED_MEMORY = 1024  # outcomes remembered, for late and repeated reports
COMMIT_FILES_MEMORY = 4  # node-local commits whose files a repeated verdict carries again


class CommitState:
    """The attempts of one job's coordinator. Order of use: construct (with this coordinator's
    instance and the attempts the root's recovery adopted), then for each report addressed here
    (:meth:`addressed_here`; :meth:`handle` drops others) ask :meth:`asks_holds_commit` and
    :meth:`may_start`, build the facts, and :meth:`handle` it; :meth:`handle` every finished
    commit and a :class:`Tick` now and then."""

    def __init__(
        self,
        config: CkptdConfig,
        data_file_name: Callable[[str, int], str],
        *,
        instance: str,
        adopted: list[Key] | None = None,
        now: float,
        local_node: int | None = None,
    ) -> None:
        self.config = config
        # A node-local root (ckptd.roots.nodelocal): the coordinator's node, whose files alone the
        # commit can check; None: one root every node writes into.
        self.local_node = local_node
        # The files of the latest node-local commits, sent to the nodes with the verdict (again
        # with a repeated one); never kept with the outcomes remembered, which are many.
        self.commit_files: OrderedDict[Key, dict[str, bytes]] = OrderedDict()
        self.data_file_name = data_file_name  # the root's naming of a rank's data file (pure)
        self.instance = instance  # this coordinator's (its daemon's), as its PONGs name it
        self.duplicates = 0  # repeated WRITTENs ignored (identical to the one counted)
        self.misaddressed = 0  # reports addressed to another coordinator instance, dropped
        self.nodes: dict[bytes, int] = {}
        self.attempts: dict[Key, AttemptState] = {}
        self.finished: OrderedDict[Key, Message] = OrderedDict()
        # What recent commits counted (ckptd.daemon.countedreports): a node resends a report
        # commit_timeout_s + coordinator_timeout_s after it, then every coordinator_timeout_s.
        self.counted = CountedReports(config.commit_timeout_s + 2 * config.coordinator_timeout_s)
        self._out: list[Action] = []
        for step, attempt in adopted or []:
            # Another node may still be writing it (it may even commit); if it does not complete
            # within the commit timeout, it aborts like any attempt and its files are removed.
            self.attempts[(step, attempt)] = AttemptState(step, attempt, 0, now, adopted=True)

    @property
    def busy(self) -> bool:
        """Attempts are in flight (adopted leftovers nobody reported on do not count)."""
        return any(not st.adopted or st.reporters for st in self.attempts.values())

    def addressed_here(self, msg: Written | Failed) -> bool:
        """Whether report ``msg`` is addressed to this coordinator instance (else :meth:`handle`
        drops it, and the root need not be asked anything)."""
        return msg.coordinator_instance == self.instance

    def asks_holds_commit(self, msg: Written | Failed) -> bool:
        """Report ``msg`` needs ``RootFacts.holds_commit``: its attempt's commit is remembered, and
        whether the report is one that commit counted is unknown (ckptd.daemon.countedreports).
        A report it counted is answered from memory: that commit happened, whether or not
        retention or a rollback retired it since (collecting it anew would abort, or on S3 commit
        again, an attempt that committed). A report of a new save is collected anew (and aborted
        while the step is committed). A node's FAILED of rank -1 (its local abort, a relaunch's
        abandon) never retires a remembered commit: it is answered with it. A rank's FAILED is a
        new save's whatever the root says (:meth:`_new_save_of_committed`)."""
        if not isinstance(self.finished.get((msg.step, msg.attempt)), StepCommitted):
            return False
        if isinstance(msg, Failed):
            return False
        return self.counted.counted(msg) is None

    def _new_save_of_committed(self, msg: Written | Failed, facts: RootFacts) -> bool:
        """Whether ``msg`` is a new save's report of an attempt whose commit is remembered. A rank's
        FAILED always is: a commit counted a WRITTEN of every rank (answered from memory, a refused
        re-save under a repeated attempt id was told COMMITTED)."""
        if not isinstance(self.finished.get((msg.step, msg.attempt)), StepCommitted):
            return False
        if isinstance(msg, Failed) and msg.rank >= 0:
            return True
        counted = self.counted.counted(msg)
        if counted is not None:
            return not counted
        return self.asks_holds_commit(msg) and not facts.holds_commit

    def may_start(self, msg: Written | Failed, holds_commit: bool) -> bool:
        """A report ``msg`` needs ``RootFacts.committed_once``: it starts collecting a new attempt
        (a node's local abort of an unknown attempt never does)."""
        key = (msg.step, msg.attempt)
        if key in self.attempts or (isinstance(msg, Failed) and msg.rank < 0):
            return False
        return key not in self.finished or self._new_save_of_committed(msg, RootFacts(holds_commit=holds_commit))

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply ``event`` at time ``now``; the actions to execute, in order."""
        self._out = []
        if isinstance(event, NodeSeen):
            self.nodes.setdefault(event.identity, -1)
        elif isinstance(event, ReportIn) and not self.addressed_here(event.msg):
            self._drop_misaddressed(event.msg)
        elif isinstance(event, ReportIn):
            self.nodes[event.identity] = event.msg.node
            if isinstance(event.msg, Written):
                self._on_written(event.identity, event.msg, event.facts, now)
            else:
                self._on_failed(event.identity, event.msg, event.facts, now)
        elif isinstance(event, CommitEnded):
            self._on_commit_ended(event, now)
        elif isinstance(event, Tick):
            self._on_tick(now)
        self._start_ready()
        out, self._out = self._out, []
        return out

    # --- reports -----------------------------------------------------------------------------
    def _drop_misaddressed(self, msg: Written | Failed) -> None:
        self.misaddressed += 1
        log.info(
            "step %d attempt %s: dropped the %s of rank %d (node %d) addressed to coordinator instance "
            "%r, not to this one (%s): sent to a predecessor before its node learnt of the restart",
            msg.step,
            msg.attempt,
            msg.TYPE.name,
            msg.rank,
            msg.node,
            msg.coordinator_instance[:64],
            self.instance,
        )

    def _finished_reply(self, identity: bytes, msg: Written | Failed, facts: RootFacts) -> bool:
        """Answer a report about a finished attempt with its outcome; False if it is not finished."""
        key = (msg.step, msg.attempt)
        if self.counted.counted(msg):  # a resend: its commit answers it, whatever came since
            if key in self.attempts:
                # A new save of that attempt id is collected: the node's one entry for the attempt
                # would take this verdict for the new save's ranks too. It resends later.
                return True
            outcome: Message | None = self.counted.outcome(msg)
        else:
            outcome = self.finished.get(key)
        if outcome is None:
            return False
        if outcome is self.finished.get(key) and not facts.known and self.asks_holds_commit(msg):
            # A resend of a report that commit counted, or a new save's under a repeated attempt id
            # after a rollback retired it: only the root tells, and it could not be asked. Either
            # answer may be wrong (COMMITTED to a save never committed, or an abort of a commit):
            # nothing is said, and the node resends the report later.
            log.warning(
                "step %d attempt %s: whether the %s of rank %d is of its remembered commit is unknown while "
                "the root cannot be asked; left for the node's resend",
                msg.step,
                msg.attempt,
                msg.TYPE.name,
                msg.rank,
            )
            return True
        if outcome is self.finished.get(key) and self._new_save_of_committed(msg, facts):
            # A new save's report (a relaunch repeated the attempt id, or the root was emptied):
            # never answered from memory, and its files are not junk; the commit's memory stays.
            return False
        self._out.append(Send(identity=identity, msg=self._as_sent(key, outcome), block=True))
        if key not in self.attempts:  # (a new save of the attempt id is collected: its files stay)
            # A late writer may have re-created the attempt's files; the attempt is decided, so they are junk.
            self._out.append(Remove(step=key[0], attempt=key[1]))
        return True

    def _new_attempt(
        self, identity: bytes, msg: Written | Failed, facts: RootFacts, who: str, now: float
    ) -> AttemptState | None:
        """Start collecting ``(step, attempt)``; None when it aborted at once (the step committed
        already, or another attempt of it is in flight)."""
        step, attempt = msg.step, msg.attempt
        refused = f"step {step} is committed already; {who} saved it again as attempt {attempt} (save under a new step)"
        # (Node-local disks never replace a step a job left: it loaded a step there too.)
        if isinstance(msg, Written) and 0 <= msg.went_back_to < step and self.local_node is None:
            refused = (
                f"step {step} is committed already; {who} saved it again as attempt {attempt} after loading step "
                f"{msg.went_back_to}: a step committed since that load, or one with a step the job left below it "
                f"(between {msg.went_back_to} and {step}), which is saved again first (save under a new step)"
            )
        remembered = isinstance(self.finished.get((step, attempt)), StepCommitted) or (step, attempt) in self.counted
        if remembered and (facts.committed_once or not facts.known):
            # The attempt id of that very commit (a relaunch repeated it): the reporter alone is
            # told. An abort of the attempt would go to every node, which takes it for the commit's
            # (and removes its files); so also when the root could not say whether it still stands.
            if not facts.known:
                refused = (
                    f"step {step} attempt {attempt} committed before, and the root could not be asked whether "
                    f"that commit still stands; {who} saved it again under that attempt id (save under a new step)"
                )
            log.warning("step %d attempt %s: %s", step, attempt, refused)
            self._out.append(Send(identity=identity, msg=StepAborted(step=step, attempt=attempt, reason=refused)))
            return None
        st = self.attempts[(step, attempt)] = AttemptState(step, attempt, msg.world_size, now)
        st.reporters.add(identity)
        if facts.committed_once:
            # A rank's failure says why it did not write; that the step is committed is said to
            # the ranks that did (a FAILED is asked the question without the job's went_back).
            self._abort(st, refused if isinstance(msg, Written) else f"{who}: {msg.reason}")
            return None
        for other in [o for o in self.attempts.values() if o.step == step and o is not st]:
            if other.adopted and not other.reporters:
                continue  # a leftover of a crashed coordinator: it times out on its own
            if other.phase in (Phase.READY, Phase.COMMITTING):
                self._abort(
                    st,
                    f"step {step}: {who} saved attempt {attempt} while attempt "
                    f"{other.attempt} of that step is being committed",
                )
                return None
            if isinstance(msg, Failed) and (step, attempt) not in self.finished and (step, attempt) not in self.counted:
                # A failure of an attempt this coordinator has no record of: most likely a write
                # that outlived the abort of that attempt by a predecessor (reported FAILED, as a
                # late write is: ckptd.daemon.intakestate) while the step's retry collects. It ends
                # only its own attempt (aborted by the caller); ranks that really disagree leave the
                # other one to its timeout, as when the FAILED comes first.
                log.warning(
                    "step %d attempt %s: %s failed an attempt not known here while attempt %s of the step "
                    "collects; only the failed one aborts",
                    step,
                    attempt,
                    who,
                    other.attempt,
                )
                return st
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

    def _on_written(self, identity: bytes, msg: Written, facts: RootFacts, now: float) -> None:
        key = (msg.step, msg.attempt)
        if self._finished_reply(identity, msg, facts):
            return
        who = f"rank {msg.rank} (node {msg.node})"
        st = self.attempts.get(key)
        if st is None:
            st = self._new_attempt(identity, msg, facts, who, now)
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
            records = checked_records(st, msg, self.data_file_name)
        except ProtocolError as exc:
            self._abort(st, f"{who}: {exc}")
            return
        if msg.report_id:
            st.report_ids.add(msg.report_id)
        if records is None:  # a repeated WRITTEN, identical to the one counted
            self.duplicates += 1
            return
        st.records[msg.rank] = records
        st.file_nbytes[msg.rank] = msg.file_nbytes
        st.nodes[msg.rank] = msg.node
        st.digests[msg.rank] = msg.common_digest
        st.plain[msg.rank] = msg.plain_digest
        st.held[msg.rank] = msg.held
        st.went_back[msg.rank] = (msg.went_back_to, msg.went_back_unix_s)
        st.disk_seq = max(st.disk_seq, msg.disk_seq)
        if msg.rank == 0:
            st.common = msg.common
        if len(st.records) == st.world_size and self._settle(st):
            st.phase = Phase.READY  # committed by _start_ready, in the order the attempts began

    def _on_failed(self, identity: bytes, msg: Failed, facts: RootFacts, now: float) -> None:
        key = (msg.step, msg.attempt)
        if self._finished_reply(identity, msg, facts):
            return
        who = f"rank {msg.rank} (node {msg.node})" if msg.rank >= 0 else f"node {msg.node}"
        st = self.attempts.get(key)
        if st is None:
            if msg.rank < 0 and self.local_node is not None:
                # A node-local root: a lost predecessor may have committed the attempt on its own
                # disk, and an ABORTED would make the node remove its files of that commit. They
                # stay (the mirror copy and a resume find them; else `ckptd gc` removes them).
                log.info("step %d attempt %s: %s aborted it on its own: %s", msg.step, msg.attempt, who, msg.reason)
                return
            if msg.rank < 0:
                # A node's local abort (it lost its coordinator), or a relaunch's abandon, of an
                # attempt this coordinator never saw: record the outcome, so reports of it are
                # answered, and clean up.
                outcome = StepAborted(step=msg.step, attempt=msg.attempt, reason=bounded_text(f"{who}: {msg.reason}"))
                self._remember(key, outcome)
                self._finished_reply(identity, msg, facts)
                if msg.handed_off:  # a relaunch's abandon: the other nodes holding its parts learn it now
                    self._out.extend(Send(identity=n, msg=outcome) for n in sorted(set(self.nodes) - {identity}))
                return
            st = self._new_attempt(identity, msg, facts, who, now)
            if st is None:
                return
        if msg.abandoned_by and set(msg.abandoned_by) <= set(st.records):
            # Their dead node daemon wrote and reported their saves (the ranks could not know).
            log.info("step %d attempt %s: ranks %s' reports are counted: not abandoned", *key, msg.abandoned_by)
            return
        st.reporters.add(identity)
        if msg.handed_off and st.world_size > 0 and set(st.records) | set(msg.handed_off) >= set(range(st.world_size)):
            log.info(
                "step %d attempt %s: %s asked to abandon it, but the ranks that reported it and those found "
                "handed off make up its world (a node daemon that reported died since): it commits once written",
                msg.step,
                msg.attempt,
                who,
            )
            return
        self._abort(st, f"{who}: {msg.reason}", skipped=msg.skipped)

    # --- transitions ---------------------------------------------------------------------------
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

    def _start_ready(self) -> None:
        """Commit the attempts every rank wrote, in the order their collection began, each once
        none begun before it is still collecting (it commits, or aborts, within
        ``commit_timeout_s``). Reports can arrive out of that order (a node cut off resends what
        it wrote meanwhile all at once): a step committed after a higher one is a rollback to
        the commit order, and retention then removed the higher step, which had committed."""
        waiting = sorted(self.attempts.values(), key=lambda a: a.started_s)
        for st in waiting:
            if st.phase is Phase.READY:
                self._start_commit(st)
            elif st.phase is Phase.COLLECTING and (st.reporters or not st.adopted):
                return  # (a crashed coordinator's leftover nobody reports on holds nothing up)

    def _start_commit(self, st: AttemptState) -> None:
        st.phase = Phase.COMMITTING
        records = [r for rank in sorted(st.records) for r in st.records[rank]]
        common = st.common if st.common is not None else serialize_common({})
        files = {self.data_file_name(st.attempt, rank): (rank, n) for rank, n in st.file_nbytes.items()}
        elsewhere = frozenset(
            name
            for name, (rank, _) in files.items()
            if self.local_node is not None and st.nodes.get(rank) != self.local_node
        )
        log.info("step %d attempt %s: all %d ranks wrote; committing", st.step, st.attempt, st.world_size)
        self._out.append(
            Commit(
                step=st.step,
                attempt=st.attempt,
                records=records,
                common=common,
                files=files,
                elsewhere=elsewhere,
                went_back=agreed_went_back(st.went_back.values()),
                went_back_agreed=loads_agree(st.went_back.values()),
                seq_floor=st.disk_seq,
            )
        )

    def _on_commit_ended(self, event: CommitEnded, now: float) -> None:
        st = self.attempts.get((event.step, event.attempt))
        if st is None:
            return
        if event.error is None and event.outcome is not None:
            st.phase = Phase.COMMITTED
            warnings = _common_warnings(st) + st.warnings + list(event.outcome.warnings)
            uniform = uniform_digest(st.plain, st.world_size)
            name = event.outcome.name
            if event.outcome.files:
                self.commit_files[st.key] = event.outcome.files
                while len(self.commit_files) > COMMIT_FILES_MEMORY:
                    self.commit_files.popitem(last=False)
            committed = StepCommitted(
                step=st.step, attempt=st.attempt, name=name, warnings=bounded_warnings(warnings), plain_digest=uniform
            )
            self.counted.remember(st.key, st.report_ids, committed, now)
            self._finish(st, committed)
            log.info("step %d committed as %s (attempt %s)", st.step, name, st.attempt)
        else:
            st.phase = Phase.ABORTED
            reason = bounded_text(f"commit failed: {event.error}")
            self._finish(st, StepAborted(step=st.step, attempt=st.attempt, reason=reason))

    def _abort(self, st: AttemptState, reason: str, *, skipped: bool = False) -> None:
        """End a collecting attempt everywhere; ``skipped``: a rank skipped it by policy, so the
        ranks resolve it as SKIPPED (ckptd.control.protocol.StepAborted)."""
        if st.phase not in (Phase.COLLECTING, Phase.READY):  # READY: not handed to the commit thread yet
            log.warning(
                "step %d attempt %s: ignoring failure while %s: %s", st.step, st.attempt, st.phase.value, reason
            )
            return
        st.phase = Phase.ABORTED
        log.warning("step %d attempt %s aborted: %s", st.step, st.attempt, reason)
        self._out.append(Remove(step=st.step, attempt=st.attempt))
        self._finish(st, StepAborted(step=st.step, attempt=st.attempt, reason=bounded_text(reason), skipped=skipped))

    def _remember(self, key: Key, outcome: Message) -> None:
        self.finished[key] = outcome
        while len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)

    def _as_sent(self, key: Key, outcome: Message) -> Message:
        """``outcome`` as the nodes are told it: a node-local commit's with its files, while they
        are among the latest remembered."""
        files = self.commit_files.get(key)
        return replace(outcome, local_files=files) if isinstance(outcome, StepCommitted) and files else outcome

    def _finish(self, st: AttemptState, outcome: Message) -> None:
        self.attempts.pop(st.key, None)
        self._remember(st.key, outcome)
        sent = self._as_sent(st.key, outcome)
        for identity in sorted(set(self.nodes) | st.reporters):
            self._out.append(Send(identity=identity, msg=sent))

    def _on_tick(self, now: float) -> None:
        for st in list(self.attempts.values()):
            if st.phase is Phase.COLLECTING and now - st.started_s > self.config.commit_timeout_s:
                missing = [r for r in range(st.world_size) if r not in st.records]
                named = f"{missing[:16]}" if len(missing) <= 16 else f"{missing[:16]} and {len(missing) - 16} more"
                self._abort(
                    st,
                    f"ranks {named} did not report within {self.config.commit_timeout_s:g} s "
                    "(CKPTD_COMMIT_TIMEOUT_S): their trainer or node daemon may have died, or "
                    "their storage is too slow (raise the timeout if so)",
                )

    def status(self) -> dict[str, Any]:
        """The nodes known and the attempts in flight."""
        return {
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
        }


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
