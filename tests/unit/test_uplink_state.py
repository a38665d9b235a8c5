"""A node daemon's decisions about its reports to the coordinator (ckptd.daemon.uplinkstate),
event by event with an injected clock: no sockets. The process versions: tests/unit/test_uplink.py
(a lost verdict chased, a skip remembered, on real sockets) and tests/fault/test_node_faults.py
(a coordinator that dies or restarts under real daemons)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ckptd.config import CkptdConfig
from ckptd.control.protocol import Failed, Message, Ping, StepAborted, StepCommitted, Written
from ckptd.daemon.uplinkstate import (
    VERDICT_MEMORY,
    Abandon,
    AbortAll,
    AskRoot,
    Deliver,
    Event,
    Expect,
    Pong,
    Report,
    Retarget,
    RootAnswer,
    Send,
    Sent,
    StepKey,
    Tick,
    UplinkState,
    Verdict,
)
from tests.messages import a_written

A = "0123456789ab-1"
K3, K4 = (3, A), (4, A)
CFG = CkptdConfig(commit_timeout_s=10, coordinator_timeout_s=5, heartbeat_s=1)
LINK_TIMEOUT_S = 4.0


def written(step: int, rank: int = 0) -> Written:
    return a_written(step=step, attempt=A, rank=rank, world_size=2, node=1)


def to(msg: Written | Failed, instance: str = "c1") -> Written | Failed:
    """``msg`` as sent to coordinator ``instance``."""
    return replace(msg, coordinator_instance=instance)


class Node:
    """The shell's part that tests need: sends (reports and pings) succeed while ``reachable``,
    each result fed back;
    the root is asked at once (``committed``: the attempts it holds commits of) unless
    ``root_answers`` is False (a slow root: the questions wait in ``asked``)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.state = UplinkState(CFG, address="tcp://node0:29500", node=1, link_timeout_s=LINK_TIMEOUT_S, now=self.now)
        self.reachable = True
        self.sent: list[Message] = []
        self.delivered: list[tuple[StepKey, frozenset[bytes], Message]] = []
        self.committed: set[StepKey] = set()
        self.root_answers = True
        self.asked: list[StepKey] = []

    def handle(self, event: Event) -> None:
        answers = []
        for action in self.state.handle(event, self.now):
            if isinstance(action, Send):
                if self.reachable:
                    self.sent.append(action.msg)
                fed = Sent(key=action.key, msg=action.msg, ok=self.reachable)
                assert self.state.handle(fed, self.now) == []
            elif isinstance(action, Deliver):
                self.delivered.append((action.key, action.identities, action.outcome))
            elif isinstance(action, AskRoot):
                self.asked.append(action.key)
                if self.root_answers:
                    answers.append(RootAnswer(key=action.key, holds_commit=action.key in self.committed))
        for answer in answers:  # a worker thread's answer comes after the event's actions
            self.handle(answer)

    def at(self, after_s: float) -> None:
        """Let ``after_s`` pass, ticking like the loop does (every 0.25 s)."""
        end = self.now + after_s
        while self.now < end:
            self.now = min(end, self.now + 0.25)
            self.handle(Tick())

    def answered(self, after_s: float, instance: str = "c1") -> None:
        """Let ``after_s`` pass with coordinator ``instance`` answering every ping."""
        end = self.now + after_s
        while self.now < end:
            self.at(min(0.25, end - self.now))
            self.pong(instance)

    def reports_sent(self) -> list[Message]:
        return [m for m in self.sent if not isinstance(m, Ping)]

    def take(self) -> list[Message]:
        out, self.sent = self.reports_sent(), []
        return out

    def pong(self, instance: str = "c1") -> None:
        self.handle(Pong(instance=instance))


def saving(node: Node, key: StepKey = K3, rank: bytes = b"rank0") -> Written:
    node.handle(Expect(key=key, identity=rank))
    msg = written(key[0])
    node.handle(Report(key=key, msg=msg))
    return msg


def test_a_report_goes_out_at_once_and_its_verdict_reaches_the_ranks_that_wait():
    node = Node()
    node.pong()
    msg = saving(node)
    node.handle(Expect(key=K3, identity=b"rank1"))
    assert node.take() == [to(msg)] and node.state.busy and node.state.pending_steps() == [3]
    assert node.state.expects(K3, b"rank1") and node.state.unacked[K3].sent_to == "c1"
    verdict = StepCommitted(step=3, attempt=A, name="iter_0000003", warnings=[])
    node.handle(Verdict(key=K3, outcome=verdict))
    assert node.delivered == [(K3, frozenset({b"rank0", b"rank1"}), verdict)]
    assert not node.state.unacked and not node.state.busy
    assert node.state.verdict(K3) is None  # a commit is never answered from memory
    node.handle(Verdict(key=K3, outcome=verdict))
    assert len(node.delivered) == 1  # a repeated verdict is told once


def test_after_a_cut_the_reports_go_out_again_in_the_order_they_were_made():
    """Step 3's report went into the link before the cut (lost with it), step 4's was refused:
    at the next tick step 4's alone went out, before the resend of step 3 the coordinator's next
    answer brings. The coordinator commits attempts in the order their collection begins, so it
    took step 4 for the older save."""
    node = Node()
    node.pong()
    three = saving(node, K3)
    node.take()
    node.reachable = False
    four = saving(node, K4)
    node.reachable = True
    node.at(0.25)  # the socket takes sends again; the coordinator has not answered yet
    assert node.take() == [to(three), to(four)]


def test_a_report_the_coordinator_could_not_take_is_retried_every_tick_until_it_goes_out():
    node = Node()
    node.reachable = False
    msg = saving(node)
    assert node.state.unacked[K3].unsent == [msg] and node.state.unacked[K3].sent_to is None
    node.at(1)
    assert node.state.unacked[K3].unsent == [msg]  # still unreachable: kept, once
    node.reachable = True
    node.pong()
    node.at(0.25)
    assert node.take() == [to(msg)] and not node.state.unacked[K3].unsent
    assert node.state.unacked[K3].sent_to == "c1"


def test_a_verdict_lost_while_the_coordinator_answers_is_chased_when_overdue_and_again_later():
    """The coordinator decides within commit_timeout_s of the first report (plus the commit): a
    step waiting commit_timeout_s + coordinator_timeout_s resends its reports, then every
    coordinator_timeout_s, until a verdict comes."""
    node = Node()
    node.pong()
    msg = saving(node)
    node.take()
    node.answered(CFG.commit_timeout_s + CFG.coordinator_timeout_s - 0.25)
    assert node.take() == []
    node.answered(0.25)
    assert node.take() == [to(msg)]
    node.answered(CFG.coordinator_timeout_s - 0.25)
    assert node.take() == []
    node.answered(0.25)
    assert node.take() == [to(msg)]
    node.handle(Verdict(key=K3, outcome=StepAborted(step=3, attempt=A, reason="rank 0: the disk is full")))
    assert node.delivered and not node.state.busy


def test_a_silent_coordinator_aborts_waiting_steps_locally_and_the_abort_is_reported_when_it_answers():
    node = Node()
    node.pong()
    saving(node)
    node.handle(Expect(key=K4, identity=b"rank0"))  # still writing: no report yet, not aborted
    node.take()
    node.reachable = False
    node.at(CFG.coordinator_timeout_s)
    assert node.delivered == []
    node.at(0.25)
    ((key, ranks, verdict),) = node.delivered
    assert key == K3 and ranks == {b"rank0"} and isinstance(verdict, StepAborted)
    assert "the coordinator at tcp://node0:29500 did not answer for 5 s" in verdict.reason
    assert node.state.verdict(K3) == verdict and node.state.pending_steps() == [4]
    node.handle(Expect(key=K3, identity=b"rank1"))  # a rank whose SAVE comes after it
    assert not node.state.expects(K3, b"rank1")
    node.at(1)
    node.reachable = True
    node.at(0.25)
    (late,) = node.take()
    assert isinstance(late, Failed) and (late.step, late.rank, late.node, late.coordinator_instance) == (3, -1, 1, "c1")
    assert late.reason in verdict.reason
    node.answered(1)
    assert node.take() == []  # told once
    node.answered(CFG.commit_timeout_s)
    assert K3 not in node.state.unacked  # forgotten once the coordinator's commit timeout ended it anyway


def test_a_local_abort_the_coordinator_never_hears_of_is_given_up_after_the_commit_timeout():
    node = Node()
    node.pong()
    saving(node)
    node.take()
    node.reachable = False
    node.at(CFG.coordinator_timeout_s + 0.25)
    assert K3 in node.state.unacked and not node.state.busy  # only the abort to tell: not busy
    node.at(CFG.commit_timeout_s)
    assert K3 not in node.state.unacked
    node.reachable = True
    node.at(1)
    assert node.take() == []


def test_an_idle_node_never_counts_the_time_before_its_first_report_as_silence():
    node = Node()
    node.at(60)  # no pong at all, nothing waiting
    saving(node)
    node.at(CFG.coordinator_timeout_s - 0.25)
    assert node.delivered == [] and node.state.busy


def test_pings_go_out_every_heartbeat():
    node = Node()
    node.at(3)
    pings = [m for m in node.sent if isinstance(m, Ping)]
    assert len(pings) == 3 and pings[0].nonce == 100_250


def test_a_ping_the_socket_refused_is_retried_at_the_next_tick():
    """No connection yet (the socket refuses the send): the next tick pings again, not a heartbeat
    later, so the first PONG, which the first reports wait for, comes as soon as one can."""
    node = Node()
    node.reachable = False
    node.at(0.75)
    node.reachable = True
    node.at(0.25)
    assert [m.nonce for m in node.sent if isinstance(m, Ping)] == [101_000]


@pytest.mark.parametrize(
    ("first", "kept"),
    [("c1", False), (None, True)],
    ids=["sent to the old instance: aborted", "held before any pong: sent to the first that answers"],
)
def test_a_restarted_coordinator_aborts_the_steps_its_predecessor_had(first, kept):
    node = Node()
    if first:
        node.pong(first)
    msg = saving(node)
    node.pong("c2")
    assert (node.delivered == []) is kept
    node.at(0.25)
    if kept:
        assert node.take() == [to(msg, "c2")] and node.state.unacked[K3].sent_to == "c2"
    else:
        ((key, _, verdict),) = node.delivered
        assert key == K3 and "the coordinator restarted before confirming the step" in verdict.reason


@pytest.mark.parametrize("report", [written(3), Failed(step=3, attempt=A, rank=0, world_size=2, node=1, reason="EIO")])
def test_no_report_goes_out_before_a_coordinator_answered_then_each_names_the_instance_that_did(report):
    """A report names the coordinator instance it is for, the one the last PONG named: one that
    reaches another instance (the coordinator restarted meanwhile) is dropped there. A node that
    never heard from a coordinator cannot name one: its reports wait for the first PONG."""
    node = Node()
    node.handle(Expect(key=K3, identity=b"rank0"))
    node.handle(Report(key=K3, msg=report))
    node.at(LINK_TIMEOUT_S)  # connected, say, but no PONG yet (a silence that resends all: sent once)
    assert node.take() == [] and node.state.unacked[K3].unsent == [report]
    node.pong("c1")
    node.at(0.25)
    assert node.take() == [to(report, "c1")] and node.state.unacked[K3].sent_to == "c1"
    node.answered(CFG.commit_timeout_s + CFG.coordinator_timeout_s - LINK_TIMEOUT_S - 0.25)  # chased, to c1 again
    assert node.take() == [to(report, "c1")]


def test_a_report_sent_to_the_old_instance_is_never_resent_and_the_abort_goes_to_the_new_one():
    """The race this addressing closes: node 1 sends its report to c1 while its connection already
    leads to the restarted c2 (which drops it: addressed to c1). c2's PONG tells the node that c1
    was lost: the root holds no commit, the ranks are told ABORTED, the report is never sent to c2,
    and the local abort (FAILED of rank -1) is addressed to c2, which ends the attempt there."""
    node = Node()
    node.pong("c1")
    msg = saving(node)
    assert node.take() == [to(msg, "c1")]
    node.pong("c2")
    ((_, _, verdict),) = node.delivered
    assert isinstance(verdict, StepAborted) and verdict.reason.startswith("the coordinator restarted")
    node.answered(CFG.commit_timeout_s + CFG.coordinator_timeout_s, "c2")
    (late,) = node.take()
    assert isinstance(late, Failed) and (late.rank, late.coordinator_instance) == (-1, "c2")


def test_a_local_abort_that_went_to_a_lost_instance_is_told_to_the_next_one():
    """The node aborted the attempt locally after a silence and sent the abort to c1, the last
    instance it knew, while its connection led to the restarted c2 already (which drops it): once
    c2 answers, c2 is told too, so that it ends the attempt and removes its files at once rather
    than after its commit timeout."""
    node = Node()
    node.pong("c1")
    saving(node)
    node.take()
    node.reachable = False
    node.at(CFG.coordinator_timeout_s + 0.25)
    node.reachable = True
    node.at(0.25)
    (late,) = node.take()
    assert isinstance(late, Failed) and (late.rank, late.coordinator_instance) == (-1, "c1")
    node.answered(1)
    assert node.take() == []  # c1 answers: told once
    node.pong("c2")
    node.at(0.25)
    assert node.take() == [to(late, "c2")]
    node.answered(CFG.commit_timeout_s, "c2")
    assert node.take() == [] and K3 not in node.state.unacked


def test_after_a_silence_long_enough_to_lose_the_connection_every_waiting_report_is_resent():
    node = Node()
    node.pong()
    msg3 = saving(node, K3)
    msg4 = saving(node, K4)
    node.take()
    node.at(LINK_TIMEOUT_S / 2 - 0.25)
    node.pong()
    assert node.take() == []  # a short silence: nothing lost
    node.at(LINK_TIMEOUT_S / 2 + 0.25)
    node.pong()
    assert node.take() == [to(msg3), to(msg4)]  # to the same instance: it still decides them


def test_a_report_made_late_in_a_silence_that_began_while_the_node_was_idle_is_resent_when_it_ends():
    """No answer since t=100 while nothing waited; at t=108 a report goes into the connection
    (the socket still takes it), which is replaced a little later, losing it. The next answer came
    3 s after the report, so the silence was taken for short and nothing was resent: the attempt
    waited for the coordinator's commit timeout (600 s by default) and aborted."""
    node = Node()
    node.pong()
    node.reachable = False  # pings go unanswered; the socket is no longer "refusing"
    node.at(LINK_TIMEOUT_S)
    node.reachable = True
    msg = saving(node)
    assert node.take() == [to(msg)]  # into the connection that is about to be replaced
    node.at(LINK_TIMEOUT_S / 2 - 0.5)  # shorter than a replaced connection's silence
    node.pong()
    assert node.take() == [to(msg)]


def test_a_coordinator_that_moved_is_pinged_at_once_and_every_waiting_report_resent_when_it_answers():
    """A later launch has the coordinator at another address (ckptd.daemon.node): the old
    connection's contents are lost, so even the same instance answering there at once gets every
    report still waiting; one that was decided meanwhile is not resent."""
    node = Node()
    node.pong()
    msg3 = saving(node, K3)
    saving(node, K4)
    node.take()
    node.handle(Verdict(key=K4, outcome=StepAborted(step=4, attempt=A, reason="disk full")))
    node.sent = []
    node.handle(Retarget(address="tcp://node0:29700"))
    assert node.sent == [Ping(nonce=int(node.now * 1000))] and node.state.address == "tcp://node0:29700"
    msg5 = saving(node, (5, A))
    assert node.take() == []  # who answers at the new address is not known yet
    node.pong()
    assert node.take() == [to(msg3), to(msg5)] and not node.delivered[1:]  # msg5 held until then
    node.at(0.25)
    node.pong()
    assert node.take() == []  # each sent once


def test_a_local_abort_in_the_old_connection_is_told_again_once_the_coordinator_answers_at_its_new_address():
    """A local abort (FAILED of rank -1) sent to c1 just before the move may have been lost with
    the old connection: told to c1 again once it answers at the new address, and only once."""
    node = Node()
    node.pong("c1")
    saving(node)
    node.take()
    node.reachable = False
    node.at(CFG.coordinator_timeout_s + 0.25)  # silent: aborted locally
    node.reachable = True
    node.at(0.25)
    (late,) = node.take()
    assert isinstance(late, Failed) and late.rank == -1
    node.handle(Retarget(address="tcp://node0:29700"))
    node.pong("c1")
    node.at(0.25)
    assert node.take() == [to(late, "c1")]
    node.answered(1)
    assert node.take() == []


def test_a_coordinator_that_moved_and_restarted_is_handled_as_a_restart():
    """The new address leads to another instance (node 0's daemon was started again): the root is
    asked whether the attempt committed, as after any restart."""
    node = Node()
    node.pong("c1")
    saving(node)
    node.take()
    node.handle(Retarget(address="tcp://node0:29700"))
    msg4 = saving(node, K4)
    node.pong("c2")
    node.at(0.25)
    assert to(msg4, "c2") in node.take()  # saved after the move: c2 decides it
    ((key, _, verdict),) = node.delivered
    assert key == K3 and isinstance(verdict, StepAborted) and verdict.reason.startswith("the coordinator restarted")
    assert node.asked == [K3]


def test_a_shutdown_aborts_only_steps_whose_reports_went_out():
    node = Node()
    saving(node, K3)
    node.handle(Expect(key=K4, identity=b"rank0"))
    node.handle(AbortAll(reason="the node daemon shut down before the step committed"))
    assert [d[0] for d in node.delivered] == [K3] and node.state.pending_steps() == [4]


def test_aborts_are_remembered_for_a_bounded_number_of_attempts():
    node = Node()
    for step in range(VERDICT_MEMORY + 3):
        node.handle(Verdict(key=(step, A), outcome=StepAborted(step=step, attempt=A, reason="x")))
    assert len(node.state.verdicts) == VERDICT_MEMORY and node.state.verdict((0, A)) is None
    assert node.state.verdict((VERDICT_MEMORY + 2, A)) is not None and not node.state.unacked


# --- the coordinator lost after its commit point: the root says what happened -----------------
def lose_the_coordinator(node: Node, cause: str) -> None:
    """The coordinator restarts (a new instance answers) or goes silent past its timeout."""
    if cause == "restarted":
        node.pong("c2")
    else:
        node.reachable = False
        node.at(CFG.coordinator_timeout_s + 0.25)


@pytest.mark.parametrize("cause", ["restarted", "silent"])
def test_a_step_the_lost_coordinator_committed_is_reported_committed(cause):
    """Node 0's daemon renamed the checkpoint into place (or wrote the S3 commit object) and died
    before announcing it: the node asks the root, which holds that attempt's commit, and tells its
    ranks COMMITTED with a warning (it used to tell them ABORTED)."""
    node = Node()
    node.pong("c1")
    saving(node)
    node.take()
    node.committed.add(K3)
    lose_the_coordinator(node, cause)
    assert node.asked == [K3]
    ((key, ranks, verdict),) = node.delivered
    assert key == K3 and ranks == {b"rank0"} and isinstance(verdict, StepCommitted)
    assert (verdict.step, verdict.attempt, verdict.name) == (3, A, "iter_0000003")
    (warning,) = verdict.warnings
    lost = "the coordinator restarted" if cause == "restarted" else "did not answer for 5 s"
    assert lost in warning and f"the root holds iter_0000003 committed by attempt {A}" in warning, warning
    assert node.state.verdict(K3) is None and not node.state.unacked and not node.state.busy
    node.reachable = True
    node.at(CFG.commit_timeout_s)
    assert node.take() == []  # no local abort to report: it committed


@pytest.mark.parametrize("cause", ["restarted", "silent"])
def test_a_step_the_root_holds_no_commit_of_aborts_saying_so(cause):
    node = Node()
    node.pong("c1")
    saving(node)
    node.take()
    node.committed.add((3, "0123456789ab-2"))  # another attempt of the step: not this one's commit
    lose_the_coordinator(node, cause)
    assert node.asked == [K3]
    ((key, _, verdict),) = node.delivered
    assert key == K3 and isinstance(verdict, StepAborted)
    assert "the root holds no commit of this attempt now" in verdict.reason
    assert "Checkpointer.latest() tells" in verdict.reason
    if cause == "restarted":
        assert verdict.reason.startswith("the coordinator restarted before confirming the step, and the root")
        assert "it did not commit unless" in verdict.reason
    node.reachable = True
    node.at(0.25)
    (late,) = node.take()
    assert isinstance(late, Failed) and late.rank == -1 and late.reason == verdict.reason
    assert late.coordinator_instance == ("c2" if cause == "restarted" else "c1")  # the one answering now


def test_a_root_that_does_not_answer_in_time_aborts_the_step_once_saying_it_could_not_tell():
    node = Node()
    node.pong("c1")
    saving(node)
    node.take()
    node.root_answers = False
    node.pong("c2")
    assert node.asked == [K3] and node.delivered == [] and node.state.busy
    assert not node.state.expects(K3, b"rank0")  # a write finishing now is a late one
    node.answered(CFG.coordinator_timeout_s - 0.25)
    assert node.delivered == [] and node.asked == [K3]  # asked once
    assert node.take() == []  # nothing resent to the new coordinator meanwhile
    node.answered(0.25)
    ((_, _, verdict),) = node.delivered
    assert isinstance(verdict, StepAborted)
    assert "the root did not tell within 5 s whether it committed" in verdict.reason
    assert "it may have committed (Checkpointer.latest() tells)" in verdict.reason
    node.handle(RootAnswer(key=K3, holds_commit=True))  # too late: the ranks were told
    assert len(node.delivered) == 1


def test_a_root_that_cannot_be_read_aborts_the_step_saying_why():
    node = Node()
    node.pong("c1")
    saving(node)
    node.root_answers = False
    node.pong("c2")
    node.handle(RootAnswer(key=K3, holds_commit=None, problem="StorageError: 503 SlowDown"))
    ((_, _, verdict),) = node.delivered
    assert isinstance(verdict, StepAborted)
    assert "the root could not tell whether it committed (StorageError: 503 SlowDown)" in verdict.reason


def test_a_verdict_that_comes_while_the_root_is_asked_decides_and_the_answer_is_ignored():
    node = Node()
    saving(node)
    node.take()
    node.root_answers = False
    node.reachable = False
    node.at(CFG.coordinator_timeout_s + 0.25)
    assert node.asked == [K3]
    verdict = StepCommitted(step=3, attempt=A, name="iter_0000003", warnings=[])
    node.handle(Verdict(key=K3, outcome=verdict))
    node.handle(RootAnswer(key=K3, holds_commit=False))
    assert node.delivered == [(K3, frozenset({b"rank0"}), verdict)] and not node.state.unacked


def test_the_abandons_of_a_nodes_ranks_for_their_dead_daemon_go_out_together():
    """Ranks 12 and 8 of a node whose daemon died ask its next daemon to abandon their saves of one
    attempt before a tick: the FAILED that went out named rank 8 alone, and the coordinator, which
    had counted rank 8's report, kept an attempt rank 12's save will never join."""
    node = Node()
    node.pong("c1")
    for rank in (12, 8):
        node.handle(Abandon(key=K3, reason=f"rank {rank}'s daemon died", handed_off=(), abandoning_rank=rank))
    node.at(0.25)
    (late,) = node.take()
    assert isinstance(late, Failed) and late.abandoned_by == [8, 12] and late.rank == -1
    # A relaunch's abandon asked first stands: a rank's after it does not replace it.
    node = Node()
    node.pong("c1")
    node.handle(Abandon(key=K4, reason="relaunch", handed_off=(0,)))
    node.handle(Abandon(key=K4, reason="rank 3's daemon died", handed_off=(), abandoning_rank=3))
    node.at(0.25)
    (late,) = node.take()
    assert isinstance(late, Failed) and (late.handed_off, late.abandoned_by) == ([0], [])
