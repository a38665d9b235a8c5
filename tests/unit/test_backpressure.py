"""Backpressure decisions as pure functions of the ring's state (ckptd.staging.backpressure): when
on_full="skip" skips, and when a fork snapshot may start. No processes."""

from __future__ import annotations

from ckptd.staging.backpressure import fits, may_fork, must_skip

CAP = 1000  # ring capacity in bytes


def test_fits_once_the_bytes_a_capacity_back_are_on_disk():
    assert fits(consumed=0, end=CAP, capacity=CAP)
    assert not fits(consumed=0, end=CAP + 1, capacity=CAP)
    assert fits(consumed=500, end=1500, capacity=CAP)


def test_skip_only_when_earlier_saves_hold_the_ring():
    # An idle ring (everything before `start` on disk) takes a save of any size: one larger than
    # the ring streams through it (M2: a budget below 1x, or a state grown past the first save).
    for size in (10, CAP, 3 * CAP):
        assert not must_skip(free_block=True, consumed=4000, start=4000, end=4000 + size, capacity=CAP)
    # Busy (the previous save's bytes not all on disk) and no room beside it: skipped.
    assert must_skip(free_block=True, consumed=3500, start=4000, end=4600, capacity=CAP)
    # Busy, but this save fits in the room the earlier one leaves: taken.
    assert not must_skip(free_block=True, consumed=3500, start=4000, end=4400, capacity=CAP)
    # Busy, larger than the ring: skipped (it would wait for the earlier save).
    assert must_skip(free_block=True, consumed=3999, start=4000, end=4000 + 2 * CAP, capacity=CAP)
    # Every control block taken: skipped, whatever the bytes say.
    assert must_skip(free_block=False, consumed=4000, start=4000, end=4010, capacity=CAP)


def test_at_most_one_fork_child_waits_for_ring_space():
    # A child that will not wait may always start.
    assert may_fork(consumed=0, capacity=CAP, end=CAP, earlier_ends=[CAP])
    # One that will wait may start when no earlier child waits (none, or all have their room).
    assert may_fork(consumed=0, capacity=CAP, end=2 * CAP, earlier_ends=[])
    assert may_fork(consumed=0, capacity=CAP, end=2 * CAP, earlier_ends=[CAP])
    # Not while an earlier child still waits (M3: children and their copy-on-write views piled
    # up, one per save, behind a slow disk).
    assert not may_fork(consumed=0, capacity=CAP, end=3 * CAP, earlier_ends=[CAP, 2 * CAP])
    # Once the disk wrote enough for that child to have its room, the next may start (and wait).
    assert may_fork(consumed=CAP, capacity=CAP, end=3 * CAP, earlier_ends=[CAP, 2 * CAP])
