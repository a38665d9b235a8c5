"""A resume settling the saves an earlier launch left with the node daemons (ckptd.client.settle):
which attempts it waits for or abandons, and the loop's moves, with an injected clock, answers and
root (no daemon, no process group: one rank)."""

from __future__ import annotations

import logging

import pytest

from ckptd.client.settle import InFlightView, SettleMove, merge, settle_in_flight, settle_move
from ckptd.control.protocol import AttemptInFlight

K10, K11 = (10, "abc-1"), (11, "abc-1")


def part(
    step: int = 10, *, world: int = 2, writing=(), written=(), failed=(), attempt: str = "abc-1", live: bool = False
) -> AttemptInFlight:
    return AttemptInFlight(
        step=step,
        attempt=attempt,
        world_size=world,
        writing=tuple(writing),
        written=tuple(written),
        failed=tuple(failed),
        live=live,
    )


def test_an_attempt_every_rank_handed_off_is_committable_from_the_parts_of_every_node():
    node0, node1 = part(world=4, writing=[0], written=[1]), part(world=4, written=[2, 3])
    assert merge([node0, node1], 4) == InFlightView(committable=(K10,), doomed=())
    assert merge([node0, node1, node0], 4) == InFlightView(committable=(K10,), doomed=())  # one node's ranks alike


def test_an_attempt_missing_parts_is_doomed_only_as_seen_by_every_rank_of_its_world():
    node0 = part(world=4, writing=[0], written=[1])
    assert merge([node0], 4) == InFlightView(committable=(), doomed=((K10, (0, 1)),))  # ranks 2-3 never handed off
    # Asked by 2 ranks (a subgroup, no process group, an evaluation process, a failed answer):
    # ranks 2-3's parts may be on a node nobody asked.
    assert merge([node0], 2) == InFlightView(committable=(), doomed=())
    assert merge([node0], 0) == InFlightView(committable=(), doomed=())


@pytest.mark.parametrize(
    "parts",
    [
        [part(written=[0], failed=[1])],  # a failed write, a skip: the attempt aborts on its own
        [part(written=[0], live=True)],  # its launch still runs (this one's own save, say)
        [part(written=[0, 1], live=True)],
        [part(written=[0]), part(written=[1], live=True)],  # live on one node is enough
    ],
    ids=["failed", "live-partial", "live-whole", "live-elsewhere"],
)
def test_an_attempt_that_is_failed_or_of_a_running_launch_is_left_alone(parts):
    assert merge(parts, 2) == InFlightView(committable=(), doomed=())


def test_attempts_are_told_apart_by_attempt_id():
    # a retry of step 10 (attempt -2) where the first try (-1) failed: only the retry is waited for
    assert merge([part(written=[0], failed=[1]), part(written=[0, 1], attempt="abc-2")], 2).committable == (
        (10, "abc-2"),
    )


def test_the_move_waits_for_the_first_polls_committable_attempts_until_committed_or_the_bound():
    view = merge([part(written=[0]), part(writing=[1]), part(step=11, world=1, written=[0])], 2)
    assert view.committable == (K10, K11)
    assert settle_move(view, set(), None, set(), 0.0, 5.0) == SettleMove(waiting=(K10, K11))
    assert settle_move(view, {K10}, None, set(), 0.0, 5.0) == SettleMove(waiting=(K11,))  # the root holds it
    assert settle_move(view, set(), {K11}, set(), 1.0, 5.0) == SettleMove(
        waiting=(K11,)
    )  # K10 came after the first poll
    gave_up = settle_move(view, set(), None, set(), 5.0, 5.0)
    assert gave_up.give_up and gave_up.go
    doomed = InFlightView(committable=(), doomed=((K10, (0,)),))
    assert settle_move(doomed, set(), None, set(), 99.0, 5.0) == SettleMove(waiting=())
    # abandoned: waited for until its verdict reached every node (it may yet commit), or committed
    assert settle_move(doomed, set(), {K11}, {K10}, 1.0, 5.0) == SettleMove(waiting=(K10,))
    assert settle_move(doomed, {K10}, {K11}, {K10}, 1.0, 5.0) == SettleMove(waiting=())


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class Root:
    """The root's commit records (``unreadable``: steps whose record cannot be read) and the
    abandons rank 0 sends."""

    def __init__(self, committed: set | None = None, unreadable: set | None = None) -> None:
        self.holds = committed or set()
        self.unreadable = unreadable or set()
        self.asked: list[list] = []
        self.abandoned: list[list] = []

    def committed(self, keys: list) -> tuple[set, set]:
        self.asked.append(keys)
        return {k for k in keys if k in self.holds}, {k for k in keys if k[0] in self.unreadable}

    def abandon(self, keys: list) -> set:
        self.abandoned.append(keys)
        return {key for key, _ in keys}


def settle(answers, clock: Clock, root: Root, *, timeout_s: float = 60.0, may_abandon: bool = True) -> SettleMove:
    asked = []

    def ask():
        asked.append(clock.now)
        return answers[min(len(asked), len(answers)) - 1]

    return settle_in_flight(
        ask, root.committed, root.abandon, timeout_s=timeout_s, may_abandon=may_abandon, clock=clock, sleep=clock.sleep
    )


def test_the_loop_polls_until_the_attempt_is_decided_saying_so_once(caplog):
    clock, root = Clock(), Root()
    with caplog.at_level(logging.INFO, logger="ckptd.client.settle"):
        move = settle([[part(world=1, written=[0])]] * 3 + [[]], clock, root)
    assert move == SettleMove(waiting=()) and clock.now == 1.5 and root.abandoned == []
    assert caplog.text.count("waiting up to 60 s (resume_wait_s) for step(s) [10]") == 1
    assert "are decided; resuming" in caplog.text


def test_the_loop_stops_waiting_once_the_root_holds_the_commit():
    """A verdict lost on its way to a node leaves its part open until the node resends: the root
    tells that the attempt committed."""
    clock, root = Clock(), Root()
    answers = [[part(world=1, written=[0])]] * 2

    def commit_later(keys):
        root.asked.append(keys)
        return (set(keys) if len(root.asked) > 2 else set()), set()

    move = settle_in_flight(
        lambda: answers[0], commit_later, root.abandon, timeout_s=60.0, may_abandon=True, clock=clock, sleep=clock.sleep
    )
    assert move.go and not move.give_up and clock.now == 1.0


def test_the_loop_gives_up_after_the_bound_with_a_warning(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="ckptd.client.settle"):
        move = settle([[part(world=1, writing=[0])]], clock, Root(), timeout_s=2.0)
    assert move.give_up and clock.now == 2.0
    assert "step(s) [10], handed to the node daemons by an earlier launch, still undecided after 2 s" in caplog.text


def test_an_attempt_a_rank_never_handed_off_is_abandoned_once_unless_committed_or_unknown_then_waited_for():
    clock, root = Clock(), Root(committed={(11, "abc-1")}, unreadable={12})
    # One rank, the whole job (no process group), asks: parts of one-rank attempts it never handed
    # off (a node of a multi-rank job holds such parts of its other ranks).
    doomed = [part(world=1), part(step=11, world=1), part(step=12, world=1)]
    move = settle([doomed, doomed, []], clock, root)
    assert move.go and clock.now == 1.0  # until the abandoned step 10 was decided on every node
    # step 11's part is one a node kept after the commit's verdict; step 12's record could not be read
    assert root.abandoned == [[(K10, ())]]
    root.abandoned.clear()
    settle([doomed], Clock(), root, may_abandon=False)  # node-local disks, or not every rank of the job asks
    assert root.abandoned == []


def test_an_abandoned_attempt_the_coordinator_kept_ends_the_wait_once_the_root_holds_its_commit():
    """A node that missed the commit's verdict lists its part until it resends (minutes later)."""
    clock, root = Clock(), Root()
    doomed = [part(world=1)]

    def commit_on_third_read(keys):
        root.asked.append(keys)
        return (set(keys) if len(root.asked) >= 3 else set()), set()

    move = settle_in_flight(
        lambda: doomed,
        commit_on_third_read,
        root.abandon,
        timeout_s=60.0,
        may_abandon=True,
        clock=clock,
        sleep=clock.sleep,
    )
    assert move.go and not move.give_up and clock.now == 1.0 and root.asked == [[K10]] * 3


def test_an_abandon_the_daemon_did_not_take_is_neither_waited_for_nor_asked_again():
    clock, tries = Clock(), []
    answers = [[part(world=1), part(step=11, world=1, written=[0])]] * 3 + [[part(world=1)]]

    def refuse(doomed):  # refused, or no answer
        tries.append(doomed)
        return set()

    move = settle_in_flight(
        lambda: answers[min(int(clock.now * 2), 3)],
        lambda keys: (set(), set()),
        refuse,
        timeout_s=60.0,
        may_abandon=True,
        clock=clock,
        sleep=clock.sleep,
    )
    assert move == SettleMove(waiting=()) and clock.now == 1.5  # step 11 committed meanwhile
    assert tries == [[(K10, ())]]


def test_a_rank_whose_daemon_could_not_be_asked_vetoes_abandoning_and_is_waited_for_by_nobody():
    clock, root = Clock(), Root()
    move = settle([None], clock, root)
    assert move == SettleMove(waiting=()) and root.abandoned == [] and root.asked == []


def test_nothing_in_flight_returns_at_once_without_a_word(caplog):
    clock, root = Clock(), Root()
    with caplog.at_level(logging.INFO, logger="ckptd.client.settle"):
        assert settle([[]], clock, root).go
    assert clock.now == 0.0 and caplog.text == "" and root.asked == []


def test_a_commit_counts_as_done_once_the_tracker_names_it(tmp_path):
    """A commit writes its record and renames the checkpoint into place before its tracker write:
    a resume that stopped waiting in between loaded the step before, without a word (and its save
    of the step just committed was refused). Done only once the tracker names it or a later commit."""
    from ckptd.client.settle import DaemonsInFlight
    from tests.checkpoints import make_root, stamp_commits

    root = make_root(tmp_path / "r", [10, 20], latest=10)
    stamp_commits(root, [10, 20])  # attempt 0123456789ab-1
    reader = DaemonsInFlight(root, 0, lambda: None, lambda _: None)
    key = (20, "0123456789ab-1")
    assert reader.committed([key]) == (set(), set())  # in place, latest not written yet: wait
    (root / "latest").write_text("iter_0000020\n")
    assert reader.committed([key]) == ({key}, set())
    assert reader.committed([(20, "fedcba987654-1")]) == (set(), set())  # another attempt's commit
