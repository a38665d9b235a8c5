"""The job's coordinator: collects every rank's WRITTEN, commits the step, announces the outcome.

It lives in node 0's daemon and shares its loop (a CurveZMQ ROUTER socket on ``tcp://``; node
daemons, node 0's included, connect with DEALER sockets). This module is the shell: it receives,
asks the root what a decision needs, and executes what the pure state machine
(ckptd.daemon.commitstate, which describes the attempts' states and rules) decides: sends, and on
the commit thread the commit itself and the removal of an attempt's files. Commits run one at a
time on the commit thread, in the order attempts complete; before it makes an attempt visible the
commit checks that every rank's data file is there with the size its writer reported
(ckptd.roots).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from ..config import CkptdConfig
from ..control.channel import Channel, link_timeout_s, make_socket, replace_dead_links
from ..control.codec import Codec
from ..control.keys import CurveKeys
from ..control.netaddr import is_ipv6
from ..control.protocol import Failed, Message, Ping, Pong, Status, StatusReply, Written
from ..control.security import HandshakeWatch
from ..errors import CkptdError, ProtocolError, StorageError
from ..format.rootlayout import step_dir_name, tmp_dir_name
from ..gcpause import gc_paused
from ..lineage import agreed_went_back
from ..roots.base import CommitOutcome, RootStore
from .commitevents import (
    Action,
    Commit,
    CommitEnded,
    Event,
    Key,
    NodeSeen,
    Remove,
    ReportIn,
    RootFacts,
    Send,
    Tick,
)
from .commitstate import CommitState
from .guard import InternalErrors
from .loop import serve_requests
from .rootquestions import Question, answer
from .workers import CleanupFinished, CommitFinished, RootAnswered, WorkerPools

log = logging.getLogger(__name__)


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
        *,
        internal: InternalErrors,
        node: int = 0,
    ) -> None:
        self.store = store
        self.internal = internal  # the daemon's count of internal errors (ckptd.daemon.guard)
        self.root = store.location
        self.config = config
        self.workers = workers
        self.instance = instance
        sock = make_socket(ctx, zmq.ROUTER, codec, keys, server=True)
        replace_dead_links(sock, config.heartbeat_s, link_timeout_s(config.heartbeat_s, config.coordinator_timeout_s))
        self.watch = HandshakeWatch(sock, "coordinator")  # before bind: no connection unwatched
        self.address = _bind(sock, bind)
        self.also: list[str] = []  # addresses later launches have it at (see listen)
        self.channel = Channel(sock, codec, "coordinator")
        self.state = CommitState(
            config,
            store.data_file_name,
            instance=instance,
            adopted=adopt,
            now=time.monotonic(),
            local_node=node if config.node_local else None,  # ckptd.roots.nodelocal
        )
        # reports waiting for the root's answer to the first of them, by attempt
        self.asking: dict[Key, list[tuple[bytes, Written | Failed]]] = {}
        self.asked: dict[Key, tuple[Question, float]] = {}  # the question asked, and when (monotonic)
        # Answers still to come of questions given up on (see tick), by attempt: the asking thread
        # answers in order, so the next answers of an attempt are those.
        self.late: dict[Key, int] = {}
        log.info("coordinator of %s listening on %s", store.display(), self.address)

    @property
    def busy(self) -> bool:
        """Attempts are in flight (adopted leftovers nobody reported on do not count)."""
        return self.state.busy

    # --- messages -----------------------------------------------------------------------------
    def on_readable(self) -> None:
        serve_requests(self.channel, self._dispatch)

    def _dispatch(self, identity: bytes, msg: Message, _peer: str | None) -> None:
        if isinstance(msg, Ping):
            self._handle(NodeSeen(identity=identity))
            self.channel.send(Pong(nonce=msg.nonce, instance=self.instance, pid=os.getpid()), identity)
        elif isinstance(msg, (Written, Failed)):
            self._report(identity, msg)
        elif isinstance(msg, Status):
            self.channel.send(StatusReply(info=self.status()), identity)
        else:
            raise ProtocolError(f"the coordinator does not accept {msg.TYPE.name}")

    def _question(self, msg: Written | Failed) -> Question | None:
        """What the root must be asked before the state machine decides on ``msg`` (None: nothing)."""
        if not self.state.addressed_here(msg):
            return None  # dropped by the state machine
        question = Question(
            step=msg.step,
            attempt=msg.attempt,
            holds_commit=self.state.asks_holds_commit(msg),
            committed_once_if_held=self.state.may_start(msg, True),
            committed_once_if_not=self.state.may_start(msg, False),
            went_back=agreed_went_back([(msg.went_back_to, msg.went_back_unix_s)])
            if isinstance(msg, Written)
            else None,
        )
        return question if question.asks else None

    def _report(self, identity: bytes, msg: Written | Failed) -> None:
        """Handle a report, after the root answered what its decision needs. The root is asked on
        a worker thread (an object store that hangs must not stop the coordinator's loop), and
        later reports of the attempt wait behind the one asking, so they are handled in order."""
        key = (msg.step, msg.attempt)
        waiting = self.asking.get(key)
        if waiting is not None:
            waiting.append((identity, msg))
            return
        question = self._question(msg)
        if question is None:
            self._handle(ReportIn(identity=identity, msg=msg))
            return
        self.asking[key] = [(identity, msg)]
        self.asked[key] = (question, time.monotonic())
        self.workers.ask(question, lambda: answer(self.store, question))

    def _on_answer(self, done: RootAnswered) -> None:
        question: Question = done.question
        key = (question.step, question.attempt)
        if self.late.get(key):
            self.late[key] -= 1  # decided without it already
            if not self.late[key]:
                del self.late[key]
            return
        if isinstance(done.result, RootFacts):
            self._decide(question, done.result)
        else:
            self._decide_unknown(question, done.reason)

    def _decide_unknown(self, question: Question, why: str) -> None:
        log.warning(
            "step %d attempt %s: %s could not be asked about the step (%s); deciding without it "
            "(the commit checks again)",
            question.step,
            question.attempt,
            self.store.display(),
            why,
        )
        self._decide(question, question.unknown())

    def _decide(self, question: Question, facts: RootFacts) -> None:
        key = (question.step, question.attempt)
        self.asked.pop(key, None)
        waiting = self.asking.pop(key, [])
        for n, (identity, msg) in enumerate(waiting):
            if n == 0 and self._question(msg) == question:
                if not facts.holds_commit:
                    log.warning(
                        "step %d attempt %s: reported again, but %s no longer holds that commit; collecting it anew",
                        msg.step,
                        msg.attempt,
                        self.store.display(step_dir_name(msg.step)),
                    )
                self._handle(ReportIn(identity=identity, msg=msg, facts=facts))
            else:  # the state moved on meanwhile (or a later report): decide afresh, asking again if need be
                self._report(identity, msg)

    def _handle(self, event: Event) -> None:
        self._execute_each(self.state.handle(event, time.monotonic()))

    def _execute_each(self, actions: list[Action]) -> None:
        """Execute ``actions`` in order, each on its own: the state machine moved on whatever one's
        fate, so one that fails (a bug, an exhausted resource) is logged and counted as an internal
        error (ckptd.daemon.guard) and the others still run. (A failed send ended the loop: the
        Commit after it was lost, and its attempt stayed committing for ever.) A Commit that could
        not be started ends as a failed commit: its attempt aborts."""
        for action in actions:
            try:
                self._execute(action)
            except Exception as exc:  # noqa: BLE001 - logged with its traceback and counted
                self.internal.record(f"coordinator's {type(action).__name__}", exc)
                if isinstance(action, Commit):
                    error = f"it could not be started: {type(exc).__name__}: {exc}"
                    self._execute_each([Remove(step=action.step, attempt=action.attempt)])  # (as a failed one's)
                    self._handle(CommitEnded(step=action.step, attempt=action.attempt, error=error))
                elif isinstance(action, Send):
                    log.error(
                        "step %s attempt %s: the coordinator could not send %s (the INTERNAL ERROR above); a "
                        "node that got no verdict resends its reports",
                        getattr(action.msg, "step", "?"),
                        getattr(action.msg, "attempt", "?"),
                        action.msg.TYPE.name,
                    )

    def _execute(self, action: Action) -> None:
        if isinstance(action, Send):
            self.channel.send(action.msg, action.identity, block=action.block)
        elif isinstance(action, Remove):
            step, attempt = action.step, action.attempt
            self.workers.cleanup(step, attempt, lambda: self.store.abort(step, attempt))
        elif isinstance(action, Commit):
            self._start_commit(action)

    def _start_commit(self, c: Commit) -> None:
        def run() -> CommitOutcome:
            try:
                with gc_paused():  # ~20 objects per record (see ckptd.gcpause)
                    return self.store.commit(
                        c.step,
                        c.attempt,
                        c.records,
                        c.common,
                        c.files,
                        elsewhere=c.elsewhere,
                        went_back=c.went_back,
                        went_back_agreed=c.went_back_agreed,
                        seq_floor=c.seq_floor,
                    )
            except OSError as exc:
                self.store.abort(c.step, c.attempt)
                raise StorageError.from_oserror(exc, self.store.display(tmp_dir_name(c.step, c.attempt))) from exc
            except BaseException:
                self.store.abort(c.step, c.attempt)
                raise

        self.workers.commit(c.step, c.attempt, run)

    def on_done(self, done: CommitFinished | CleanupFinished | RootAnswered) -> None:
        """Handle a finished commit-thread job (a cleanup needs nothing more) or a root's answer."""
        if isinstance(done, RootAnswered):
            self._on_answer(done)
        elif isinstance(done, CommitFinished):
            outcome = done.result if done.error is None else None
            error = None if done.error is None else done.reason
            self._handle(CommitEnded(step=done.step, attempt=done.attempt, outcome=outcome, error=error))

    def tick(self, now: float) -> None:
        self._stop_asking(now)
        self._execute_each(self.state.handle(Tick(), now))

    def _stop_asking(self, now: float) -> None:
        """Decide without the root's answer once a question has waited ``coordinator_timeout_s``
        (a hung disk or store): its attempt's reports, FAILED ones included, were held until the
        answer came, and no step was ever aborted while the root hung. Deciding without it is
        what a failed question does (the commit refuses a committed step all the same)."""
        bound_s = self.config.coordinator_timeout_s
        for key, (question, asked_s) in list(self.asked.items()):
            if now - asked_s > bound_s:
                self.late[key] = self.late.get(key, 0) + 1
                self._decide_unknown(question, f"no answer within coordinator_timeout_s={bound_s:g}")

    def rejected(self) -> dict[str, int]:
        """Rejections on the coordinator's port, by kind."""
        return {
            "malformed": self.channel.rejected,
            "duplicate": self.state.duplicates,
            "misaddressed": self.state.misaddressed,
            **self.watch.counts(),
        }

    def status(self) -> dict[str, Any]:
        rejected = self.rejected()
        return {
            "address": self.address,
            "also_listening_on": list(self.also),
            **self.state.status(),
            "rejected_messages": sum(rejected.values()),
            "rejected": rejected,
        }

    def listen(self, address: str) -> None:
        """Accept node daemons on ``address`` too: a rank's HELLO says its launch has the
        coordinator there (ckptd.control.protocol.Hello). This daemon outlived the launch that
        started it, and the job was launched again with another MASTER_PORT (or another address of
        this machine): a node daemon the new launch starts connects there. An address bound
        already is no news."""
        if address in (self.address, *self.also):
            return
        try:
            bound = _bind(self.channel.sock, address)
        except zmq.ZMQError as exc:
            raise CkptdError(
                f"this launch has the coordinator of {self.store.display()} at {address}, but node 0's "
                f"node daemon (pid {os.getpid()}), left by an earlier launch, serves it at {self.address} "
                f"and cannot listen on {address} too: {exc}. Stop that daemon (`ckptd daemon stop "
                f"--root ...`) once no save is in flight, or give every launch of the job the same "
                "CKPTD_COORDINATOR_PORT"
            ) from None
        self.also.append(bound)
        log.warning(
            "the ranks' launch has the coordinator at %s (an earlier launch's at %s): listening there too",
            bound,
            self.address,
        )

    def close(self) -> None:
        self.watch.close()
        self.channel.close()


def _bind(sock: zmq.Socket, address: str) -> str:
    """Bind ``address`` (port 0: any free port); the address bound."""
    if is_ipv6(address):
        sock.setsockopt(zmq.IPV6, 1)
    if address.endswith(":0"):
        address = address[: -len(":0")] + ":*"
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
