"""A rank's pending saves resolved by the daemon's notifications, and the handle's future (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.client.handle import SaveFuture, SaveHandle, SaveStatus
from ckptd.client.pending import PendingSaves
from ckptd.client.stats import SaveRecord, SaveStats
from ckptd.control.protocol import StepAborted, StepCommitted, WriteDone
from ckptd.errors import SaveFailedError, SaveSkippedError, SaveTimeoutError
from ckptd.statedict.holdings import PlainWriters


class Owner:
    """What drives the futures here: counts the polls; a wait delivers the queued notifications."""

    def __init__(self) -> None:
        self.polls = 0
        self.pending = PendingSaves(rank=3, plain=PlainWriters())
        self.stats = SaveStats()
        self.inbox: list[StepCommitted | StepAborted] = []

    def poll(self) -> None:
        self.polls += 1

    def wait(self, future: SaveFuture, timeout_s: float | None) -> None:
        while self.inbox and future.status is SaveStatus.PENDING:
            self.pending.resolve(self.inbox.pop(0))

    def handle(self, step: int, attempt: str) -> SaveHandle:
        record = SaveRecord(step, 100, 0.01, 0.0)
        self.stats.add(record)
        h = SaveHandle(SaveFuture(step, record, self.stats, self.poll, self.wait), Path(f"/r/{step}"), attempt)
        self.pending.add(h)
        return h


def test_a_verdict_resolves_only_the_attempt_it_is_about():
    o = Owner()
    h = o.handle(5, "a-2")
    o.pending.resolve(StepAborted(step=5, attempt="a-1", reason="an earlier try failed"))  # another attempt's verdict
    o.pending.resolve(StepCommitted(step=5, attempt="a-1", name="step_5", warnings=[]))
    assert not h.done() and o.polls == 1 and 5 in o.pending
    o.pending.wrote(WriteDone(generation="g", block=0, step=5, attempt="a-2", write_s=0.5, queue_s=0.1, snapshot_s=0.2))
    o.inbox.append(StepCommitted(step=5, attempt="a-2", name="step_5", warnings=["common state differed"]))
    assert h.wait() == Path("/r/5")
    assert h.committed and h.warnings == ["common state differed"] and 5 not in o.pending
    assert h.record.persist_s == 0.5 and h.record.commit_latency_s == h.finished_s is not None
    assert o.stats.committed == 1
    assert h.done() and o.polls == 1  # a resolved future does not poll
    o.pending.resolve(StepAborted(step=5, attempt="a-2", reason="late"))  # a late verdict changes nothing
    assert h.committed and h.error is None


def test_a_failure_is_raised_once_by_wait_or_else_by_the_next_call():
    o = Owner()
    waited, unwaited = o.handle(1, "a-1"), o.handle(2, "a-1")
    o.pending.resolve(StepAborted(step=1, attempt="a-1", reason="disk full on node 1"))
    o.pending.resolve(StepAborted(step=2, attempt="a-1", reason="rank 4 died"))
    with pytest.raises(SaveFailedError, match="step 1 was not committed: disk full on node 1"):
        waited.wait()
    with pytest.raises(SaveFailedError, match=r"^1 earlier asynchronous save\(s\) failed: step 2 was not committed"):
        o.pending.raise_unobserved()
    o.pending.raise_unobserved()  # each failure once
    assert unwaited.status is SaveStatus.ABORTED and not o.pending


def test_a_failure_after_a_wait_that_timed_out_is_still_raised_by_the_next_call():
    """A poll loop (``try: h.wait(0.1) except SaveTimeoutError: ...``) marked the save observed: its
    failure, coming later, was never raised."""
    o = Owner()
    h = o.handle(3, "a-1")
    with pytest.raises(SaveTimeoutError):
        h.wait(0.0)
    o.pending.resolve(StepAborted(step=3, attempt="a-1", reason="node 2 lost its disk"))
    with pytest.raises(SaveFailedError, match="step 3 was not committed: node 2 lost its disk"):
        o.pending.raise_unobserved()


def test_waiting_for_all_raises_a_failure_before_a_timeout_of_another_save():
    """wait_all: a save still pending at the timeout ended the loop, and a failure already seen (its
    handle marked observed) was never raised."""
    from ckptd.client.pending import wait_for_all

    o = Owner()
    failed, pending = o.handle(4, "a-1"), o.handle(5, "a-1")
    o.inbox.append(StepAborted(step=4, attempt="a-1", reason="rank 1 died"))
    with pytest.raises(SaveFailedError, match="rank 1 died"):
        wait_for_all([failed, pending], 0.0)
    with pytest.raises(SaveTimeoutError):
        wait_for_all([pending], 0.0)
    o.pending.raise_unobserved()  # the failure was raised once, by wait_for_all


def test_a_step_another_rank_skipped_resolves_as_skipped_and_is_never_raised_later():
    o = Owner()
    h = o.handle(7, "a-1")
    o.pending.resolve(StepAborted(step=7, attempt="a-1", reason="rank 0's ring was full", skipped=True))
    assert h.skipped and h.future.observed
    o.pending.raise_unobserved()
    with pytest.raises(SaveSkippedError, match="step 7 was skipped: rank 0's ring was full"):
        h.wait()


def test_a_lost_daemon_fails_every_pending_save_as_unconfirmed(tmp_path):
    o = Owner()
    hs = [o.handle(s, "a-1") for s in (1, 2)]
    o.pending.daemon_lost("the node daemon (pid 9) died")
    assert all(h.status is SaveStatus.ABORTED for h in hs) and not o.pending
    assert all(str(h.error).startswith(f"step {h.step} was not confirmed: the node daemon (pid 9) died") for h in hs)


def test_saves_pending_at_close_resolve_unconfirmed_and_are_never_raised_later():
    """The daemon took them and still commits them: no failure for the next call to raise."""
    o = Owner()
    hs = [o.handle(s, "a-1") for s in (1, 2)]
    o.pending.closed()
    assert all(h.status is SaveStatus.ABORTED for h in hs) and not o.pending
    o.pending.raise_unobserved()
    for h in hs:
        with pytest.raises(
            SaveFailedError, match=f"step {h.step} was not confirmed: the Checkpointer was closed"
        ) as err:
            h.wait()
        assert "still commits it" in str(err.value) and str(h.path) in str(err.value)


def test_a_wait_that_times_out_says_so():
    o = Owner()
    h = o.handle(9, "a-1")
    with pytest.raises(SaveTimeoutError, match="step 9 did not commit within the wait timeout"):
        h.wait(0.0)
    assert h.status is SaveStatus.PENDING and 9 in o.pending
