"""A node daemon's decisions about its reports to the coordinator: a pure state machine.

:class:`UplinkState` holds one table, :attr:`UplinkState.unacked`: per save attempt this node
writes for, the ranks to tell the outcome, the reports (``WRITTEN``/``FAILED``) sent and not yet
acknowledged by a verdict, those not sent yet, and a local abort the coordinator has not learnt
yet. ``handle(event, now)`` applies one event and returns the actions that follow: sends, and
verdicts to deliver to ranks. It reads no clock and opens no socket; the shell
(ckptd.daemon.uplink) executes the actions and feeds back whether each send went out
(:class:`Sent`): a DEALER with ``IMMEDIATE`` refuses a send while the coordinator is unreachable.

Order of one attempt, as this node sees it: :class:`Expect` (a rank's SAVE taken: the rank is told
the outcome; nothing to do when the attempt was decided already, see :meth:`UplinkState.verdict`),
:class:`Report` (its write finished), :class:`Verdict` (``STEP_COMMITTED`` / ``STEP_ABORTED``:
the ranks are told, the reports acknowledged).

Every report goes out addressed to the coordinator instance the last :class:`Pong` named (its
``coordinator_instance``), and none before a coordinator answered: a coordinator drops a report
addressed to another instance. So a report sent to an instance that is gone can never be counted
by its successor, also when it reaches the successor before this node learns of the restart (the
node then takes it for lost, below, and the successor, never having counted it, cannot commit the
attempt). A resend is addressed anew, to the instance answering then (the same one: an attempt
whose reports went to a lost instance is never resent).

The one resend timer, on every :class:`Tick`: reports not sent yet are retried; a step still
without a verdict ``commit_timeout_s + coordinator_timeout_s`` after its first report (the
coordinator decides every attempt within ``commit_timeout_s`` of its first report, plus the
commit) resends its reports, and again every ``coordinator_timeout_s`` (a verdict lost while the
coordinator stays reachable); local aborts are retried until sent to the instance answering, for
``commit_timeout_s``. A ``PING`` goes out every heartbeat, and at the next tick when the socket
refused it (no connection yet: the first reports wait for the first answer). When the coordinator
answers (:class:`Pong`) after a silence long enough for the connection to have been replaced
(ckptd.control.channel.replace_dead_links loses what was in it), every unacknowledged report is
sent again; the coordinator counts a report once and answers one about a decided attempt with its
outcome.

Liveness: a new coordinator instance (it restarted), or silence longer than
``coordinator_timeout_s`` while reports wait, means the coordinator was lost with those steps
undecided here. It may have committed one just before (its commit point passed: a POSIX rename,
an S3 commit object) without announcing it, so before telling the ranks anything the node asks the
root whether that exact attempt committed (:class:`AskRoot`, answered by :class:`RootAnswer`: the
shell runs ``RootStore.holds_commit`` off the loop). Committed: the ranks are told
``STEP_COMMITTED``, with a warning that the coordinator was lost after the commit. Not committed
now (or no answer within ``coordinator_timeout_s``): the step aborts locally with the reason, and
such local aborts are reported (``FAILED`` of rank -1) once a coordinator is reachable, so it
learns the outcome and removes the attempt's files; within ``commit_timeout_s``, a coordinator
instance that answers later is told too (the abort may have gone to its predecessor). The answer
is "committed now": a coordinator still alive behind a partition may commit later, which the
abort's reason says (``Checkpointer.latest()`` tells). A shutdown of the node daemon itself
(:class:`AbortAll`) aborts at once, without asking. A resume's :class:`Abandon` of an attempt of
an earlier launch that looks unable to commit is told to the coordinator as such a FAILED, which
decides it (ckptd.client.settle).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import CkptdConfig
from ..control.protocol import Failed, Message, Ping, StepAborted, StepCommitted, Written
from ..control.wiretext import bounded_text
from ..format.rootlayout import step_dir_name

log = logging.getLogger(__name__)

VERDICT_MEMORY = 1024  # verdicts remembered for SAVEs that arrive after them
StepKey = tuple[int, str]  # (step, attempt)


# --- events ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Expect:
    """Rank ``identity`` saves attempt ``key``: tell it the outcome once known."""

    key: StepKey
    identity: bytes


@dataclass(frozen=True, kw_only=True)
class Report:
    """A WRITTEN/FAILED of attempt ``key``, to send now or as soon as the coordinator is reachable
    (its ``coordinator_instance`` is set when it is sent)."""

    key: StepKey
    msg: Written | Failed


@dataclass(frozen=True, kw_only=True)
class Sent:
    """Whether a :class:`Send` went out (fed back by the shell for every one)."""

    key: StepKey | None
    msg: Message
    ok: bool


@dataclass(frozen=True, kw_only=True)
class Pong:
    """The coordinator answered a ping; ``instance`` names it (a new one: it restarted)."""

    instance: str


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """``STEP_COMMITTED`` / ``STEP_ABORTED`` of attempt ``key`` arrived."""

    key: StepKey
    outcome: Message


@dataclass(frozen=True, kw_only=True)
class RootAnswer:
    """The root's answer to :class:`AskRoot` for attempt ``key``: whether ``iter_<step>`` is
    committed by exactly that attempt now (``RootStore.holds_commit``); None when the root could
    not be read, ``problem`` saying why."""

    key: StepKey
    holds_commit: bool | None
    problem: str = ""


@dataclass(frozen=True, kw_only=True)
class AbortAll:
    """Abort locally every attempt whose reports went out (the node daemon shuts down)."""

    reason: str


@dataclass(frozen=True, kw_only=True)
class Abandon:
    """A resume found attempt ``key`` of an earlier launch unable to commit, with only the ranks
    ``handed_off`` at the node daemons: ask the coordinator to abort it (ckptd.protocol.Abandon),
    whose verdict decides its parts here as any verdict does (nothing to do when it aborted here
    already)."""

    key: StepKey
    reason: str
    handed_off: tuple[int, ...]
    abandoning_rank: int = -1  # a rank whose previous node daemon died holding its save of it


@dataclass(frozen=True, kw_only=True)
class Retarget:
    """The ranks' launch has the coordinator at ``address``, and the shell connects there instead
    (ckptd.daemon.node: it moved between launches). Ping at once; hold new reports until it
    answers; then resend every report, also when the same instance answers there (what was in the
    old connection is lost), or ask the root about those sent to another instance."""

    address: str


@dataclass(frozen=True, kw_only=True)
class Tick:
    """Time passed: heartbeat, coordinator timeout, the resend timer."""


Event = Expect | Report | Sent | Pong | Verdict | RootAnswer | AbortAll | Abandon | Retarget | Tick


# --- actions -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Send:
    """Send ``msg`` to the coordinator without blocking (a report of attempt ``key``, addressed
    to an instance, or a ping); feed back :class:`Sent`."""

    msg: Message
    key: StepKey | None = None


@dataclass(frozen=True, kw_only=True)
class Deliver:
    """Attempt ``key`` resolved: tell ranks ``identities`` its ``outcome`` (and count it)."""

    key: StepKey
    identities: frozenset[bytes]
    outcome: Message


@dataclass(frozen=True, kw_only=True)
class AskRoot:
    """Ask the root whether attempt ``key`` committed (``RootStore.holds_commit``) without blocking
    the loop; feed back :class:`RootAnswer` (the state gives up waiting for it after
    ``coordinator_timeout_s``)."""

    key: StepKey


Action = Send | Deliver | AskRoot


@dataclass(frozen=True, kw_only=True)
class LostCoordinator:
    """Why an attempt's coordinator was lost, while the root is asked whether it committed."""

    cause: str  # "the coordinator restarted", "the coordinator at ... did not answer for 5 s"
    restarted: bool
    until: float  # no answer by then: aborted, saying the root could not tell


@dataclass
class Unacked:
    """One attempt in the table: open (awaiting its verdict) and/or holding a local abort to tell."""

    open: bool = True  # undecided here: ranks to tell, reports awaiting a verdict
    notify: set[bytes] = field(default_factory=set)  # rank identities to tell the outcome
    # WRITTEN/FAILED as reported, unaddressed (each send addresses a copy)
    reports: list[Written | Failed] = field(default_factory=list)  # sent, resent when overdue
    unsent: list[Written | Failed] = field(default_factory=list)  # not sent yet: retried every tick
    sent_to: str | None = None  # the coordinator instance the first report that went out was addressed to
    waiting_since: float | None = None  # when the first report went upstream
    resend_at: float | None = None  # the resend timer: reports resent at this time for want of a verdict
    late: Failed | None = None  # a local abort to tell the coordinator (unaddressed)
    late_until: float | None = None  # told until then (the coordinator's commit timeout ended it anyway)
    late_sent_to: str | None = None  # the instance the local abort last went to
    lost: LostCoordinator | None = None  # its coordinator was lost: the root is asked whether it committed


class UplinkState:
    """The reports of one node daemon to its coordinator (see the module docstring)."""

    def __init__(self, config: CkptdConfig, *, address: str, node: int, link_timeout_s: float, now: float) -> None:
        self.config = config
        self.address = address  # of the coordinator, for messages
        self.node = node
        self.link_timeout_s = link_timeout_s
        self.unacked: dict[StepKey, Unacked] = {}
        self.verdicts: OrderedDict[StepKey, Message] = OrderedDict()  # of recently aborted attempts
        self.coordinator_instance: str | None = None
        self.last_pong_s = now  # the coordinator's last answer, or (nothing waiting) the last tick
        # Its last answer, whatever waited: the silence a connection may have been replaced in,
        # losing a report sent into it while nothing else was waiting (see _on_pong).
        self.last_answer_s = now
        self.last_ping_s = 0.0
        self.relinked = False  # connected to another address since the last answer (see Retarget)
        self._out: list[Action] = []

    # --- queries -------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return any(u.open for u in self.unacked.values())

    def pending_steps(self) -> list[int]:
        return sorted({step for (step, _), u in self.unacked.items() if u.open})

    def undecided(self, key: StepKey) -> bool:
        """Whether attempt ``key`` awaits its verdict here (also while the root is asked about it)."""
        u = self.unacked.get(key)
        return u is not None and u.open

    def open_attempts(self) -> list[tuple[StepKey, list[Written | Failed], frozenset[bytes]]]:
        """Each attempt still undecided here: its reports (sent, or not yet) and the identities of
        the ranks that saved it here."""
        return [(key, [*u.reports, *u.unsent], frozenset(u.notify)) for key, u in self.unacked.items() if u.open]

    def verdict(self, key: StepKey) -> Message | None:
        """The abort of attempt ``key`` if it was aborted recently (None: undecided, committed, or
        decided long ago)."""
        return self.verdicts.get(key)

    def reported(self, key: StepKey, rank: int) -> bool:
        """Whether rank ``rank``'s WRITTEN/FAILED of attempt ``key`` awaits its verdict here."""
        u = self.unacked.get(key)
        return u is not None and u.open and any(m.rank == rank for m in (*u.reports, *u.unsent))

    def expects(self, key: StepKey, identity: bytes) -> bool:
        """Whether attempt ``key`` is still undecided here with rank ``identity`` in it (not while
        its coordinator was lost: a write of it that finishes now cannot make it commit)."""
        u = self.unacked.get(key)
        return u is not None and u.open and u.lost is None and identity in u.notify

    def status(self, now: float) -> dict[str, Any]:
        """The coordinator as this node knows it: its instance, and how long it has not answered
        a ping while steps wait for it (0 while none does)."""
        return {
            "address": self.address,
            "instance": self.coordinator_instance,
            "silent_s": round(now - self.last_pong_s, 3),
        }

    # --- events --------------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply ``event`` at time ``now``; the actions to execute, in order."""
        self._out = []
        if isinstance(event, Expect):
            if event.key not in self.verdicts:
                self._open(event.key).notify.add(event.identity)
        elif isinstance(event, Report):
            self._on_report(event.key, event.msg, now)
        elif isinstance(event, Sent):
            self._on_sent(event, now)
        elif isinstance(event, Pong):
            self._on_pong(event.instance, now)
        elif isinstance(event, Verdict):
            self._resolve(event.key, event.outcome)
        elif isinstance(event, RootAnswer):
            self._on_root_answer(event, now)
        elif isinstance(event, AbortAll):
            self._abort_pending(event.reason, now)
        elif isinstance(event, Abandon):
            self._on_abandon(event, now)
        elif isinstance(event, Retarget):
            log.warning("the coordinator moved: %s -> %s", self.address, event.address)
            self.address, self.relinked = event.address, True
            # Whoever answers there is not known yet: a report now would be addressed to the
            # instance at the old address, which one answering there would drop. It waits for the
            # answer instead, and one already sent to an instance that does not answer there is
            # taken for lost then (see _on_pong).
            self.coordinator_instance = None
            # A local abort in the old connection was lost with it: told again to whoever answers.
            for u in self.unacked.values():
                u.late_sent_to = None
            # A fresh silence allowance: node 0's daemon listens at the new address once one of its
            # own ranks says HELLO, which may come a little after this node's.
            self.last_pong_s = self.last_answer_s = now
            self.last_ping_s = now - self.config.heartbeat_s  # ping at this tick
            self._on_tick(now)
        elif isinstance(event, Tick):
            self._on_tick(now)
        out, self._out = self._out, []
        return out

    def _open(self, key: StepKey) -> Unacked:
        u = self.unacked.setdefault(key, Unacked())
        if not u.open:  # only a local abort to tell was left: the attempt is reported on again
            u.open = True
        return u

    def _on_report(self, key: StepKey, msg: Written | Failed, now: float) -> None:
        u = self._open(key)
        if u.waiting_since is None:
            u.waiting_since = now
            u.resend_at = now + self.config.commit_timeout_s + self.config.coordinator_timeout_s
        u.reports.append(msg)
        self._send(key, u, msg)

    def _send(self, key: StepKey, u: Unacked, msg: Written | Failed) -> None:
        """Send report ``msg`` of attempt ``key`` addressed to the coordinator instance last heard
        from; while none has answered yet, keep it for the tick that follows the first answer."""
        if self.coordinator_instance is None:
            if msg not in u.unsent:
                u.unsent.append(msg)
            return
        self._out.append(Send(msg=replace(msg, coordinator_instance=self.coordinator_instance), key=key))

    def _send_all(self, key: StepKey, u: Unacked) -> None:
        """Send every report of attempt ``key`` again (those not sent yet among them)."""
        u.unsent = []
        for msg in u.reports:
            self._send(key, u, msg)

    def _on_sent(self, event: Sent, now: float) -> None:
        msg = event.msg
        if isinstance(msg, Ping):
            if not event.ok:  # not connected (yet): ping again at the next tick, not a heartbeat later
                self.last_ping_s = now - self.config.heartbeat_s
            return
        u = self.unacked.get(event.key) if event.key is not None else None
        if u is None or not isinstance(msg, (Written, Failed)):
            return
        entry = replace(msg, coordinator_instance="")  # as kept in the table
        if u.late is not None and entry == u.late:
            if event.ok:
                u.late_sent_to = msg.coordinator_instance
            return
        if not u.open:
            return
        if event.ok:
            u.sent_to = u.sent_to or msg.coordinator_instance
        elif entry not in u.unsent:
            u.unsent.append(entry)

    def _on_pong(self, instance: str, now: float) -> None:
        silent_s = now - self.last_answer_s
        self.last_pong_s = self.last_answer_s = now
        if self.coordinator_instance != instance:
            if self.coordinator_instance is not None:
                log.warning("coordinator restarted (%s -> %s)", self.coordinator_instance, instance)
            self.coordinator_instance = instance
            self._lose_coordinator("the coordinator restarted", now, restarted=True, keep_instance=instance)
        if self.relinked or silent_s > self.link_timeout_s / 2:  # the connection may have been replaced
            self.relinked = False
            self._resend_reports(silent_s)

    def _resend_reports(self, silent_s: float) -> None:
        """The coordinator answers again after a silence long enough for the connection to have
        been replaced, which loses what was in it (a report, or the verdict on it: without a
        resend this node would wait for it forever, since the coordinator answers its pings
        again). Resend every report still awaiting a verdict."""
        waiting = {key: u for key, u in self.unacked.items() if u.open and u.lost is None and u.reports}
        if waiting:
            log.warning(
                "the coordinator answers again after %.1f s; resending %d reports of steps %s",
                silent_s,
                sum(len(u.reports) for u in waiting.values()),
                sorted(waiting),
            )
        for key, u in waiting.items():
            self._send_all(key, u)

    def _resolve(self, key: StepKey, outcome: Message) -> None:
        # Only aborts are remembered: a SAVE of a committed attempt can only come from a relaunch
        # that repeated the attempt id, and a commit is never answered from memory (the coordinator
        # checks the root holds it: ckptd.daemon.commitstate).
        if isinstance(outcome, StepAborted):
            self.verdicts[key] = outcome
            self.verdicts.move_to_end(key)
            while len(self.verdicts) > VERDICT_MEMORY:
                self.verdicts.popitem(last=False)
        u = self.unacked.get(key)
        if u is not None and u.late is not None and u.late.handed_off:
            # An abandon the coordinator decided: never told to a later instance (it would take a
            # commit it kept for an attempt it never saw, and abort it on every node).
            u.late = u.late_until = u.late_sent_to = None
            self._drop_if_done(key, u)
            u = self.unacked.get(key)
        if u is None or not u.open:
            return
        notify = frozenset(u.notify)
        u.open, u.notify, u.reports, u.unsent = False, set(), [], []
        u.sent_to = u.waiting_since = u.resend_at = u.lost = None
        self._drop_if_done(key, u)
        self._out.append(Deliver(key=key, identities=notify, outcome=outcome))

    def _drop_if_done(self, key: StepKey, u: Unacked) -> None:
        if not u.open and u.late is None:
            del self.unacked[key]

    def _abort_pending(self, reason: str, now: float) -> None:
        """Abort locally every attempt whose reports went out (those still writing report when
        done), also those whose root is being asked."""
        for key, u in list(self.unacked.items()):
            if u.open and u.waiting_since is not None:
                self._abort_locally(key, reason, now)

    def _abort_locally(self, key: StepKey, reason: str, now: float) -> None:
        """Tell the ranks attempt ``key`` aborted, and the coordinator once one is reachable."""
        step, attempt = key
        log.warning("step %d attempt %s aborted locally: %s", step, attempt, reason)
        self._resolve(key, StepAborted(step=step, attempt=attempt, reason=reason))
        self._tell_late(key, reason, now)

    def _on_abandon(self, event: Abandon, now: float) -> None:
        """A relaunch's abandon, or a rank's for its save the node's previous daemon died holding:
        one FAILED tells the coordinator, naming every rank of the node that asked so far (it
        keeps the attempt only when each one's report was counted)."""
        if event.key in self.verdicts:
            return
        by = [] if event.abandoning_rank < 0 else [event.abandoning_rank]
        prior = self.unacked.get(event.key)
        late = None if prior is None else prior.late
        if by and late is not None:
            if not late.abandoned_by:
                return  # an abort asked already (a relaunch's) stands
            by = sorted(set(late.abandoned_by) | set(by))
        self._tell_late(event.key, event.reason, now, handed_off=list(event.handed_off), by=by)

    def _tell_late(
        self, key: StepKey, reason: str, now: float, handed_off: list[int] | None = None, by: list[int] | None = None
    ) -> None:
        """Tell the coordinator (once one is reachable, and any instance answering later within
        ``commit_timeout_s``, until it decided an abandon) in a FAILED of rank -1 that this node
        aborted attempt ``key``, or with ``handed_off`` that a relaunch asks it to, or that ranks
        ``by`` ask it to (their previous node daemon died holding their saves)."""
        step, attempt = key
        late = self.unacked.setdefault(key, Unacked(open=False))
        late.late = Failed(
            step=step,
            attempt=attempt,
            rank=-1,
            world_size=0,
            node=self.node,
            reason=bounded_text(reason),  # (a rank's ABANDON's, a root's error: it must fit the message)
            handed_off=handed_off or [],
            abandoned_by=by or [],
        )
        late.late_until = now + self.config.commit_timeout_s
        late.late_sent_to = None

    def _lose_coordinator(self, cause: str, now: float, *, restarted: bool, keep_instance: str | None = None) -> None:
        """The coordinator was lost (``cause``) with attempts undecided here whose reports went
        out (except those sent to coordinator ``keep_instance``, which still decides them): ask
        the root whether each committed before saying anything (see the module docstring)."""
        for key, u in self.unacked.items():
            if not u.open or u.waiting_since is None or u.lost is not None:
                continue
            if keep_instance is not None and u.sent_to in (None, keep_instance):
                continue
            log.warning("step %d attempt %s: %s before confirming it; asking the root if it committed", *key, cause)
            u.lost = LostCoordinator(cause=cause, restarted=restarted, until=now + self.config.coordinator_timeout_s)
            u.unsent = []
            self._out.append(AskRoot(key=key))

    def _on_root_answer(self, answer: RootAnswer, now: float) -> None:
        u = self.unacked.get(answer.key)
        if u is None or not u.open or u.lost is None:
            return  # decided meanwhile (a verdict came after all), or asked for nothing
        if answer.holds_commit:
            self._committed_without_verdict(answer.key, u.lost)
            return
        if answer.holds_commit is None:
            found = f"the root could not tell whether it committed ({answer.problem})"
        else:
            found = "the root holds no commit of this attempt now"
        self._abort_locally(answer.key, lost_reason(u.lost, found, known=answer.holds_commit is not None), now)

    def _committed_without_verdict(self, key: StepKey, lost: LostCoordinator) -> None:
        step, attempt = key
        name = step_dir_name(step)
        warning = (
            f"step {step} committed as {name}, but {lost.cause} before confirming it: the root holds "
            f"{name} committed by attempt {attempt} (the commit point had passed); if the `latest` "
            "tracker does not name it yet, the coordinator's next start does"
        )
        log.warning("%s", warning)
        self._resolve(key, StepCommitted(step=step, attempt=attempt, name=name, warnings=[warning]))

    def _on_tick(self, now: float) -> None:
        cfg = self.config
        if now - self.last_ping_s >= cfg.heartbeat_s:
            self.last_ping_s = now
            self._out.append(Send(msg=Ping(nonce=int(now * 1000))))
        waiting = [
            u.waiting_since for u in self.unacked.values() if u.open and u.lost is None and u.waiting_since is not None
        ]
        if waiting:
            silent_s = now - max(self.last_pong_s, min(waiting))
            if silent_s > cfg.coordinator_timeout_s:
                cause = f"the coordinator at {self.address} did not answer for {silent_s:.0f} s"
                self._lose_coordinator(cause, now, restarted=False)
        else:
            self.last_pong_s = now
        self._resend_overdue(now)
        for key, u in list(self.unacked.items()):
            if u.open and u.lost is not None and now >= u.lost.until:
                found = (
                    f"the root did not tell within {cfg.coordinator_timeout_s:g} s whether it committed "
                    "(CKPTD_COORDINATOR_TIMEOUT_S)"
                )
                self._abort_locally(key, lost_reason(u.lost, found, known=False), now)
        instance = self.coordinator_instance
        for key, u in list(self.unacked.items()):
            if u.late is not None and u.late_until is not None:
                if now >= u.late_until:
                    u.late = u.late_until = u.late_sent_to = None
                    self._drop_if_done(key, u)
                elif instance is not None and instance != u.late_sent_to:
                    # not told yet, or told a predecessor of the instance answering now
                    self._out.append(Send(msg=replace(u.late, coordinator_instance=instance), key=key))
        if instance is not None:
            self._retry_unsent()

    def _retry_unsent(self) -> None:
        """Send the reports the socket refused, after every report of the attempts reported before
        them (again: those went into a connection that may have been lost with the link): the
        coordinator commits attempts in the order their collection begins, so this node's reports
        reach it in the order they were made, never its newest step's first."""
        keys = [k for k, u in self.unacked.items() if u.open and u.lost is None and u.unsent]
        if not keys:
            return
        for key, u in list(self.unacked.items()):
            if u.open and u.lost is None and u.reports:
                self._send_all(key, u)
            if key == keys[-1]:
                return

    def _resend_overdue(self, now: float) -> None:
        """Bound the wait for a verdict that got lost while the coordinator stays reachable (no
        silence, so no abort): the coordinator answers a report of a decided attempt with its
        outcome."""
        for key, u in self.unacked.items():
            if not u.open or u.lost is not None or u.resend_at is None or u.waiting_since is None:
                continue
            if now < u.resend_at:
                continue
            u.resend_at = now + self.config.coordinator_timeout_s
            log.warning(
                "step %d attempt %s: no verdict %.0f s after its reports; resending them",
                key[0],
                key[1],
                now - u.waiting_since,
            )
            self._send_all(key, u)


def lost_reason(lost: LostCoordinator, found: str, *, known: bool) -> str:
    """Why an attempt whose coordinator was lost (``lost``) aborts here, with what the root said
    (``found``): the commit point had not passed when it was asked (``known``), or it could not
    tell."""
    if lost.restarted:
        outcome = "it did not commit unless a commit still in flight completes it" if known else "it may have committed"
        return f"{lost.cause} before confirming the step, and {found}: {outcome} (Checkpointer.latest() tells)"
    return (
        f"{lost.cause}, and {found} (node 0's daemon may have died, or the network between this "
        "node and node 0 failed; a step whose reports all reached the coordinator may still "
        "commit: Checkpointer.latest() tells)"
    )
