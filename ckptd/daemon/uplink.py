"""A node daemon's link to the job's coordinator, and the steps awaiting its verdict.

The link is a CurveZMQ DEALER connected to the coordinator (node 0's daemon, this very daemon on
node 0). Per save attempt it keeps the ranks to tell the outcome (:class:`PendingStep`); reports
(``WRITTEN``/``FAILED``) go out at once or wait in an outbox while the coordinator is unreachable.
Order of one attempt, as this node sees it:

1. a rank's SAVE is taken: :meth:`CoordinatorLink.expect` records the rank to notify (unless the
   attempt was decided already: another rank skipped or failed it first; :meth:`verdict` then
   tells the outcome, which the rank gets right after its SAVE_ACK, and its write is skipped);
2. its write finished: :meth:`CoordinatorLink.report` sends ``WRITTEN`` (or ``FAILED``);
3. ``STEP_COMMITTED`` / ``STEP_ABORTED`` arrives (:meth:`on_readable`): the step resolves and
   ``deliver`` tells its ranks.

Liveness: a ``PING`` goes out every heartbeat, also while idle, so the coordinator's instance is
known before the next report; a new instance (the coordinator restarted) or silence longer than
``coordinator_timeout_s`` while reports wait aborts those steps locally with the reason. Such
local aborts are reported late (``FAILED`` of rank -1) once a coordinator is reachable, so it
learns the outcome and removes the attempt's directory. A connection that carried nothing for
the link timeout is replaced (ckptd.control.channel.replace_dead_links: a partition must not
leave reports stuck in TCP's retransmission back-off), and when the coordinator answers again
after such a silence, every report still awaiting its verdict is sent again (the coordinator
counts a report once).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from ..config import CkptdConfig
from ..control.channel import Endpoint, link_timeout_s, make_socket, replace_dead_links
from ..control.keys import CurveKeys
from ..control.protocol import (
    Codec,
    ErrorReply,
    Failed,
    Message,
    Ping,
    Pong,
    StepAborted,
    StepCommitted,
)

log = logging.getLogger(__name__)

_VERDICT_MEMORY = 1024  # verdicts remembered for SAVEs that arrive after them
StepKey = tuple[int, str]  # (step, attempt)
Deliver = Callable[[StepKey, set[bytes], Message], None]


@dataclass
class PendingStep:
    """An attempt of a step this node writes for, awaiting the coordinator's verdict."""

    notify: set[bytes] = field(default_factory=set)  # rank identities to tell the outcome
    sent_to: str | None = None  # coordinator instance known when a report went out
    waiting_since: float | None = None  # when the first report went upstream
    reports: list[Message] = field(default_factory=list)  # WRITTEN/FAILED sent (resent after a gap)
    resent_s: float | None = None  # when the reports were last resent for want of a verdict


@dataclass(frozen=True)
class Outgoing:
    """A report that could not be sent yet (the coordinator was unreachable)."""

    first_try_s: float
    msg: Message
    key: StepKey


@dataclass(frozen=True)
class LateReport:
    """A local abort the coordinator has not learnt yet."""

    since_s: float
    msg: Failed


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
    ) -> None:
        self.address = address
        self.node = node
        self.config = config
        self.deliver = deliver  # tells a resolved step's ranks its outcome
        sock = make_socket(ctx, zmq.DEALER, codec, keys, server=False, identity=identity)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a coordinator we are not connected to
        self.link_timeout_s = link_timeout_s(config.heartbeat_s, config.coordinator_timeout_s)
        replace_dead_links(sock, config.heartbeat_s, self.link_timeout_s)
        if address.startswith("tcp://[") or address.count(":") > 2:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(address)
        self.ep = Endpoint(sock, codec, "upstream")
        self.steps: dict[StepKey, PendingStep] = {}
        self.verdicts: OrderedDict[StepKey, Message] = OrderedDict()  # of recently decided attempts
        self.outbox: list[Outgoing] = []
        self.late: list[LateReport] = []
        self.coordinator_instance: str | None = None
        self.last_pong_s = time.monotonic()
        self.last_ping_s = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.steps or self.outbox)

    def pending_steps(self) -> list[int]:
        return sorted({step for step, _ in self.steps})

    def expect(self, key: StepKey, identity: bytes) -> None:
        """Tell rank ``identity`` the outcome of attempt ``key`` once it is known (nothing to do when
        it is known already: see :meth:`verdict`)."""
        if key not in self.verdicts:
            self.steps.setdefault(key, PendingStep()).notify.add(identity)

    def verdict(self, key: StepKey) -> Message | None:
        """The abort of attempt ``key`` if it was aborted recently (None: undecided, committed, or
        decided long ago)."""
        return self.verdicts.get(key)

    def expects(self, key: StepKey, identity: bytes) -> bool:
        """Whether attempt ``key`` is still undecided here with rank ``identity`` in it."""
        st = self.steps.get(key)
        return st is not None and identity in st.notify

    def report(self, msg: Message, key: StepKey) -> None:
        """Send a WRITTEN/FAILED of attempt ``key`` now, or as soon as the coordinator is reachable."""
        st = self.steps.setdefault(key, PendingStep())
        if st.waiting_since is None:
            st.waiting_since = time.monotonic()
        st.reports.append(msg)
        if self.ep.send(msg, block=False):
            st.sent_to = st.sent_to or self.coordinator_instance
        else:
            self.outbox.append(Outgoing(time.monotonic(), msg, key))

    def on_readable(self) -> None:
        while True:
            try:
                _, msg, _ = self.ep.recv()
            except zmq.Again:
                return
            if isinstance(msg, Pong):
                self._on_pong(msg)
            elif isinstance(msg, (StepCommitted, StepAborted)):
                self._resolve((msg.step, msg.attempt), msg)
            elif isinstance(msg, ErrorReply):
                log.warning("coordinator error: %s", msg.reason)
            elif msg is not None:
                log.warning("unexpected %s from the coordinator", msg.TYPE.name)

    def _on_pong(self, msg: Pong) -> None:
        silent_s = time.monotonic() - self.last_pong_s
        self.last_pong_s = time.monotonic()
        if self.coordinator_instance != msg.instance:
            if self.coordinator_instance is not None:
                log.warning("coordinator restarted (%s -> %s)", self.coordinator_instance, msg.instance)
            self.coordinator_instance = msg.instance
            self.abort_pending(
                "the coordinator restarted before confirming the step (had its commit "
                "already renamed the checkpoint, the restarted coordinator completes it)",
                keep_instance=msg.instance,
            )
        if silent_s > self.link_timeout_s / 2:  # long enough that the connection may have been replaced
            self._resend_reports(silent_s)

    def _resend_reports(self, silent_s: float) -> None:
        """The coordinator answers again after a silence long enough for the connection to have
        been replaced (ckptd.control.channel.replace_dead_links), which loses what was in it (a
        report, or the verdict on it: without a resend this node would wait for it forever, since
        the coordinator answers its pings again). Resend every report still awaiting a verdict:
        the coordinator counts a report once and answers one about a decided attempt with its
        outcome."""
        waiting = [(key, msg) for key, st in self.steps.items() for msg in st.reports]
        if waiting:
            log.warning(
                "the coordinator answers again after %.1f s; resending %d reports of steps %s",
                silent_s,
                len(waiting),
                sorted({key for key, _ in waiting}),
            )
        for key, msg in waiting:
            if not self.ep.send(msg, block=False):
                self.outbox.append(Outgoing(time.monotonic(), msg, key))

    def _resolve(self, key: StepKey, outcome: Message) -> None:
        # Only aborts are remembered: a SAVE of a committed attempt can only come from a relaunch
        # that repeated the attempt id, and a commit is never answered from memory (the coordinator
        # checks the root holds it: ckptd.daemon.coordinator).
        if isinstance(outcome, StepAborted):
            self.verdicts[key] = outcome
            self.verdicts.move_to_end(key)
            while len(self.verdicts) > _VERDICT_MEMORY:
                self.verdicts.popitem(last=False)
        st = self.steps.pop(key, None)
        self.outbox = [o for o in self.outbox if o.key != key]
        if st is not None:
            self.deliver(key, st.notify, outcome)

    def abort_pending(self, reason: str, keep_instance: str | None = None) -> None:
        """Abort locally every attempt whose reports went out (those still writing report when
        done), except those sent to coordinator ``keep_instance``, which still decides them."""
        for (step, attempt), st in list(self.steps.items()):
            if st.waiting_since is None:
                continue
            if keep_instance is not None and st.sent_to in (None, keep_instance):
                continue
            log.warning("step %d attempt %s aborted locally: %s", step, attempt, reason)
            self._resolve((step, attempt), StepAborted(step, attempt, reason))
            self.late.append(LateReport(time.monotonic(), Failed(step, attempt, -1, 0, self.node, reason)))

    def tick(self, now: float) -> None:
        """Heartbeat, coordinator timeout, and retries of what could not be sent."""
        cfg = self.config
        if now - self.last_ping_s >= cfg.heartbeat_s:
            self.last_ping_s = now
            self.ep.send(Ping(int(now * 1000)), block=False)
        waiting = [st.waiting_since for st in self.steps.values() if st.waiting_since is not None]
        if waiting or self.outbox:
            oldest = min(waiting + [o.first_try_s for o in self.outbox])
            silent_s = now - max(self.last_pong_s, oldest)
            if silent_s > cfg.coordinator_timeout_s:
                self.outbox.clear()
                self.abort_pending(
                    f"the coordinator at {self.address} did not answer for {silent_s:.0f} s "
                    "(node 0's daemon may have died, or the network between this node and "
                    "node 0 failed; a step whose reports all reached the coordinator may "
                    "still commit: Checkpointer.latest() tells)"
                )
        else:
            self.last_pong_s = now
        self._chase_verdicts(now)
        if self.late:
            self.late = [
                r for r in self.late if now - r.since_s < cfg.commit_timeout_s and not self.ep.send(r.msg, block=False)
            ]
        retry, self.outbox = self.outbox, []
        for o in retry:
            if self.ep.send(o.msg, block=False):
                self.steps.setdefault(o.key, PendingStep()).sent_to = self.coordinator_instance
            else:
                self.outbox.append(o)

    def _chase_verdicts(self, now: float) -> None:
        """Bound the wait for a verdict that got lost while the coordinator stays reachable (no
        silence, so no abort above): the coordinator decides every attempt within
        ``commit_timeout_s`` of its first report plus the commit itself, so a step still waiting
        ``coordinator_timeout_s`` beyond that resends its reports, and again every
        ``coordinator_timeout_s``; the coordinator answers a report of a decided attempt with its
        outcome."""
        cfg = self.config
        due_s = cfg.commit_timeout_s + cfg.coordinator_timeout_s
        for key, st in self.steps.items():
            if st.waiting_since is None or now - st.waiting_since < due_s:
                continue
            if st.resent_s is not None and now - st.resent_s < cfg.coordinator_timeout_s:
                continue
            st.resent_s = now
            log.warning(
                "step %d attempt %s: no verdict %.0f s after its reports; resending them",
                key[0],
                key[1],
                now - st.waiting_since,
            )
            for msg in st.reports:
                if not self.ep.send(msg, block=False):
                    self.outbox.append(Outgoing(now, msg, key))

    def status(self) -> dict[str, Any]:
        """The coordinator as this node knows it: its instance, and how long it has not answered
        a ping while steps wait for it (0 while none does)."""
        return {
            "address": self.address,
            "instance": self.coordinator_instance,
            "silent_s": round(time.monotonic() - self.last_pong_s, 3),
        }

    def close(self) -> None:
        self.ep.close()
