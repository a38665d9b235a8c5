"""No message makes the coordinator commit a checkpoint that does not load.

- A rank's data file that vanished or was truncated after its node reported it written (here: a
  slow disk, made so by the daemon's fault file, keeps the commit open long enough to cut the file
  under it) aborts the step with a reason naming rank and file; the previous checkpoint stays
  latest and loads.
- Within an authenticated session (a real CurveZMQ DEALER with the job's keys), a repeated
  WRITTEN is never counted twice, nor for another attempt; a report about a decided attempt only
  gets that attempt's outcome back; a report addressed to another coordinator instance (one sent
  to a predecessor, reaching a restarted coordinator) is dropped and counted.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import zmq

import ckptd
from ckptd.control.codec import Codec
from ckptd.control.endpoints import load_token
from ckptd.control.keys import derive_keys
from ckptd.control.protocol import Failed, StepAborted, StepCommitted, Written
from ckptd.control.security import make_client_secure
from ckptd.format.records import TENSOR, ItemRecord
from ckptd.format.rootlayout import step_dir_name
from tests.fault.single_job import (
    loads_bit_exact,
    single_job,
    state_dict,
    tmp_leftovers,
)
from tools.harness.waiting import wait_until


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp, single_job(tmp_path_factory.mktemp("integrity"), mp) as j:
        j.committed(1)
        yield j


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_data_file_damaged_after_it_was_reported_aborts_the_commit(job, damage):
    step = 2 if damage == "truncated" else 3
    previous = job.ckpt.latest()
    job.fault("delay 1")  # every file the daemon writes takes a second more: the commit stays open
    try:
        h = job.ckpt.save(state_dict(step), step=step)

        def data_file():
            return next(iter(job.root.glob(f"{step_dir_name(step)}.*tmp/__0_0.distcp")), None)

        wait_until(lambda: data_file() is not None, 20, "the rank's data file to be written")
        data = data_file()
        if damage == "truncated":
            os.truncate(data, data.stat().st_size // 2)
        else:
            data.unlink()
        with pytest.raises(ckptd.SaveFailedError) as err:
            h.wait(timeout_s=30)
    finally:
        job.fault("")
    why = "has" if damage == "truncated" else "is missing"
    assert "rank 0's data file" in str(err.value) and "__0_0.distcp" in str(err.value) and why in str(err.value), (
        err.value
    )
    assert not (job.root / step_dir_name(step)).exists()
    assert job.ckpt.latest() == previous
    loads_bit_exact(job.ckpt, previous)
    wait_until(lambda: not tmp_leftovers(job.root), 10, "the aborted attempt's files to be removed")
    job.committed(step)  # the same step, undamaged


class NodePeer:
    """An authenticated DEALER to the coordinator, as a node daemon of the job would hold; it
    addresses its reports to the coordinator instance the job's node daemon knows (it says no
    PING: the coordinator would then announce every outcome to it, not just answer its reports)."""

    def __init__(self, job) -> None:
        ep = job.ckpt.endpoints
        self.codec = Codec(ep.job)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        make_client_secure(self.sock, derive_keys(load_token(ep, job.config)))
        self.sock.connect(job.ckpt.status()["coordinator"]["address"])
        self.instance = job.ckpt.status()["upstream"]["instance"]

    def send(self, msg, to: str | None = None) -> None:
        """Send ``msg``; a report addressed to coordinator instance ``to`` (the one answering if None)."""
        if isinstance(msg, (Written, Failed)):
            msg = replace(msg, coordinator_instance=self.instance if to is None else to)
        self.sock.send_multipart(self.codec.encode(msg))

    def replies(self, n: int, timeout_s: float = 10.0) -> list:
        out = []
        while len(out) < n and self.sock.poll(int(timeout_s * 1000)):
            out.append(self.codec.decode(self.sock.recv_multipart()))
        return out

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _written(step: int, attempt: str, rank: int, world: int) -> Written:
    rec = ItemRecord(
        fqn="w",
        kind=TENSOR,
        rank=rank,
        dtype="float32",
        global_shape=(2, 4),
        offsets=(rank, 0),
        sizes=(1, 4),
        relative_path=f"__{rank}_0.distcp",
        file_offset=0,
        length=16,
    )
    return Written(
        step=step,
        attempt=attempt,
        rank=rank,
        world_size=world,
        node=7,
        records=[rec],
        common=None,
        common_digest="",
        file_nbytes=16,
    )


def _collecting(job) -> dict:
    return job.ckpt.status()["coordinator"]["steps"]


@pytest.mark.timeout(60)
def test_a_repeated_written_is_never_counted_twice_nor_for_another_attempt(job):
    peer = NodePeer(job)
    a, b = "aaaaaaaaaaaa-1", "bbbbbbbbbbbb-1"
    try:
        before = job.ckpt.status()["coordinator"]["rejected"]["duplicate"]
        peer.send(_written(50, a, 0, 2))
        peer.send(_written(50, a, 0, 2))  # the same report again, in the same session
        wait_until(
            lambda: job.ckpt.status()["coordinator"]["rejected"]["duplicate"] == before + 1,
            10,
            "the repeated WRITTEN to be ignored",
        )
        assert _collecting(job)[f"50/{a}"]["written"] == [0]  # counted once: still waiting for rank 1
        # Rank 1 reporting another attempt of step 50: the ranks disagree, both attempts abort, and
        # rank 0's report of attempt a was not counted for attempt b.
        peer.send(_written(50, b, 1, 2))
        outcomes = {m.attempt: m for m in peer.replies(2)}
        assert set(outcomes) == {a, b} and all(isinstance(m, StepAborted) for m in outcomes.values())
        reason = outcomes[a].reason
        assert (
            "ranks disagree on the save attempt" in reason
            and a in reason
            and b in reason
            and "ranks [0]" in reason
            and "rank 1 (node 7)" in reason
        ), reason
        # Replayed once more, the report is answered with its attempt's outcome, and nothing starts.
        peer.send(_written(50, a, 0, 2))
        (again,) = peer.replies(1)
        assert isinstance(again, StepAborted) and again.attempt == a and again.reason == reason
        assert not _collecting(job)
        # A report of the committed step's real attempt gets COMMITTED back and changes nothing.
        h = job.ckpt.save(state_dict(4), step=4)
        h.wait(timeout_s=30)
        peer.send(
            Written(
                step=4,
                attempt=h.attempt,
                rank=0,
                world_size=1,
                node=7,
                records=[],
                common=None,
                common_digest="",
                file_nbytes=0,
            )
        )
        (done,) = peer.replies(1)
        assert isinstance(done, StepCommitted) and done.attempt == h.attempt and done.name == "iter_0000004"
        assert not _collecting(job) and job.ckpt.latest() == 4
        loads_bit_exact(job.ckpt, 4)
    finally:
        peer.close()
    job.committed(5)


@pytest.mark.timeout(60)
def test_a_report_addressed_to_another_coordinator_instance_is_dropped_and_counted(job):
    """The coordinator's shell drops a report its state machine refuses (see test_commit_state)
    before asking the root anything, and counts it in the status of its port."""
    peer = NodePeer(job)
    attempt = "cccccccccccc-1"
    try:
        before = job.ckpt.status()["coordinator"]["rejected"]
        peer.send(_written(60, attempt, 0, 2), to="a-restarted-coordinator's-predecessor")
        peer.send(_written(60, attempt, 1, 2), to="")
        wait_until(
            lambda: job.ckpt.status()["coordinator"]["rejected"]["misaddressed"] == before["misaddressed"] + 2,
            10,
            "the two misaddressed reports to be dropped",
        )
        assert not _collecting(job) and peer.replies(1, timeout_s=0.2) == []
        peer.send(_written(60, attempt, 0, 2))  # to this coordinator: collected
        wait_until(lambda: f"60/{attempt}" in _collecting(job), 10, "the report to be collected")
        peer.send(Failed(step=60, attempt=attempt, rank=-1, world_size=0, node=7, reason="test over"))
        (aborted,) = peer.replies(1)
        assert isinstance(aborted, StepAborted) and aborted.attempt == attempt and not _collecting(job)
    finally:
        peer.close()
