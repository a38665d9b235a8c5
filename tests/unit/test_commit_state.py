"""The coordinator's decisions (ckptd.daemon.commitstate), event by event with an injected clock:
no sockets, no threads, no files. The process versions of some scenarios are in
tests/fault/test_attempts.py (ranks that disagree on the attempt, a retry after an abort with the
aborted attempt's write landing late) and tests/unit/test_uplink.py (a coordinator and a node
link on real sockets)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from ckptd.catalog import WentBack
from ckptd.config import CkptdConfig
from ckptd.control.protocol import Failed, StepAborted, StepCommitted, Written
from ckptd.daemon.commitevents import Action, Commit, CommitEnded, NodeSeen, Remove, ReportIn, RootFacts, Send, Tick
from ckptd.daemon.commitstate import FINISHED_MEMORY, CommitState
from ckptd.format.layout import data_file_name
from ckptd.format.records import BYTES, ItemRecord
from ckptd.roots.base import CommitOutcome

A, B = "0123456789ab-1", "0123456789ab-2"  # two attempts of one launch
N0, N1 = b"node0", b"node1"
INSTANCE, PREDECESSOR = "c1", "c0"  # this coordinator's instance, the one it replaced
CFG = CkptdConfig(commit_timeout_s=10, coordinator_timeout_s=5, heartbeat_s=1)


def _name(_attempt: str, rank: int) -> str:
    return data_file_name(rank)


def record(rank: int, *, fqn: str = "", path: str = "", offset: int = 0, length: int = 4) -> ItemRecord:
    rec = ItemRecord(fqn=fqn or f"x{rank}", kind=BYTES, rank=rank, relative_path=path or _name(A, rank))
    return rec.stored_at(rec.relative_path, offset, length)


def written(step: int, rank: int, *, attempt: str = A, world: int = 2, **kw: object) -> Written:
    fields: dict = {
        "records": [record(rank)],
        "common": b"common" if rank == 0 else None,
        "common_digest": "c",
        "file_nbytes": 4,
        "plain_digest": "p",
        "held": [],
    }
    fields.update(kw)
    return Written(step=step, attempt=attempt, rank=rank, world_size=world, node=rank, **fields)


def failed(step: int, rank: int, reason: str = "the disk is full", *, attempt: str = A, **kw: object) -> Failed:
    return Failed(step=step, attempt=attempt, rank=rank, world_size=2, node=max(rank, 0), reason=reason, **kw)  # type: ignore[arg-type]


class Coordinator:
    """The shell's part that tests need: ask the root's facts only where the state says (a root
    whose answers the test sets), feed events at a clock the test moves."""

    def __init__(self, *, adopted: list[tuple[int, str]] | None = None) -> None:
        self.now = 100.0
        self.state = CommitState(CFG, _name, instance=INSTANCE, adopted=adopted, now=self.now)
        self.holds: set[tuple[int, str]] = set()  # commits the root holds
        self.committed: set[int] = set()  # steps committed once
        self.asked: list[str] = []

    def report(self, identity: bytes, msg: Written | Failed, *, to: str = INSTANCE) -> list[Action]:
        """Handle ``msg`` addressed to coordinator instance ``to`` (this one unless said)."""
        msg = replace(msg, coordinator_instance=to)
        if not self.state.addressed_here(msg):  # dropped: nothing to ask the root
            return self.state.handle(ReportIn(identity=identity, msg=msg), self.now)
        key = (msg.step, msg.attempt)
        holds = True
        if self.state.asks_holds_commit(msg):
            self.asked.append("holds_commit")
            holds = key in self.holds
        committed = False
        if self.state.may_start(msg, holds):
            self.asked.append("committed_once")
            committed = msg.step in self.committed
        facts = RootFacts(holds_commit=holds, committed_once=committed)
        return self.state.handle(ReportIn(identity=identity, msg=msg, facts=facts), self.now)

    def commit_ended(self, step: int, attempt: str = A, error: str | None = None) -> list[Action]:
        outcome = None if error else CommitOutcome(name=f"iter_{step:07d}")
        if outcome is not None:
            self.holds.add((step, attempt))
            self.committed.add(step)
        return self.state.handle(CommitEnded(step=step, attempt=attempt, outcome=outcome, error=error), self.now)

    def tick(self, after_s: float) -> list[Action]:
        self.now += after_s
        return self.state.handle(Tick(), self.now)


def outcomes(actions: list[Action]) -> dict[bytes, object]:
    return {a.identity: a.msg for a in actions if isinstance(a, Send)}


def only_outcome(actions: list[Action]) -> StepAborted | StepCommitted:
    msgs = {id(m): m for m in outcomes(actions).values()}
    assert len(msgs) == 1, actions
    (msg,) = msgs.values()
    assert isinstance(msg, (StepAborted, StepCommitted))
    return msg


def committed_step(c: Coordinator, step: int, attempt: str = A) -> None:
    assert c.report(N0, written(step, 0, attempt=attempt)) == []
    (commit,) = c.report(N1, written(step, 1, attempt=attempt))
    assert isinstance(commit, Commit)
    assert isinstance(only_outcome(c.commit_ended(step, attempt)), StepCommitted)


# --- the way to a commit -----------------------------------------------------------------------------
def test_attempts_commit_in_the_order_they_began_whatever_order_their_last_reports_arrive_in():
    """Node 1, cut off for a while, resent the reports of steps 2-4 all at once, step 4's first: it
    committed first, step 2 then committed as a rollback to the commit order, and retention
    removed step 4, which its ranks had been told was committed (the crash matrix's netns,
    node-local run, a partition of 2 s)."""
    c = Coordinator()
    for step in (2, 3, 4):
        assert c.report(N0, written(step, 0)) == []
        c.now += 1.0
    assert c.report(N1, written(4, 1)) == []  # complete, but steps 2 and 3 began first
    assert c.state.status()["steps"][f"4/{A}"]["phase"] == "ready"
    (commit,) = c.report(N1, written(2, 1))
    assert isinstance(commit, Commit) and commit.step == 2
    three, four = c.report(N1, written(3, 1))
    assert isinstance(three, Commit) and isinstance(four, Commit) and (three.step, four.step) == (3, 4)
    # An attempt still collecting holds the later ones up until it is decided: here, its timeout.
    c.report(N0, written(5, 0))
    c.now += 1.0
    c.report(N0, written(6, 0))
    assert c.report(N1, written(6, 1)) == []
    actions = c.tick(CFG.commit_timeout_s)
    assert [a.step for a in actions if isinstance(a, Commit)] == [6]
    assert isinstance(outcomes(actions)[N1], StepAborted)
    # A node that gave up on an attempt waiting its turn (it lost the coordinator, and told its
    # ranks it aborted) aborts it everywhere: it was not handed to the commit thread yet.
    c.report(N0, written(7, 0))
    c.now += 1.0
    c.report(N0, written(8, 0))
    assert c.report(N1, written(8, 1)) == []
    aborted = only_outcome(c.report(N1, failed(8, -1, "node 1 lost its coordinator")))
    assert isinstance(aborted, StepAborted) and "node 1 lost its coordinator" in aborted.reason
    assert [a.step for a in c.report(N1, written(7, 1)) if isinstance(a, Commit)] == [7]


def test_every_rank_written_commits_once_and_announces_to_every_node():
    c = Coordinator()
    c.state.handle(NodeSeen(identity=b"node2"), c.now)  # a node that pinged, but writes nothing
    assert c.report(N1, written(3, 1)) == [] and c.state.busy
    (commit,) = c.report(N0, written(3, 0))
    assert isinstance(commit, Commit) and (commit.step, commit.attempt) == (3, A)
    assert [r.rank for r in commit.records] == [0, 1]  # by rank, whatever order they arrived in
    assert commit.files == {_name(A, 0): (0, 4), _name(A, 1): (1, 4)} and commit.common == b"common"
    assert c.state.status()["steps"]["3/" + A]["phase"] == "committing"
    done = c.commit_ended(3)
    assert set(outcomes(done)) == {N0, N1, b"node2"} and not any(isinstance(a, Remove) for a in done)
    msg = only_outcome(done)
    assert isinstance(msg, StepCommitted) and msg.name == "iter_0000003" and msg.plain_digest == "p"
    assert not c.state.busy and c.state.status()["nodes"] == [0, 1]


def test_a_commit_that_fails_aborts_the_attempt():
    c = Coordinator()
    c.report(N0, written(3, 0))
    c.report(N1, written(3, 1))
    msg = only_outcome(c.commit_ended(3, error="StorageError: disk full"))
    assert isinstance(msg, StepAborted) and msg.reason == "commit failed: StorageError: disk full"


def test_ranks_whose_common_state_differs_from_rank_0s_are_named_in_the_verdict():
    c = Coordinator()
    c.report(N0, written(3, 0))
    c.report(N1, written(3, 1, common_digest="other"))
    msg = only_outcome(c.commit_ended(3))
    assert isinstance(msg, StepCommitted) and "common state of ranks [1] differs" in msg.warnings[0]


# --- repeated and late reports -------------------------------------------------------------------------
def test_a_repeated_written_is_counted_once_and_a_differing_one_aborts():
    c = Coordinator()
    c.report(N0, written(3, 0))
    assert c.report(N0, written(3, 0)) == [] and c.state.duplicates == 1
    msg = only_outcome(c.report(N0, written(3, 0, file_nbytes=8)))
    assert isinstance(msg, StepAborted) and f"rank 0 reported attempt {A} of step 3 twice, differently" in msg.reason


@pytest.mark.parametrize("late", [written(3, 1), failed(3, -1)], ids=["WRITTEN", "FAILED of the node"])
def test_a_report_of_a_committed_attempt_is_answered_with_its_commit_and_its_files_removed(late):
    c = Coordinator()
    committed_step(c, 3)
    c.asked.clear()
    actions = c.report(N1, late)
    assert actions == [
        Send(identity=N1, msg=c.state.finished[(3, A)], block=True),
        Remove(step=3, attempt=A),
    ]
    assert isinstance(actions[0].msg, StepCommitted)  # type: ignore[union-attr]
    assert c.asked == (["holds_commit"] if isinstance(late, Written) else []) and not c.state.busy


def test_a_ranks_failed_of_a_committed_attempt_is_a_new_saves_and_only_its_reporter_is_told():
    """Every rank of a commit wrote: a rank's FAILED of that attempt comes from another save that
    repeated the attempt id. Before, it was told COMMITTED. Now its reporter alone is told ABORTED
    (an abort to every node would be taken for the commit's), and the commit's memory stays."""
    c = Coordinator()
    committed_step(c, 3)
    actions = c.report(N1, failed(3, 1, "its write failed"))
    assert [type(a) for a in actions] == [Send] and actions[0].identity == N1  # type: ignore[union-attr]
    assert isinstance(actions[0].msg, StepAborted) and "committed already" in actions[0].msg.reason  # type: ignore[union-attr]
    assert isinstance(c.state.finished[(3, A)], StepCommitted) and not c.state.busy


def test_a_late_failed_of_an_aborted_attempt_is_answered_with_the_abort_and_the_step_saves_again_at_once():
    c = Coordinator()
    c.report(N0, written(3, 0))
    timeout = c.tick(CFG.commit_timeout_s + 1)
    assert Remove(step=3, attempt=A) in timeout and "ranks [1] did not report" in only_outcome(timeout).reason
    c.asked.clear()
    late = c.report(N1, failed(3, 1, "its data file was not written"))
    assert late[1:] == [Remove(step=3, attempt=A)] and "did not report" in only_outcome(late).reason
    assert c.asked == [] and not c.state.busy
    committed_step(c, 3, attempt=B)  # the retry: never mixed with the aborted attempt's reports


def test_a_commit_the_root_no_longer_holds_is_not_answered_from_memory():
    """The root was emptied (or a relaunch repeated the attempt id): the report starts collecting
    anew, and its files are not removed as junk."""
    c = Coordinator()
    committed_step(c, 3)
    c.holds.clear()
    c.committed.clear()
    assert c.report(N0, written(3, 0)) == []
    assert c.asked[-2:] == ["holds_commit", "committed_once"] and c.state.busy


def test_a_report_a_commit_counted_is_answered_from_memory_after_the_root_retired_it():
    """The verdict to node 1 was lost; retention (or a rollback) retired the commit before node 1
    resent its report: the report the commit counted (its id) is told COMMITTED, never collected
    anew (which aborted a save that committed, or on S3 committed it again, moving `latest` back
    past a rollback), also after a node's late local abort of it. A report of another save with
    that attempt id (a relaunch that repeated it) is known for one by its id and collected anew;
    a resend of the commit's reports meanwhile is still answered with that commit, and the new
    save's files stay."""
    c = Coordinator()
    c.report(N0, written(3, 0, report_id=11))
    c.report(N1, written(3, 1, report_id=12))
    c.commit_ended(3)
    c.holds.clear()  # retired (a rollback abandoned it: the step counts as not committed)
    c.committed.clear()
    c.asked.clear()
    late_abort = failed(3, -1, "the coordinator did not answer for 600 s")
    assert isinstance(c.report(N1, late_abort)[0].msg, StepCommitted)  # type: ignore[union-attr]
    actions = c.report(N1, written(3, 1, report_id=12))
    assert isinstance(actions[0].msg, StepCommitted) and Remove(step=3, attempt=A) in actions  # type: ignore[union-attr]
    assert c.asked == [] and not c.state.busy
    assert c.report(N1, written(3, 1, report_id=99)) == []  # another save's report
    assert c.asked == ["committed_once"] and c.state.busy
    # While the new save is collected, a resend of the commit's is not answered: the node keeps
    # one entry per attempt, which would take that verdict for the new save's ranks too.
    assert c.report(N0, written(3, 0, report_id=11)) == []
    c.report(N0, written(3, 0, report_id=98))
    c.commit_ended(3)  # the new save commits: the first commit's reports are still known
    resend = c.report(N0, written(3, 0, report_id=11))
    assert isinstance(resend[0].msg, StepCommitted) and Remove(step=3, attempt=A) in resend  # type: ignore[union-attr]


def test_the_reports_of_every_commit_a_resend_can_still_concern_are_remembered():
    """Saves far more often than a node's resend comes (commit_timeout_s + coordinator_timeout_s
    after its report): the ids of every commit of that window stay (not only the last 64); older
    ones go once 64 are newer."""
    from ckptd.daemon.countedreports import COUNTED_MEMORY

    c = Coordinator()
    for step in range(1, 201):
        c.report(N0, written(step, 0, report_id=2 * step))
        c.report(N1, written(step, 1, report_id=2 * step + 1))
        c.commit_ended(step)
        c.tick(0.05)
    assert len(c.state.counted) == 200 > COUNTED_MEMORY
    c.tick(CFG.commit_timeout_s + 2 * CFG.coordinator_timeout_s)
    c.report(N0, written(201, 0, report_id=402))
    c.report(N1, written(201, 1, report_id=403))
    c.commit_ended(201)
    assert len(c.state.counted) == COUNTED_MEMORY and (201, A) in c.state.counted


def test_a_new_save_that_repeats_the_attempt_id_of_a_step_still_committed_is_aborted_not_told_committed():
    """Before, its report was answered COMMITTED from memory (the root held the commit) and its
    files removed: the trainer took the old checkpoint for its new state."""
    c = Coordinator()
    c.report(N0, written(3, 0, report_id=11))
    c.report(N1, written(3, 1, report_id=12))
    c.commit_ended(3)
    actions = c.report(N0, written(3, 0, report_id=21))
    assert [type(a) for a in actions] == [Send] and actions[0].identity == N0  # type: ignore[union-attr]
    assert isinstance(actions[0].msg, StepAborted) and "step 3 is committed already" in actions[0].msg.reason  # type: ignore[union-attr]
    assert isinstance(c.state.finished[(3, A)], StepCommitted)  # nothing told to the other nodes


def test_a_ranks_failure_under_a_remembered_commits_attempt_id_is_never_told_committed():
    """A re-save under a repeated attempt id fails at its writer (the step is committed by that
    attempt: its upload would replace the committed object). Its commit is remembered, but its
    counted reports are forgotten: the FAILED was taken for a resend, the root asked whether it
    still holds that commit, and the rank told COMMITTED although nothing of its save was written.
    A commit counted a WRITTEN of every rank, so a rank's FAILED is always a new save's."""
    c = Coordinator()
    c.report(N0, written(3, 0, report_id=11))
    c.report(N1, written(3, 1, report_id=12))
    c.commit_ended(3)
    from ckptd.daemon.countedreports import CountedReports

    c.state.counted = CountedReports(c.state.counted.window_s)  # the commit left the counted reports' memory
    actions = c.report(N0, failed(3, 0, "writing its data file failed: committed already"))
    assert "holds_commit" not in c.asked
    assert [type(a) for a in actions] == [Send] and actions[0].identity == N0  # type: ignore[union-attr]
    assert isinstance(actions[0].msg, StepAborted) and "step 3 is committed already" in actions[0].msg.reason  # type: ignore[union-attr]
    # The root could not be asked (a hung store fails the writer and the question alike): the
    # reporter alone is told, as above. An attempt collected, it was aborted on every node, which
    # took the abort for the commit's (node-local peers removed files of it).
    unknown = RootFacts(known=False)
    msg = replace(failed(3, 1, "the store did not answer"), coordinator_instance=INSTANCE)
    actions = c.state.handle(ReportIn(identity=N1, msg=msg, facts=unknown), c.now)
    assert [type(a) for a in actions] == [Send] and actions[0].identity == N1  # type: ignore[union-attr]
    assert "could not be asked whether that commit still stands" in actions[0].msg.reason  # type: ignore[union-attr]
    assert isinstance(c.state.finished[(3, A)], StepCommitted) and (3, A) not in c.state.attempts


def test_a_report_that_only_the_root_can_place_waits_while_the_root_cannot_be_asked():
    """A WRITTEN of a remembered commit's attempt whose counted reports are forgotten: a resend of
    that commit's (answered COMMITTED) or a new save's under the repeated attempt id after a
    rollback retired it (collected anew). Only the root tells; while it cannot be asked the report
    is left for the node's resend. It was answered COMMITTED, and the new save's files removed."""
    from ckptd.daemon.countedreports import CountedReports

    c = Coordinator()
    c.report(N0, written(3, 0, report_id=11))
    c.report(N1, written(3, 1, report_id=12))
    c.commit_ended(3)
    c.state.counted = CountedReports(c.state.counted.window_s)
    msg = replace(written(3, 0, report_id=31), coordinator_instance=INSTANCE)
    assert c.state.asks_holds_commit(msg)
    assert c.state.handle(ReportIn(identity=N0, msg=msg, facts=RootFacts(known=False)), c.now) == []
    assert (3, A) not in c.state.attempts
    told = c.state.handle(ReportIn(identity=N0, msg=msg, facts=RootFacts(holds_commit=True)), c.now)
    assert isinstance(only_outcome(told), StepCommitted)  # the root holds it: a resend


def test_a_step_committed_already_is_not_saved_again():
    c = Coordinator()
    c.committed.add(3)
    actions = c.report(N0, written(3, 0, attempt=B))
    assert Remove(step=3, attempt=B) in actions
    assert "step 3 is committed already; rank 0 (node 0) saved it again" in only_outcome(actions).reason


def test_a_restarted_coordinator_answers_a_report_of_its_predecessors_commit_with_an_abort():
    """A new incarnation remembers no outcome: the root tells it the step is committed, so a
    late report of that attempt can never start a second commit."""
    c = Coordinator()
    c.committed.add(3)
    c.holds.add((3, A))
    actions = c.report(N1, written(3, 1))
    assert c.asked == ["committed_once"] and not any(isinstance(a, Commit) for a in actions)
    assert "committed already" in only_outcome(actions).reason


# --- reports addressed to another coordinator instance -------------------------------------------
@pytest.mark.parametrize("to", [PREDECESSOR, ""], ids=["to its predecessor", "unaddressed"])
@pytest.mark.parametrize(
    "msg",
    [written(3, 1), failed(3, 1), failed(3, -1, "the coordinator restarted")],
    ids=["WRITTEN", "FAILED", "a node's local abort"],
)
def test_a_report_addressed_to_another_coordinator_instance_is_dropped_and_counted(msg, to):
    """A report its node sent to the coordinator it knew, which reached the restarted one (or one
    no ckptd node sends: unaddressed) counts for nothing, and the root is not asked about it; the
    same report addressed to this instance counts."""
    c = Coordinator()
    assert c.report(N1, msg, to=to) == [] and c.asked == []
    assert c.state.misaddressed == 1 and not c.state.busy
    assert not c.state.attempts and not c.state.finished and N1 not in c.state.nodes
    c.report(N1, msg)  # addressed to this instance: collected (WRITTEN) or decided (FAILED)
    assert ((3, A) in c.state.attempts or (3, A) in c.state.finished) and c.state.misaddressed == 1


def test_a_restarted_coordinator_never_commits_an_attempt_from_a_report_sent_to_its_predecessor():
    """Node 1 reported rank 1's write to coordinator c0, which had died; the report reached the
    restarted c1 before node 1 learnt of the restart (from c1's PONG), so node 1 takes the attempt
    for lost and aborts it locally. Node 0's report (it knew c1 already) completes the world, yet
    c1 does not commit: node 1's local abort, addressed to c1, ends the attempt everywhere."""
    c = Coordinator()
    assert c.report(N1, written(3, 1), to=PREDECESSOR) == []
    assert c.report(N0, written(3, 0)) == []  # no Commit: rank 1's write was never counted here
    assert c.state.status()["steps"][f"3/{A}"]["written"] == [0]
    actions = c.report(N1, failed(3, -1, "the coordinator restarted before confirming the step"))
    assert Remove(step=3, attempt=A) in actions and not any(isinstance(a, Commit) for a in actions)
    verdict = only_outcome(actions)
    assert isinstance(verdict, StepAborted) and "the coordinator restarted" in verdict.reason
    assert set(outcomes(actions)) == {N0, N1}


# --- aborts -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        (written(3, 1, world=3), "world size 3, other ranks of attempt"),
        (written(3, 5, world=2), "rank 5 outside world size 2"),
        (written(3, 1, records=[record(0)]), "rank 1 sent records of rank 0"),
        (written(3, 1, records=[record(1, path="elsewhere")]), "not in its data file __1_0.distcp"),
        (written(3, 1, file_nbytes=2), "has 2 bytes, but its records address 4"),
        (written(3, 1, records=[ItemRecord(fqn="x", kind="blob", rank=1)]), "malformed item record"),
        (failed(3, 1), "rank 1 (node 1): the disk is full"),
    ],
    ids=["world size", "rank", "other rank's records", "other file", "short file", "malformed", "FAILED"],
)
def test_a_report_that_contradicts_the_attempt_aborts_it_everywhere(msg, reason):
    c = Coordinator()
    c.report(N0, written(3, 0))
    actions = c.report(N1, msg)
    verdict = only_outcome(actions)
    assert isinstance(verdict, StepAborted) and reason in verdict.reason and not verdict.skipped
    assert set(outcomes(actions)) == {N0, N1} and Remove(step=3, attempt=A) in actions
    assert c.report(N0, written(3, 0))[0] == Send(identity=N0, msg=verdict, block=True)  # decided


def test_a_policy_skip_aborts_as_a_skip():
    c = Coordinator()
    verdict = only_outcome(c.report(N1, failed(5, 1, "skipped the save: ring busy", skipped=True)))
    assert isinstance(verdict, StepAborted) and verdict.skipped


def test_a_commit_that_would_lack_a_held_key_is_refused():
    c = Coordinator()
    c.report(N0, written(3, 0, held=["replicated"]))
    verdict = only_outcome(c.report(N1, written(3, 1, held=["replicated"])))
    assert isinstance(verdict, StepAborted) and "the coordinator refused the commit" in verdict.reason


def test_ranks_that_disagree_on_the_attempt_abort_both_attempts_naming_them():
    c = Coordinator()
    c.report(N0, written(3, 0, attempt=A))
    actions = c.report(N1, written(3, 1, attempt=B))
    reasons = {a.msg.reason for a in actions if isinstance(a, Send)}  # type: ignore[union-attr]
    assert {r for a in actions if isinstance(a, Remove) for r in [a.attempt]} == {A, B}
    (reason,) = reasons
    assert "ranks disagree on the save attempt: ranks [0] (nodes [0]) saved attempt " + A in reason
    assert "rank 1 (node 1) saved attempt " + B in reason and "CKPTD_RUN_ID" in reason


def test_a_late_failure_of_an_attempt_not_known_here_aborts_only_that_attempt():
    """A restarted coordinator (no record of attempt A: its abort removed its directory, so nothing
    was adopted) collects the retry B of step 7 when a write of A that outlived the abort is
    reported FAILED (as a late write is). Both were aborted as ranks that disagree on the attempt:
    the retry, which every rank saves, failed for nothing."""
    c = Coordinator()
    assert c.report(N0, written(7, 0, attempt=B)) == []
    late = "its data file was written after the attempt had been decided (late write)"
    actions = c.report(N1, failed(7, 1, late, attempt=A))
    assert {a.attempt for a in actions if isinstance(a, Remove)} == {A}
    aborted = only_outcome(actions)
    assert aborted.attempt == A and late in aborted.reason and "disagree" not in aborted.reason
    (commit,) = c.report(N1, written(7, 1, attempt=B))
    assert isinstance(commit, Commit) and commit.attempt == B
    assert isinstance(only_outcome(c.commit_ended(7, B)), StepCommitted)
    # A repeat of the late FAILED is answered with A's abort, and still leaves B alone.
    assert only_outcome(c.report(N1, failed(7, 1, late, attempt=A))) == aborted


def test_an_attempt_started_while_another_of_its_step_commits_aborts_alone():
    c = Coordinator()
    c.report(N0, written(3, 0))
    c.report(N1, written(3, 1))  # committing
    actions = c.report(N0, written(3, 0, attempt=B))
    assert Remove(step=3, attempt=B) in actions and "while attempt " + A in only_outcome(actions).reason
    assert isinstance(only_outcome(c.commit_ended(3)), StepCommitted)


def test_the_commit_timeout_counts_from_the_first_report_and_names_the_missing_ranks():
    c = Coordinator()
    c.report(N0, written(3, 0, world=3))
    assert c.tick(CFG.commit_timeout_s) == []  # not over yet
    actions = c.tick(0.5)
    assert "ranks [1, 2] did not report within 10 s (CKPTD_COMMIT_TIMEOUT_S)" in only_outcome(actions).reason
    assert c.tick(100) == []  # aborted once
    # A large world names 16 missing ranks and counts the others (it named every one: megabytes).
    c.report(N0, written(4, 0, world=100_000))
    reason = only_outcome(c.tick(CFG.commit_timeout_s + 101)).reason
    assert f"ranks {list(range(1, 17))} and 99983 more did not report" in reason and len(reason) < 1000


def test_a_commit_in_progress_never_times_out():
    c = Coordinator()
    c.report(N0, written(3, 0))
    c.report(N1, written(3, 1))
    assert c.tick(CFG.commit_timeout_s * 10) == []
    assert isinstance(only_outcome(c.commit_ended(3)), StepCommitted)


def test_a_node_local_abort_of_an_unknown_attempt_is_remembered_and_cleaned_up():
    c = Coordinator()
    actions = c.report(N1, failed(3, -1, "the coordinator restarted"))
    assert actions[1:] == [Remove(step=3, attempt=A)] and c.asked == []  # never a new attempt
    verdict = only_outcome(actions)
    assert isinstance(verdict, StepAborted) and verdict.reason == "node 0: the coordinator restarted"
    assert c.report(N0, written(3, 0))[0] == Send(identity=N0, msg=verdict, block=True)


# --- a relaunch's abandon (ckptd.client.settle) -----------------------------------------------------
def test_an_abandon_aborts_an_attempt_a_rank_never_handed_off_on_every_node():
    c = Coordinator()
    c.report(N0, written(3, 0))
    verdict = only_outcome(c.report(N0, failed(3, -1, "its launch is gone", handed_off=[0])))
    assert isinstance(verdict, StepAborted) and "its launch is gone" in verdict.reason


def test_an_abandon_keeps_an_attempt_whose_reports_and_ranks_in_flight_make_up_its_world():
    """Node 1's daemon reported rank 1 and died: the relaunch finds only rank 0's save (still being
    written on node 0). Rank 0 reports once written, and the attempt commits."""
    c = Coordinator()
    c.report(N1, written(3, 1))
    assert c.report(N0, failed(3, -1, "its launch is gone", handed_off=[0])) == []
    (commit,) = c.report(N0, written(3, 0))
    assert isinstance(commit, Commit)
    assert isinstance(only_outcome(c.commit_ended(3)), StepCommitted)


def test_an_abandon_of_an_attempt_nobody_reported_tells_every_node():
    c = Coordinator()
    for node in (N0, N1):
        c.state.handle(NodeSeen(identity=node), c.now)
    actions = c.report(N0, failed(3, -1, "its launch is gone", handed_off=[1]))
    told = outcomes(actions)
    assert set(told) == {N0, N1} and all(isinstance(m, StepAborted) for m in told.values())


def test_an_abandon_of_an_adopted_committing_or_committed_attempt():
    """An adopted leftover (its records died with the old coordinator) aborts; one committing is
    left to its commit; one committed is answered with its commit, and nobody else is told."""
    c = Coordinator(adopted=[(4, A)])
    verdict = only_outcome(c.report(N0, failed(4, -1, "its launch is gone", handed_off=[0])))
    assert isinstance(verdict, StepAborted)
    c.report(N0, written(3, 0))
    (commit,) = c.report(N1, written(3, 1))
    assert isinstance(commit, Commit)
    assert c.report(N0, failed(3, -1, "its launch is gone", handed_off=[0])) == []  # committing: ignored
    assert isinstance(only_outcome(c.commit_ended(3)), StepCommitted)
    answer = c.report(N0, failed(3, -1, "its launch is gone", handed_off=[0]))
    assert set(outcomes(answer)) == {N0} and isinstance(only_outcome(answer), StepCommitted)


# --- adopted leftovers ------------------------------------------------------------------------------
def test_an_adopted_leftover_nobody_reports_on_does_not_keep_the_daemon_busy_and_times_out():
    c = Coordinator(adopted=[(3, A)])
    assert not c.state.busy
    assert c.tick(CFG.commit_timeout_s) == []
    assert c.tick(0.5) == [Remove(step=3, attempt=A)]  # no node to tell: none reported on it
    assert (3, A) not in c.state.attempts and isinstance(c.state.finished[(3, A)], StepAborted)


def test_an_adopted_leftover_reported_on_learns_its_world_size_and_commits():
    c = Coordinator(adopted=[(3, A)])
    assert c.report(N0, written(3, 0)) == [] and c.state.busy and c.asked == []
    (commit,) = c.report(N1, written(3, 1))
    assert isinstance(commit, Commit)


def test_a_new_attempt_of_an_adopted_leftovers_step_is_no_disagreement():
    c = Coordinator(adopted=[(3, A)])
    assert c.report(N0, written(3, 0, attempt=B)) == []
    (commit,) = c.report(N1, written(3, 1, attempt=B))
    assert isinstance(commit, Commit) and commit.attempt == B


# --- memory ---------------------------------------------------------------------------------------
def test_outcomes_are_remembered_for_a_bounded_number_of_attempts():
    c = Coordinator()
    for step in range(FINISHED_MEMORY + 5):
        c.report(N0, failed(step, 0))
    assert len(c.state.finished) == FINISHED_MEMORY and (0, A) not in c.state.finished
    c.asked.clear()
    actions = c.report(N1, failed(0, 1))  # forgotten: a new attempt, aborted
    assert c.asked == ["committed_once"] and Remove(step=0, attempt=A) in actions


# --- node-local roots (ckptd.roots.nodelocal) --------------------------------------------------------
def test_a_node_local_commit_checks_only_its_own_nodes_files_and_sends_the_commit_files_to_every_node():
    c = Coordinator()
    c.state.local_node = 0  # the coordinator's node: node 0
    c.report(N0, written(3, 0))
    (commit,) = c.report(N1, written(3, 1))
    assert isinstance(commit, Commit) and commit.elsewhere == {_name(A, 1)}  # rank 1's file is on node 1's disk
    files = {".metadata": b"m", "common.pt": b"c", "metadata.json": b"j", "ckptd_commit.json": b"r"}
    outcome = CommitOutcome(name="iter_0000003", files=files)
    done = c.state.handle(CommitEnded(step=3, attempt=A, outcome=outcome, error=None), c.now)
    sent = outcomes(done)
    assert set(sent) == {N0, N1}
    assert all(isinstance(m, StepCommitted) and m.local_files == files for m in sent.values())
    # What is remembered for repeated reports is the verdict without the files; a repeated report
    # of a recent commit is answered with them again (its node may have missed the first).
    assert c.state.finished[(3, A)].local_files == {}
    c.holds.add((3, A))
    again = outcomes(c.report(N1, written(3, 1)))
    assert again[N1].local_files == files


def test_a_shared_root_checks_every_file_and_sends_no_files():
    c = Coordinator()
    c.report(N0, written(3, 0))
    (commit,) = c.report(N1, written(3, 1))
    assert isinstance(commit, Commit) and commit.elsewhere == frozenset()
    assert all(m.local_files == {} for m in outcomes(c.commit_ended(3)).values())


def test_on_a_node_local_root_a_nodes_own_abort_of_an_unknown_attempt_is_not_answered():
    """The lost predecessor may have committed it on node 0's disk: an ABORTED would make the node
    remove its files of that commit (ckptd.daemon.nodelocal)."""
    c = Coordinator()
    c.state.local_node = 0
    assert c.report(N1, failed(3, -1, "the coordinator restarted")) == []
    assert (3, A) not in c.state.finished


@pytest.mark.parametrize(
    "reported, expected",
    [
        (((20, 7.5), (20, 7.0)), WentBack(step=20, before_unix_s=7.0)),  # as of the earliest load
        (((20, 7.0), (-1, 0.0)), None),  # one rank loaded nothing
        (((20, 7.0), (10, 7.0)), None),  # they loaded different steps: nothing is replaced
        (((-1, 0.0), (-1, 0.0)), None),
    ],
)
def test_a_commit_replaces_the_steps_a_job_left_only_when_every_rank_loaded_the_same_step(reported, expected):
    c = Coordinator()
    actions = []
    for rank, (to, at) in enumerate(reported):
        actions = c.report(N0 if rank == 0 else N1, written(30, rank, went_back_to=to, went_back_unix_s=at))
    commits = [a for a in actions if isinstance(a, Commit)]
    assert len(commits) == 1 and commits[0].went_back == expected


def test_a_commit_is_numbered_above_the_highest_number_a_node_reports_of_its_disk():
    """Node-local disks: node 0's disk replaced numbers from 1 again; the commit carries the
    highest number any node's disk holds (Written.disk_seq), which node 0 numbers it above."""
    c = Coordinator()
    assert c.report(N1, written(3, 1, disk_seq=53)) == []
    (commit,) = c.report(N0, written(3, 0, disk_seq=2))
    assert isinstance(commit, Commit) and commit.seq_floor == 53


def test_a_commit_number_nothing_can_carry_is_refused_on_disk_and_on_the_wire():
    """A commit record of a huge number (tampered, another tool's) raised every commit's numbering
    past what msgpack carries: the node's WRITTEN could never be sent again."""
    import json

    from ckptd.control.codec import Codec
    from ckptd.errors import CorruptCheckpointError, ProtocolError
    from ckptd.format.commitrecord import MAX_COMMIT_SEQ, parse_commit_record_checked

    raw = {"seq": MAX_COMMIT_SEQ + 1, "step": 3, "attempt": A, "committed_unix_s": 1.0}
    with pytest.raises(CorruptCheckpointError, match="is damaged"):
        parse_commit_record_checked(json.dumps(raw).encode(), "iter_0000003/ckptd_commit.json")
    codec = Codec("job")
    with pytest.raises(ProtocolError, match="commit number"):
        codec.decode(codec.encode(written(3, 1, disk_seq=MAX_COMMIT_SEQ + 1)))
    assert codec.decode(codec.encode(written(3, 1, disk_seq=MAX_COMMIT_SEQ))).disk_seq == MAX_COMMIT_SEQ  # type: ignore[attr-defined]


# --- what the verdicts carry ------------------------------------------------------------------------
def test_a_verdicts_text_fits_the_smallest_message_limit_whatever_its_characters():
    """Warnings and reasons were cut to 16,384 characters each, 64 warnings: up to 4 MiB of UTF-8,
    and a file name's undecodable byte could not be encoded at all. The STEP_COMMITTED then failed
    to send (from the loop that also held the next Commit), every time a node resent its report.
    Now each text is bounded in bytes, the warnings together too, and what cannot be encoded is
    escaped."""
    from ckptd.config import _MIN_MESSAGE_NBYTES
    from ckptd.control.codec import Codec

    codec = Codec("job", max_nbytes=_MIN_MESSAGE_NBYTES)
    c = Coordinator()
    c.report(N0, written(3, 0))
    c.report(N1, written(3, 1))
    undecodable = os.fsdecode(b"\xff")  # a file name's byte that is no UTF-8: a lone surrogate
    warnings = [f"could not remove iter_0000001/{undecodable}.tmp", *(f"{i}: {'𝄞' * 5000}" for i in range(100))]
    outcome = CommitOutcome(name="iter_0000003", warnings=warnings)
    committed = only_outcome(c.state.handle(CommitEnded(step=3, attempt=A, outcome=outcome), c.now))
    assert isinstance(committed, StepCommitted)
    assert codec.decode(codec.encode(committed)) == committed
    assert ascii(committed.warnings[0]) == ascii("could not remove iter_0000001/\\udcff.tmp")
    assert committed.warnings[1].startswith("0: 𝄞") and committed.warnings[1].endswith(" more bytes)")
    assert committed.warnings[-1].startswith("... and 99 more warnings")
    c.report(N0, written(4, 0))
    aborted = only_outcome(c.report(N1, failed(4, 1, "no room for " + "𝄞" * 20000)))
    assert isinstance(aborted, StepAborted) and aborted.reason.startswith("rank 1 (node 1): no room for 𝄞")
    assert codec.decode(codec.encode(aborted)) == aborted


def test_a_ranks_abandon_for_its_dead_daemon_keeps_an_attempt_that_daemon_reported():
    """A rank whose node daemon died asks its next daemon to abort the attempts the dead one held
    (a FAILED of the node naming the rank): so later steps need not wait out commit_timeout_s. One
    the dead daemon had written and reported commits once the others are written; one it had
    not aborts at once."""
    c = Coordinator()
    assert c.report(N1, written(5, 1)) == []  # rank 1's daemon wrote and reported step 5, then died
    abandon = failed(5, -1, "the node daemon of rank 1 died holding its save of step 5", abandoned_by=[1])
    assert c.report(N1, abandon) == []
    assert any(isinstance(a, Commit) for a in c.report(N0, written(5, 0)))
    # Not reported before it died: aborted at once, on every rank that reported.
    c = Coordinator()
    assert c.report(N0, written(6, 0)) == []
    out = c.report(N1, failed(6, -1, "the node daemon of rank 1 died holding its save of step 6", abandoned_by=[1]))
    aborted = [a for a in out if isinstance(a, Send) and isinstance(a.msg, StepAborted)]
    assert {a.identity for a in aborted} >= {N0} and "died holding its save of step 6" in aborted[0].msg.reason
