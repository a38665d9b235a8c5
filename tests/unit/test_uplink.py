"""A node daemon's link to the coordinator (ckptd.daemon.uplink), against a real coordinator in
this process: real CurveZMQ sockets on loopback, real reports and verdicts, no daemon process.
The wiring of the shells; the decisions alone, event by event: test_uplink_state.py and
test_commit_state.py."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq

from ckptd.config import CkptdConfig
from ckptd.control.codec import Codec
from ckptd.control.keys import derive_keys
from ckptd.control.protocol import Failed, Message, StepAborted, StepCommitted, Written
from ckptd.control.security import ZapHandler
from ckptd.daemon.coordinator import Coordinator
from ckptd.daemon.guard import InternalErrors
from ckptd.daemon.loop import EventLoop
from ckptd.daemon.uplink import CoordinatorLink
from ckptd.daemon.workers import Completions, WorkerPools
from ckptd.format.layout import data_file_name
from ckptd.format.rootlayout import tmp_dir_name
from ckptd.roots.posix_root import PosixRoot

ATTEMPT = "0123456789ab-1"


def _router(completions: Completions, workers: WorkerPools, coordinator: Coordinator) -> Any:
    """The node daemon's routing of finished worker jobs to the coordinator (ckptd.daemon.node)."""

    def route() -> None:
        for done in completions.drain():
            workers.finished()
            coordinator.on_done(done)

    return route


@pytest.mark.timeout(60)
def test_a_verdict_lost_while_the_coordinator_stays_reachable_is_chased(tmp_path: Path):
    """The coordinator answers every ping, but its verdict on a step never arrives (lost in a
    connection replaced meanwhile): the node resends the step's reports once the coordinator
    must have decided (commit timeout + coordinator timeout after the first report) and gets
    the verdict again, instead of waiting for ever. The wiring only: when the chase happens is
    test_uplink_state's (a loaded machine may also resend after a late pong, which is as good)."""
    cfg = CkptdConfig(commit_timeout_s=0.4, coordinator_timeout_s=0.4, heartbeat_s=0.05)
    with _node_and_coordinator(tmp_path, cfg) as (link, delivered, spin, coordinator):
        dropped: list[Message] = []
        send = coordinator.channel.send

        def lose_the_first_verdict(msg: Message, identity: bytes | None = None, block: bool = True) -> bool:
            if isinstance(msg, StepAborted) and not dropped:
                dropped.append(msg)
                return True
            return send(msg, identity, block)

        coordinator.channel.send = lose_the_first_verdict  # type: ignore[method-assign]
        link.expect((3, ATTEMPT), b"rank0")
        link.report(
            Failed(step=3, attempt=ATTEMPT, rank=0, world_size=1, node=0, reason="the disk is full"), (3, ATTEMPT)
        )
        spin(lambda: delivered)
        assert dropped and len(delivered) == 1, (dropped, delivered)
        assert isinstance(delivered[0], StepAborted) and "the disk is full" in delivered[0].reason
        assert not link.state.unacked and not link.busy


@contextmanager
def _node_and_coordinator(
    tmp_path: Path, cfg: CkptdConfig, *, coordinator_codec: Codec | None = None, link_codec: Codec | None = None
) -> Iterator[tuple[CoordinatorLink, list[Message], Any, Coordinator]]:
    """A node's link to a coordinator in this process; yields the link, the verdicts it delivered,
    ``spin(until)``, which runs both until ``until()`` holds (20 s at most), and the coordinator
    (the coordinator's messages go through ``coordinator_codec``, the link's through
    ``link_codec``, where given)."""
    keys = derive_keys(secrets.token_bytes(32))
    codec = Codec("job1")
    ctx = zmq.Context()
    zap = ZapHandler(ctx, keys)
    completions = Completions()
    workers = WorkerPools(1, completions)
    coordinator = Coordinator(
        ctx,
        coordinator_codec or codec,
        keys,
        "tcp://127.0.0.1:0",
        PosixRoot(tmp_path),
        cfg,
        workers,
        "c1",
        [],
        internal=InternalErrors(),
    )
    delivered: list[Message] = []
    link = CoordinatorLink(
        ctx,
        link_codec or codec,
        keys,
        coordinator.address,
        0,
        b"node0-test",
        cfg,
        lambda _k, _r, outcome: delivered.append(outcome),
        store=coordinator.store,
        workers=workers,
        internal=InternalErrors(),
    )
    loop = EventLoop()
    for source, handler in (
        (zap.sock, zap.on_readable),
        (coordinator.watch.sock, coordinator.watch.on_readable),
        (coordinator.channel.sock, coordinator.on_readable),
        (link.channel.sock, link.on_readable),
        (completions.fd, _router(completions, workers, coordinator)),
    ):
        loop.add(source, handler)

    def spin(until: Any) -> None:
        t0 = time.monotonic()
        while not until() and time.monotonic() - t0 < 20:
            loop.poll(20)
            now = time.monotonic()
            coordinator.tick(now)
            link.tick(now)

    try:
        yield link, delivered, spin, coordinator
    finally:
        link.close()
        coordinator.close()
        zap.close()
        assert workers.shutdown(timeout_s=30)
        completions.close()
        ctx.term()


@pytest.mark.timeout(60)
def test_a_policy_skip_is_announced_as_a_skip_and_remembered_for_late_saves(tmp_path: Path):
    """Rank 1 skips step 5 (on_full="skip"): the coordinator aborts the attempt at once with
    skipped set, so the ranks resolve it as SKIPPED, not as a failure; a failure is not a skip.
    The node remembers the verdict: a rank whose SAVE of that attempt comes later is not waited
    for (the daemon tells it at once and writes nothing)."""
    cfg = CkptdConfig(commit_timeout_s=30, coordinator_timeout_s=30, heartbeat_s=0.05)
    with _node_and_coordinator(tmp_path, cfg) as (link, delivered, spin, _):
        link.expect((5, ATTEMPT), b"rank0")
        link.report(
            Failed(
                step=5,
                attempt=ATTEMPT,
                rank=1,
                world_size=2,
                node=0,
                reason="skipped the save: ring busy",
                skipped=True,
            ),
            (5, ATTEMPT),
        )
        link.report(
            Failed(step=6, attempt=ATTEMPT, rank=1, world_size=2, node=0, reason="writing its data file failed: EIO"),
            (6, ATTEMPT),
        )
        spin(lambda: len(delivered) == 2)
        by_step = {m.step: m for m in delivered if isinstance(m, StepAborted)}
        assert by_step[5].skipped and "rank 1 (node 0): skipped the save" in by_step[5].reason
        assert not by_step[6].skipped
        link.expect((5, ATTEMPT), b"rank0-late")
        assert not link.expects((5, ATTEMPT), b"rank0-late") and link.verdict((5, ATTEMPT)) == by_step[5]
        assert link.verdict((7, ATTEMPT)) is None and not link.busy


@pytest.mark.timeout(60)
def test_a_root_that_does_not_answer_the_coordinators_question_delays_a_verdict_only_so_long(tmp_path: Path):
    """A new attempt's first report waits for the root's answer (is the step committed already?).
    A root that hangs (a hard-mounted NFS) held that report, and every later one of the attempt,
    FAILED ones included, for as long as it hung: no step aborted. The coordinator decides
    without the answer after coordinator_timeout_s, and ignores the answer that comes late."""
    import threading

    # 2 s: a loaded machine that starves this process a moment must not make the node take the
    # coordinator for lost (its own verdict would arrive instead).
    cfg = CkptdConfig(commit_timeout_s=30, coordinator_timeout_s=2.0, heartbeat_s=0.05)
    with _node_and_coordinator(tmp_path, cfg) as (link, delivered, spin, coordinator):
        release = threading.Event()
        asked: list[int] = []

        def hangs(step: int, went_back: object = None) -> bool:
            asked.append(step)
            release.wait(20)
            return False

        coordinator.store.committed_once = hangs  # type: ignore[method-assign]
        try:
            link.expect((3, ATTEMPT), b"rank0")
            link.report(
                Failed(step=3, attempt=ATTEMPT, rank=0, world_size=2, node=0, reason="the disk is full"), (3, ATTEMPT)
            )
            spin(lambda: delivered)
            assert asked == [3] and len(delivered) == 1, (asked, delivered)
            assert isinstance(delivered[0], StepAborted) and "the disk is full" in delivered[0].reason
        finally:
            release.set()
        spin(lambda: not coordinator.late)  # the late answer came and was dropped
        assert not coordinator.asking and not coordinator.asked and len(delivered) == 1


@pytest.mark.timeout(60)
def test_a_send_that_fails_costs_the_coordinator_no_other_action(tmp_path: Path):
    """Step 7 collects, step 8 is written and waits for it; then a report of another attempt of
    step 7 aborts both of step 7, whose verdict cannot be sent (here: it is larger than this
    coordinator's message limit). The actions ran in one loop that stopped at the failed send:
    step 8's Commit after it was lost, and step 8 stayed committing for ever. Each action now
    runs on its own: the failure is counted as an internal error, and step 8 commits."""
    other = ATTEMPT[:-1] + "2"
    cfg = CkptdConfig(commit_timeout_s=30, coordinator_timeout_s=30, heartbeat_s=0.05)
    # Reports fit (a WRITTEN of no items is 224 bytes); the verdict saying why ranks disagree (440) does not.
    small = Codec("job1", max_nbytes=400)
    with _node_and_coordinator(tmp_path, cfg, coordinator_codec=small) as (link, delivered, spin, coordinator):
        for step in (7, 8):
            (tmp_path / tmp_dir_name(step, ATTEMPT)).mkdir()
            for rank in (0, 1):
                (tmp_path / tmp_dir_name(step, ATTEMPT) / data_file_name(rank)).write_bytes(b"")

        def written(step: int, rank: int, attempt: str = ATTEMPT) -> Written:
            return Written(
                step=step,
                attempt=attempt,
                rank=rank,
                world_size=2,
                node=0,
                records=[],
                common=None,
                common_digest="",
                file_nbytes=0,
            )

        link.expect((7, ATTEMPT), b"rank0")
        link.report(written(7, 0), (7, ATTEMPT))
        spin(lambda: coordinator.status()["steps"])
        link.expect((8, ATTEMPT), b"rank0")
        link.report(written(8, 0), (8, ATTEMPT))
        link.report(written(8, 1), (8, ATTEMPT))
        spin(lambda: coordinator.status()["steps"].get(f"8/{ATTEMPT}", {}).get("phase") == "ready")
        link.report(written(7, 1, attempt=other), (7, other))
        spin(lambda: any(isinstance(m, StepCommitted) for m in delivered))
        assert [(m.step, type(m).__name__) for m in delivered] == [(8, "StepCommitted")], delivered
        # to the node, of each attempt of step 7 (again for each report a loaded machine resends)
        assert list(coordinator.internal.by_chore) == ["coordinator's Send"]
        assert (tmp_path / "iter_0000008").is_dir() and not coordinator.status()["steps"]


@pytest.mark.timeout(60)
def test_a_report_that_cannot_be_sent_costs_the_link_no_other_send(tmp_path: Path):
    """Two reports wait for the coordinator's first answer, then go out in one batch; the first
    fits this node's message limit only without the coordinator's address, which each send adds.
    Its send raised out of the batch: the other report was never sent (nor at any resend), and
    raised from the socket's handler it ended the node daemon. Each send now runs on its own:
    the failure is counted as an internal error, and the other report is decided."""
    cfg = CkptdConfig(commit_timeout_s=30, coordinator_timeout_s=30, heartbeat_s=0.05)
    small = Codec("job1", max_nbytes=400)

    def written(common_nbytes: int) -> Written:
        return Written(
            step=5,
            attempt=ATTEMPT,
            rank=0,
            world_size=2,
            node=0,
            records=[],
            common=b"c" * common_nbytes,
            common_digest="",
            file_nbytes=0,
        )

    big = Codec("job1")
    n = next(n for n in range(400) if len(big.encode(written(n + 1))[0]) > small.max_nbytes)
    with _node_and_coordinator(tmp_path, cfg, link_codec=small) as (link, delivered, spin, _):
        link.expect((5, ATTEMPT), b"rank0")
        link.report(written(n), (5, ATTEMPT))  # fits, but not addressed
        link.expect((6, ATTEMPT), b"rank0")
        link.report(
            Failed(step=6, attempt=ATTEMPT, rank=0, world_size=2, node=0, reason="the disk is full"), (6, ATTEMPT)
        )
        spin(lambda: delivered)
        assert [(m.step, type(m).__name__) for m in delivered] == [(6, "StepAborted")], delivered
        assert link.internal.by_chore == {"coordinator link's Send": 1}
