"""A node daemon's link to the job's coordinator: the socket shell of ckptd.daemon.uplinkstate.

The link is a CurveZMQ DEALER connected to the coordinator (node 0's daemon, this very daemon on
node 0). What to send when, and which ranks learn which verdict, is decided by the pure
:class:`~ckptd.daemon.uplinkstate.UplinkState` (its docstring gives the rules: the table of
unacknowledged reports, the resend timer, the heartbeat and the local aborts); this module feeds
it what arrives and the time, sends what it says (telling it whether each send went out) and
hands verdicts to ``deliver``. Order of one attempt, as this node sees it:

1. a rank's SAVE is taken: :meth:`CoordinatorLink.expect` records the rank to notify (unless the
   attempt was decided already: another rank skipped or failed it first; :meth:`verdict` then
   tells the outcome, which the rank gets right after its SAVE_ACK, and its write is skipped);
2. its write finished: :meth:`CoordinatorLink.report` sends ``WRITTEN`` (or ``FAILED``), addressed
   to the coordinator instance that last answered a ping (none before one answered);
3. ``STEP_COMMITTED`` / ``STEP_ABORTED`` arrives (:meth:`on_readable`): the step resolves and
   ``deliver`` tells its ranks. If the coordinator is lost first, the root is asked on the
   asking thread whether the attempt committed (``RootStore.holds_commit``; its answer comes back
   through :meth:`on_root_checked`), and the ranks are told that instead.

A connection that carried nothing for the link timeout is replaced
(ckptd.control.channel.replace_dead_links: a partition must not leave reports stuck in TCP's
retransmission back-off).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import zmq

from ..config import CkptdConfig
from ..control.channel import Channel, link_timeout_s, make_socket, replace_dead_links
from ..control.codec import Codec
from ..control.keys import CurveKeys
from ..control.netaddr import is_ipv6
from ..control.protocol import ErrorReply, Failed, Message, Pong, StepAborted, StepCommitted, Written
from ..roots.base import RootStore
from . import uplinkstate as us
from .guard import InternalErrors
from .nodelocal import NodeLocalCommits
from .uplinkstate import StepKey, UplinkState
from .workers import RootChecked, WorkerPools

log = logging.getLogger(__name__)

Deliver = Callable[[StepKey, set[bytes], Message], None]
__all__ = ["CoordinatorLink", "Deliver", "StepKey"]


class CoordinatorLink:
    def __init__(
        self,
        ctx: zmq.Context,
        codec: Codec,
        keys: CurveKeys,
        address: str,
        node: int,
        identity: bytes,
        config: CkptdConfig,
        deliver: Deliver,
        *,
        store: RootStore,
        workers: WorkerPools,
        internal: InternalErrors,
        node_local: NodeLocalCommits | None = None,
    ) -> None:
        self.address = address
        self.node = node
        self.config = config
        self.deliver = deliver  # tells a resolved step's ranks its outcome
        self.store = store  # asked whether an attempt committed when the coordinator was lost
        self.workers = workers
        self.internal = internal  # the daemon's count of internal errors (ckptd.daemon.guard)
        self.node_local = node_local  # this node's part of node-local commits (ckptd.daemon.nodelocal)
        sock = make_socket(ctx, zmq.DEALER, codec, keys, server=False, identity=identity)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a coordinator we are not connected to
        self.link_timeout_s = link_timeout_s(config.heartbeat_s, config.coordinator_timeout_s)
        replace_dead_links(sock, config.heartbeat_s, self.link_timeout_s)
        if is_ipv6(address):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(address)
        self.channel = Channel(sock, codec, "upstream")
        self.state = UplinkState(
            config, address=address, node=node, link_timeout_s=self.link_timeout_s, now=time.monotonic()
        )

    @property
    def busy(self) -> bool:
        return self.state.busy

    def pending_steps(self) -> list[int]:
        return self.state.pending_steps()

    def expect(self, key: StepKey, identity: bytes) -> None:
        """Tell rank ``identity`` the outcome of attempt ``key`` once it is known (nothing to do when
        it is known already: see :meth:`verdict`)."""
        self._handle(us.Expect(key=key, identity=identity))

    def verdict(self, key: StepKey) -> Message | None:
        """The abort of attempt ``key`` if it was aborted recently (None: undecided, committed, or
        decided long ago)."""
        return self.state.verdict(key)

    def expects(self, key: StepKey, identity: bytes) -> bool:
        """Whether attempt ``key`` is still undecided here with rank ``identity`` in it."""
        return self.state.expects(key, identity)

    def report(self, msg: Written | Failed, key: StepKey) -> None:
        """Send a WRITTEN/FAILED of attempt ``key`` now, or as soon as the coordinator is reachable
        (addressed to the coordinator instance answering then)."""
        self._handle(us.Report(key=key, msg=msg))

    def abandon(self, key: StepKey, reason: str, handed_off: tuple[int, ...], abandoning_rank: int = -1) -> None:
        """Ask the coordinator to abort attempt ``key`` of an earlier launch (a resume found it
        unable to commit, with only the ranks ``handed_off``: ckptd.client.settle), or one whose
        save the node's previous daemon died holding (``abandoning_rank``: ckptd.client.session)."""
        self._handle(us.Abandon(key=key, reason=reason, handed_off=handed_off, abandoning_rank=abandoning_rank))

    def abort_pending(self, reason: str) -> None:
        """Abort locally every attempt whose reports went out (those still writing report when done)."""
        self._handle(us.AbortAll(reason=reason))

    def retarget(self, address: str) -> None:
        """Connect to the coordinator at ``address`` instead (a later launch has it there: see
        ckptd.daemon.node); the reports awaiting a verdict are sent again once it answers."""
        sock = self.channel.sock
        if is_ipv6(address):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(address)  # first: an address it refuses leaves the link as it was
        sock.disconnect(self.address)
        self.address = address
        self._handle(us.Retarget(address=address))

    def on_readable(self) -> None:
        while True:
            try:
                _, msg, _ = self.channel.recv()
            except zmq.Again:
                return
            if isinstance(msg, Pong):
                self._handle(us.Pong(instance=msg.instance))
            elif isinstance(msg, (StepCommitted, StepAborted)):
                if self.node_local is None or not self.node_local.takes(msg):
                    self.verdict_in(msg)
            elif isinstance(msg, ErrorReply):
                log.warning("coordinator error: %s", msg.reason)
            elif msg is not None:
                log.warning("unexpected %s from the coordinator", msg.TYPE.name)

    def verdict_in(self, msg: StepCommitted | StepAborted) -> None:
        """A coordinator's verdict (for a node-local commit, once this node's part is done)."""
        if isinstance(msg, StepCommitted) and msg.local_files:
            msg = replace(msg, local_files={})  # ranks never get a commit's files
        self._handle(us.Verdict(key=(msg.step, msg.attempt), outcome=msg))

    def on_root_checked(self, done: RootChecked) -> None:
        """The root's answer to whether an attempt committed (asked when the coordinator was lost)."""
        holds = bool(done.result) if done.error is None else None
        self._handle(us.RootAnswer(key=(done.step, done.attempt), holds_commit=holds, problem=done.reason))

    def tick(self, now: float) -> None:
        """Heartbeat, coordinator timeout, and retries of what could not be sent."""
        self._handle(us.Tick(), now)

    def _handle(self, event: us.Event, now: float | None = None) -> None:
        """Feed ``event`` to the state and execute its actions in order, each on its own: one that
        fails (a bug, an exhausted resource) is logged and counted as an internal error
        (ckptd.daemon.guard) and the others still run; the state moved on whatever its fate.
        (A send that raised ended the loop, losing the verdicts and sends after it, every resend
        again; raised from on_readable, it ended the daemon.)"""
        now = time.monotonic() if now is None else now
        for action in self.state.handle(event, now):
            self.internal.run(
                f"coordinator link's {type(action).__name__}", functools.partial(self._execute, action, now)
            )

    def _execute(self, action: us.Action, now: float) -> None:
        if isinstance(action, us.Send):
            try:
                ok = self.channel.send(action.msg, block=False)
            except Exception:
                # Fed back as gone: a message that cannot be encoded never will be, and one the
                # socket never took is retried at every tick, each retry sending every report made
                # before it too. The resend timer tries again; the coordinator's commit timeout
                # decides the attempt otherwise.
                self.state.handle(us.Sent(key=action.key, msg=action.msg, ok=True), now)
                raise
            # Feeding back a send's result only updates the table: it never sends.
            self.state.handle(us.Sent(key=action.key, msg=action.msg, ok=ok), now)
        elif isinstance(action, us.AskRoot):
            step, attempt = action.key
            self.workers.check(step, attempt, functools.partial(self.store.holds_commit, step, attempt))
        else:
            self.deliver(action.key, set(action.identities), action.outcome)

    def status(self) -> dict[str, Any]:
        """The coordinator as this node knows it: its instance, and how long it has not answered
        a ping while steps wait for it (0 while none does)."""
        return self.state.status(time.monotonic())

    def close(self) -> None:
        self.channel.close()
