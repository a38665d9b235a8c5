"""A node daemon's decisions on the saves it took (ckptd.daemon.intakestate), event by event with an
injected clock: no sockets, no threads. The process versions of the same rules:
tests/fault/test_attempts.py (a save of an aborted attempt is drained, a late write reported
FAILED) and tests/fault/test_hung_disk.py (a write that hangs is reported at the commit timeout)."""

from __future__ import annotations

import pytest

from ckptd.config import CkptdConfig
from ckptd.control.protocol import Failed, StepAborted, StepCommitted, Written
from ckptd.daemon.intakestate import (
    Action,
    Ended,
    IntakeState,
    NotWritten,
    Ready,
    Report,
    StartWrite,
    Taken,
    TellRank,
    Tick,
    WriteJob,
    WriteResult,
)
from ckptd.daemon.uplinkstate import Expect, UplinkState, Verdict
from ckptd.daemon.workers import WriteRequest
from ckptd.format.records import ItemRecord
from ckptd.staging.ring import Placement

A = "0123456789ab-1"
CFG = CkptdConfig(commit_timeout_s=10, coordinator_timeout_s=5, heartbeat_s=1)
RECORD = ItemRecord(fqn="w", kind="tensor", rank=1, dtype="float32", global_shape=(4,), offsets=(0,), sizes=(4,))


def job(step: int = 3, block: int = 0) -> WriteJob:
    request = WriteRequest(
        step=step, rank=1, records=[RECORD], placements=[Placement(0, 16)], common=None, ring_start=0
    )
    return WriteJob(
        request=request, attempt=A, world_size=2, generation="g1", block=block, identity=b"rank1", common_digest="d"
    )


class Node:
    """The intake's state with the uplink state it reads, at an injected time."""

    def __init__(self) -> None:
        self.now = 100.0
        self.uplink = UplinkState(CFG, address="tcp://node0:29500", node=0, link_timeout_s=4.0, now=self.now)
        self.state = IntakeState(
            CFG, self.uplink, node=0, data_file=lambda s, a, r: f"/ckpt/{s}.{a}.tmp/__{r}_0.distcp"
        )

    def take(self, j: WriteJob) -> list[Action]:
        """What the intake does with a checked SAVE: the uplink expects the verdict for its rank."""
        out = self.state.handle(Taken(job=j), self.now)
        self.uplink.handle(Expect(key=j.key, identity=j.identity), self.now)
        return out

    def handle(self, event: Taken | Ready | Ended | Tick) -> list[Action]:
        return self.state.handle(event, self.now)

    def decide(self, j: WriteJob, outcome: StepAborted | StepCommitted) -> None:
        self.uplink.handle(Verdict(key=j.key, outcome=outcome), self.now)


def aborted(j: WriteJob) -> StepAborted:
    return StepAborted(step=j.request.step, attempt=j.attempt, reason="rank 0 skipped it")


def report(actions: list[Action]) -> Written | Failed:
    (msg,) = [a.msg for a in actions if isinstance(a, Report)]
    return msg


@pytest.mark.parametrize("decided, drain", [(None, False), ("aborted", True)])
def test_a_write_starts_when_its_ring_is_ready_unless_its_attempt_was_aborted_meanwhile(decided, drain):
    node, j = Node(), job()
    assert node.take(j) == []
    if decided:
        node.decide(j, aborted(j))
    assert node.handle(Ready(job=j)) == [StartWrite(job=j, drain=drain)]


def test_a_finished_write_frees_the_block_then_reports_written_with_its_stored_records():
    node, j = Node(), job()
    node.take(j)
    result = WriteResult(stored=[RECORD], file_nbytes=4096, queue_s=0.1, write_s=0.5, snapshot_s=0.2, disk_seq=53)
    actions = node.handle(Ended(job=j, result=result))
    assert actions[0] == TellRank(job=j, result=result)
    msg = report(actions)
    assert isinstance(msg, Written) and msg.records == [RECORD] and msg.file_nbytes == 4096
    assert msg.disk_seq == 53  # the node's disk's highest commit number (node-local roots)
    assert (msg.step, msg.attempt, msg.rank, msg.world_size, msg.common_digest) == (3, A, 1, 2, "d")
    assert node.handle(Tick()) == [] and not node.state.unfinished


def test_a_write_that_ends_after_its_attempt_was_decided_is_reported_failed_as_a_late_write():
    node, j = Node(), job()
    node.take(j)
    node.decide(j, aborted(j))
    actions = node.handle(Ended(job=j, result=WriteResult(stored=[RECORD], file_nbytes=4096)))
    msg = report(actions)
    assert isinstance(msg, Failed) and "written after the attempt had been decided (late write)" in msg.reason
    assert isinstance(actions[0], TellRank)


def test_a_failed_write_tells_the_rank_and_reports_why():
    node, j = Node(), job()
    node.take(j)
    actions = node.handle(Ended(job=j, error=OSError(28, "No space left"), reason="OSError: No space left"))
    assert actions[0] == TellRank(job=j, result=WriteResult())
    msg = report(actions)
    assert isinstance(msg, Failed) and msg.reason == "writing its data file failed: OSError: No space left"


def test_a_drained_save_only_frees_its_block():
    node, j = Node(), job()
    node.take(j)
    node.decide(j, aborted(j))
    error = NotWritten("nothing written")
    assert node.handle(Ended(job=j, error=error, reason="NotWritten: nothing written")) == [
        TellRank(job=j, result=WriteResult())
    ]


def test_a_write_not_finished_within_the_commit_timeout_is_reported_failed_once_naming_its_file():
    node, j = Node(), job()
    node.take(j)
    node.now += CFG.commit_timeout_s  # not yet: the bound is inclusive
    assert node.handle(Tick()) == []
    node.now += 0.5
    msg = report(node.handle(Tick()))
    assert (
        isinstance(msg, Failed) and "/ckpt/3.0123456789ab-1.tmp/__1_0.distcp was not written within 10 s" in msg.reason
    )
    node.now += 60
    assert node.handle(Tick()) == []  # once
    # the hung write ends at last: the rank gets its block back, and the coordinator the report
    assert isinstance(node.handle(Ended(job=j, result=WriteResult()))[0], TellRank)


def test_an_overdue_write_of_an_attempt_decided_meanwhile_is_not_reported():
    node, j, other = Node(), job(block=0), job(step=4, block=1)
    node.take(j)
    node.now += 4
    node.take(other)
    node.decide(j, aborted(j))  # another rank failed step 3
    node.now += CFG.commit_timeout_s - 2  # step 3's write is overdue, step 4's not yet
    assert node.handle(Tick()) == [] and list(node.state.unfinished) == [("g1", 1)]
    node.now += 3
    assert report(node.handle(Tick())).step == 4


def test_a_save_is_in_use_from_taken_until_its_verdict():
    """A second SAVE of a rank under the same attempt id (two Checkpointers of one launch with a
    fixed CKPTD_RUN_ID) is refused while the first is being written, and after it was reported
    until its verdict: it would write the same data file and be answered by the same verdict."""
    from ckptd.daemon.uplinkstate import Report as Reported

    node, j = Node(), job()
    assert not node.state.in_use(1, j.key)
    node.take(j)
    node.handle(Ready(job=j))
    assert node.state.in_use(1, j.key) and not node.state.in_use(0, j.key)
    msg = report(node.handle(Ended(job=j, result=WriteResult(stored=[RECORD], file_nbytes=64))))
    node.uplink.handle(Reported(key=j.key, msg=msg), node.now)
    assert node.state.in_use(1, j.key)  # written and reported: awaiting the verdict
    node.decide(j, StepCommitted(step=j.request.step, attempt=j.attempt, name="iter_0000003", warnings=[]))
    assert not node.state.in_use(1, j.key)


def test_in_flight_names_each_undecided_attempt_with_the_ranks_writing_written_and_failed():
    """What a relaunch's resume settles (ckptd.client.settle): each attempt this node holds no
    verdict for, rank by rank, and whether a rank that saved it is still connected, until its
    verdict arrives."""
    from ckptd.control.protocol import AttemptInFlight
    from ckptd.daemon.uplinkstate import Report as Reported

    node, j = Node(), job()
    other = WriteJob(
        **{**j.__dict__, "request": WriteRequest(**{**j.request.__dict__, "rank": 0}), "block": 1, "identity": b"rank0"}
    )
    connected = {b"rank0"}

    def state() -> list[AttemptInFlight]:
        return node.state.in_flight(lambda identity: identity in connected)

    def attempt(writing=(), written=(), failed=(), live=True) -> list[AttemptInFlight]:
        return [
            AttemptInFlight(step=3, attempt=A, world_size=2, writing=writing, written=written, failed=failed, live=live)
        ]

    assert state() == []
    node.take(j)
    node.take(other)
    assert state() == attempt(writing=(0, 1))
    msg = report(node.handle(Ended(job=j, result=WriteResult(stored=[RECORD], file_nbytes=64))))
    node.uplink.handle(Reported(key=j.key, msg=msg), node.now)
    assert state() == attempt(writing=(0,), written=(1,))
    connected.clear()  # both ranks' processes are gone: their launch no longer runs
    assert state() == attempt(writing=(0,), written=(1,), live=False)
    failed = report(node.handle(Ended(job=other, error=OSError(5, "EIO"), reason="OSError: EIO")))
    node.uplink.handle(Reported(key=other.key, msg=failed), node.now)
    assert state() == attempt(written=(1,), failed=(0,), live=False)
    node.decide(j, aborted(j))
    assert state() == []


def test_a_write_of_an_attempt_decided_already_is_not_in_flight():
    node, j = Node(), job()
    node.take(j)
    node.decide(j, StepCommitted(step=3, attempt=A, name="iter_0000003", warnings=[]))
    assert j.slot in node.state.unfinished and node.state.in_flight(lambda _: True) == []


def test_an_abandoned_attempt_is_asked_of_the_coordinator_whose_verdict_decides_its_parts():
    """A relaunch's resume found attempt A unable to commit (ckptd.client.settle): the node tells
    the coordinator, with the ranks found, in a FAILED of the node (rank -1); its own parts stay
    until the verdict (the coordinator keeps an attempt a dead node daemon reported the rest of)."""
    from ckptd.daemon.uplinkstate import Abandon, Pong
    from ckptd.daemon.uplinkstate import Send as Upstream
    from ckptd.daemon.uplinkstate import Tick as UplinkTick

    node, j = Node(), job()
    node.uplink.handle(Pong(instance="c1"), node.now)
    node.take(j)
    assert node.uplink.handle(Abandon(key=j.key, reason="its launch is gone", handed_off=(1,)), node.now) == []
    node.now += 1
    sent = [a.msg for a in node.uplink.handle(UplinkTick(), node.now) if isinstance(a, Upstream)]
    told = [m for m in sent if isinstance(m, Failed)]
    assert [(m.rank, m.attempt, m.handed_off) for m in told] == [(-1, A, [1])], sent
    assert [a.writing for a in node.state.in_flight(lambda _: False)] == [(1,)]  # undecided yet
    node.decide(j, aborted(j))
    assert node.handle(Ready(job=j)) == [StartWrite(job=j, drain=True)]
    assert node.state.in_flight(lambda _: False) == []
    assert node.uplink.handle(Abandon(key=j.key, reason="again", handed_off=(1,)), node.now) == []  # decided


def test_an_abandon_the_coordinator_decided_is_never_told_to_a_later_instance():
    """Kept, then committed: a later coordinator instance never told of it would take the commit
    for an attempt it never saw and abort it on every node."""
    from ckptd.daemon.uplinkstate import Abandon, Pong
    from ckptd.daemon.uplinkstate import Send as Upstream
    from ckptd.daemon.uplinkstate import Tick as UplinkTick

    node, j = Node(), job()
    node.uplink.handle(Pong(instance="c1"), node.now)
    node.take(j)
    node.uplink.handle(Abandon(key=j.key, reason="its launch is gone", handed_off=(1,)), node.now)
    node.uplink.handle(UplinkTick(), node.now + 1)
    node.decide(j, StepCommitted(step=3, attempt=A, name="iter_0000003", warnings=[]))
    node.uplink.handle(Pong(instance="c2"), node.now + 2)  # the coordinator restarted
    sent = [a.msg for a in node.uplink.handle(UplinkTick(), node.now + 3) if isinstance(a, Upstream)]
    assert not [m for m in sent if isinstance(m, Failed)], sent
    assert j.key not in node.uplink.unacked


def test_a_written_too_large_for_a_message_is_reported_as_a_failure_saying_so():
    """A WRITTEN over the message limit (a layout's many records, rank 0's common state) could not
    be sent, ever: the node kept resending it, and its write's ring block stayed held."""
    from ckptd.control.codec import Codec
    from ckptd.daemon.intake import sendable

    records = [ItemRecord(fqn=f"layer.{i}.weight", kind="tensor", rank=1, dtype="float32") for i in range(200)]
    big = Written(
        step=5,
        attempt="0123456789ab-1",
        rank=1,
        world_size=2,
        node=0,
        records=records,
        common=None,
        common_digest="",
        file_nbytes=0,
    )
    small = Codec("job", max_nbytes=4096)
    failed = sendable(big, small)
    assert isinstance(failed, Failed) and (failed.step, failed.attempt, failed.rank) == (5, "0123456789ab-1", 1)
    assert "rank 1's report of its 200 items cannot be sent" in failed.reason and "exceeds the limit" in failed.reason
    # The keys a rank holds without storing them count too (a rank of replicas: no record at all).
    held = Written(
        step=5,
        attempt="0123456789ab-1",
        rank=1,
        world_size=2,
        node=0,
        records=[],
        common=None,
        common_digest="",
        file_nbytes=0,
        held=[f"model.layer.{i}.weight" for i in range(400)],
    )
    assert isinstance(sendable(held, small), Failed)
    assert sendable(big, Codec("job")) is big


@pytest.mark.parametrize("digests", [("", ""), ("d" * 300, "𝄞" * 300)], ids=["no digests", "long digests"])
def test_a_written_judged_sendable_fits_the_limit_as_sent_to_the_coordinator(digests):
    """The judgement left out what the sent WRITTEN carries besides: the coordinator instance the
    node's link addresses it to, and the rank's digests. A report within a few bytes of the limit
    passed, and every send of it failed (raising out of the link's batch of sends, and out of the
    node daemon's socket handler). Every size around the limit is judged as sent."""
    from dataclasses import replace

    from ckptd.control.codec import Codec
    from ckptd.control.protocol import MAX_INSTANCE_NBYTES
    from ckptd.daemon.intake import sendable
    from ckptd.errors import ProtocolError

    codec = Codec("job" * 5, max_nbytes=64 << 10)
    common_digest, plain_digest = digests

    def written(common_nbytes: int) -> Written:
        return Written(
            step=5,
            attempt=A,
            rank=0,
            world_size=2,
            node=0,
            records=[RECORD],
            common=b"c" * common_nbytes,
            common_digest=common_digest,
            plain_digest=plain_digest,
            file_nbytes=16,
        )

    def nbytes(msg: Written) -> int:
        return len(Codec(codec.job).encode(msg)[0])

    at_limit = codec.max_nbytes - nbytes(written(0))  # the unaddressed WRITTEN is exactly at the limit
    kinds = set()
    for common_nbytes in range(at_limit - 2 * MAX_INSTANCE_NBYTES, at_limit + 3):
        msg = written(common_nbytes)
        judged = sendable(msg, codec)
        addressed = replace(judged, coordinator_instance="9" * MAX_INSTANCE_NBYTES)  # the longest a PONG names
        try:
            codec.encode(addressed)
        except ProtocolError as exc:
            raise AssertionError(f"{nbytes(msg)} bytes unaddressed: judged sendable, but as sent: {exc}") from None
        kinds.add(type(judged))
    assert kinds == {Written, Failed}
    # A rank's digest alone can take it over the limit (its SAVE was within it).
    assert isinstance(sendable(replace(written(0), plain_digest="𝄞" * (16 << 10)), codec), Failed)


def test_the_size_bound_of_a_report_holds_for_any_record():
    """The estimate that spares encoding a WRITTEN twice counted a record's ints and characters
    too low (many-dimensional shapes of large sizes, names beyond ASCII): a report over the limit
    passed it, every send of it failed, and the attempt waited for the coordinator's timeout."""
    import msgspec

    from ckptd.daemon.intake import _record_nbytes_bound

    records = [
        ItemRecord(
            fqn="é" * 40,
            kind="tensor",
            rank=3,
            dtype="bfloat16",
            global_shape=(1 << 40,) * 10,
            offsets=(1 << 39,) * 10,
            sizes=(1 << 39,) * 10,
            relative_path="__3_0.distcp",
            file_offset=1 << 50,
            length=1 << 50,
            crc=0xFFFFFFFF,
            block_crcs=b"\xff" * 64,
            path=("model", "层" * 20, 1 << 40),
        ),
        ItemRecord(fqn="x", kind="bytes", rank=0),
    ]
    for r in records:
        assert len(msgspec.msgpack.encode(r)) <= _record_nbytes_bound(r)


def test_the_daemon_answers_a_save_before_its_write_starts():
    """The write was queued before the SAVE_ACK went out: the writer thread it starts took the
    interpreter from the daemon's loop while the rank waited in save() for the answer (1-3 ms
    of a lazy save's 5 ms stall). The write starts after the answer, also when sending it fails."""
    import os
    from types import SimpleNamespace

    from ckptd.control.protocol import Save, SaveAck
    from ckptd.daemon.ranks import Client, RankServer

    events: list[str] = []

    class Channel:
        fail = False

        def send(self, msg: object, identity: bytes, block: bool = True) -> None:
            events.append(type(msg).__name__)
            if self.fail:
                raise OSError("the rank's connection went away")

    server = RankServer.__new__(RankServer)
    server.clients = {b"r0": Client(rank=0, pid=os.getpid(), start_ticks=0)}
    server.saving = set()
    server.channel = Channel()  # type: ignore[assignment]
    server.hooks = SimpleNamespace(stopping=lambda: None)  # type: ignore[assignment]
    server.uplink = SimpleNamespace(verdict=lambda key: None)  # type: ignore[assignment]
    server.intake = SimpleNamespace(take=lambda *a: lambda: events.append("write queued"))  # type: ignore[assignment]
    save = Save(
        step=10,
        attempt="0123456789ab-1",
        rank=0,
        world_size=1,
        generation="g1",
        block=0,
        items=[],
        common=None,
        common_digest="",
        layout="",
        ring_start=0,
        snapshot_pid=os.getpid(),
        seal=b"s" * 16,
        seal_offset=0,
        plain_digest="",
        held=[],
        went_back_to=-1,
        went_back_unix_s=0.0,
    )
    server._on_writer_request(b"r0", save)
    assert events == [SaveAck.__name__, "write queued"]
    events.clear()
    server.channel.fail = True  # type: ignore[attr-defined]
    with pytest.raises(OSError):
        server._on_writer_request(b"r0", save)
    assert events == [SaveAck.__name__, "write queued"]  # taken: written whether or not the rank heard
