"""The daemon's background jobs report typed completions (ckptd.daemon.workers), routed by type."""

from __future__ import annotations

import os
import select

import pytest

from ckptd.daemon.intakestate import NotWritten
from ckptd.daemon.workers import CleanupFinished, CommitFinished, Completion, Completions, WorkerPools, WriteFinished


def _wait_for(completions: Completions, n: int) -> list[Completion]:
    out: list[Completion] = []
    while len(out) < n:
        ready, _, _ = select.select([completions.fd], [], [], 30)
        assert ready, f"only {len(out)} of {n} completions within 30 s"
        out += completions.drain()
    return out


def _raise(exc: Exception):
    def run():
        raise exc

    return run


@pytest.mark.timeout(60)
def test_each_kind_of_job_finishes_as_its_own_type_with_its_exception():
    """The exception a job raised is kept as itself: a write drained because its attempt was
    aborted (NotWritten) is told apart from a failed write (the error used to travel as a
    string, so the intake's isinstance check for NotWritten could never hold)."""
    completions = Completions()
    workers = WorkerPools(2, completions)
    try:
        workers.write("job-a", lambda: "written")
        workers.write("job-b", _raise(NotWritten("aborted before its write started")))
        workers.commit(7, "0123456789ab-1", lambda: "outcome")
        workers.cleanup(7, "0123456789ab-1", _raise(OSError(5, "I/O error")))
        done = _wait_for(completions, 4)
    finally:
        assert workers.shutdown(timeout_s=30)
        completions.close()
    writes = {d.job: d for d in done if isinstance(d, WriteFinished)}
    assert writes["job-a"].result == "written" and writes["job-a"].error is None and writes["job-a"].reason == ""
    assert isinstance(writes["job-b"].error, NotWritten)
    assert writes["job-b"].reason == "NotWritten: aborted before its write started"
    (commit,) = [d for d in done if isinstance(d, CommitFinished)]
    assert (commit.step, commit.attempt, commit.result, commit.error) == (7, "0123456789ab-1", "outcome", None)
    (cleanup,) = [d for d in done if isinstance(d, CleanupFinished)]
    assert isinstance(cleanup.error, OSError) and cleanup.reason == "OSError: [Errno 5] I/O error"
    assert workers.in_flight == 4  # the loop calls finished() per completion it handles


@pytest.mark.timeout(30)  # before: blocked for good
def test_wake_ups_never_block_once_the_pipe_is_full():
    """A signal handler's wake-up into a full pipe blocked the main thread inside the handler, which
    only the main thread's own loop would have drained."""
    completions = Completions()
    try:
        for _ in range(100_000):  # far more than a pipe holds (64 KiB)
            completions.post_signal()
        assert completions.signalled()
        completions.post(CleanupFinished(step=1, attempt="a"))
        assert [type(c) for c in completions.drain()] == [CleanupFinished]
    finally:
        completions.close()


def test_a_signal_after_close_writes_into_no_descriptor():
    """The daemon's SIGTERM handler wakes the loop through the pipe; one arriving during the last
    clean-up, after close(), wrote into whatever file had reused the descriptor number."""
    completions = Completions()
    write_end = completions._w
    completions.close()
    r, w = os.pipe()  # takes the numbers the pipe had
    try:
        assert write_end in (r, w)
        completions.post_signal()
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)  # nothing was written into the new pipe
        completions.close()  # twice: harmless
    finally:
        os.close(r)
        os.close(w)
