"""A resume's wait for the commits in flight (ckptd.client.settle): which attempts can still commit,
and the loop's moves, with an injected clock and answers (no daemon, no process group: one rank)."""

from __future__ import annotations

import logging

import pytest

from ckptd.client.settle import SettleMove, committable, settle_move, wait_for_commits_in_flight
from ckptd.control.protocol import AttemptInFlight


def part(
    step: int = 10, *, world: int = 2, writing=(), written=(), failed=(), attempt: str = "abc-1"
) -> AttemptInFlight:
    return AttemptInFlight(
        step=step,
        attempt=attempt,
        world_size=world,
        writing=tuple(writing),
        written=tuple(written),
        failed=tuple(failed),
    )


def test_an_attempt_every_rank_handed_off_can_commit_from_the_parts_of_every_node():
    node0, node1 = part(world=4, writing=[0], written=[1]), part(world=4, written=[2, 3])
    assert committable([node0]) == []  # ranks 2 and 3: another node's part, or never handed off
    assert committable([node0, node1]) == [(10, "abc-1")]
    assert committable([node0, node1, node0]) == [(10, "abc-1")]  # ranks of one node answer alike


@pytest.mark.parametrize(
    "parts",
    [
        [part(written=[0], failed=[1])],  # a failed write, a skip: the attempt aborts
        [part(written=[0, 1]), part(failed=[-1])],  # a node's local abort
        [part(written=[0])],  # rank 1 crashed inside save(): never handed off
        [part(world=0)],
    ],
    ids=["failed", "node-abort", "missing-rank", "no-world"],
)
def test_an_attempt_that_cannot_commit_is_not_waited_for(parts):
    assert committable(parts) == []


def test_attempts_are_told_apart_by_attempt_id():
    # a retry of step 10 (attempt -2) where the first try (-1) failed: only the retry is waited for
    parts = [part(written=[0], failed=[1]), part(written=[0, 1], attempt="abc-2")]
    assert committable(parts) == [(10, "abc-2")]


def test_the_move_waits_for_committable_steps_until_the_bound_then_gives_up():
    answers = [[part(written=[0])], [part(writing=[1]), part(step=11, written=[1])]]
    assert settle_move(answers, waited_s=0.0, timeout_s=5.0) == SettleMove(waiting=(10,))
    assert not settle_move(answers, waited_s=4.9, timeout_s=5.0).go
    gave_up = settle_move(answers, waited_s=5.0, timeout_s=5.0)
    assert gave_up.give_up and gave_up.go and gave_up.waiting == (10,)
    assert settle_move([[], []], waited_s=99.0, timeout_s=5.0) == SettleMove(waiting=())


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_the_loop_polls_until_the_attempt_is_decided(caplog):
    clock, answers = Clock(), [[part(world=1, written=[0])]] * 3 + [[]]
    asked = []

    def ask():
        asked.append(clock.now)
        return answers[len(asked) - 1]

    with caplog.at_level(logging.INFO, logger="ckptd.client.settle"):
        move = wait_for_commits_in_flight(ask, 60.0, poll_s=0.5, clock=clock, sleep=clock.sleep)
    assert move == SettleMove(waiting=()) and asked == [0.0, 0.5, 1.0, 1.5]
    assert "waiting up to 60 s (resume_wait_s) for step(s) [10]" in caplog.text
    assert caplog.text.count("waiting up to") == 1


def test_the_loop_gives_up_after_the_bound_with_a_warning(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="ckptd.client.settle"):
        move = wait_for_commits_in_flight(
            lambda: [part(world=1, writing=[0])], 2.0, poll_s=0.5, clock=clock, sleep=clock.sleep
        )
    assert move.give_up and clock.now == 2.0
    assert "step(s) [10] still not committed by the node daemons after 2 s" in caplog.text


def test_nothing_in_flight_returns_at_once_without_a_word(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="ckptd.client.settle"):
        assert wait_for_commits_in_flight(lambda: [], 60.0, clock=clock, sleep=clock.sleep).go
    assert clock.now == 0.0 and caplog.text == ""
