"""policy="auto" after a rollback (ckptd.client.policy.AutoInterval): the next save is an interval
after the step the job went back to, not at the next save step of the branch it left. Pure logic:
the interval's agreement is a function the test gives."""

from __future__ import annotations

from ckptd.client.policy import AutoInterval

INTERVAL = 7


def _train(policy: AutoInterval, start: int, stop: int) -> list[int]:
    """Call due() at steps start..stop-1, saving whenever it says so; the steps saved."""
    saved = []
    for step in range(start, stop):
        if policy.due(step):
            policy.after_save(step, {})
            saved.append(step)
    return saved


def _trained(until: int) -> tuple[AutoInterval, list[int]]:
    """A policy whose job called due() at steps 0..until and saved whenever it said so."""
    policy = AutoInterval(mtbf_s=60.0, restart_s=1.0, world_size=1, agree=lambda _: INTERVAL)
    return policy, _train(policy, 0, until + 1)


def _first_due(policy: AutoInterval, start: int, stop: int) -> int | None:
    return next((step for step in range(start, stop) if policy.due(step)), None)


def test_after_going_back_the_next_save_is_an_interval_after_the_step_loaded():
    policy, saved = _trained(40)
    assert saved == [0, 7, 14, 21, 28, 35] and policy.next_step == 42
    policy.after_load(14)  # a loss spike: back to 14, and train on from 15
    # Before, due() said nothing until 42: 28 steps of training, four intervals, unsaved.
    assert _train(policy, 15, 40) == [21, 28, 35]


def test_a_load_that_does_not_take_the_steps_back_leaves_the_schedule():
    # One rank loading an older step to look at it (load(step=N) needs no other rank), or a job
    # that skips ahead past the steps it went back from: due() stays the same on every rank.
    policy, _ = _trained(40)
    policy.after_load(7)
    assert _first_due(policy, 41, 100) == 42
    policy, _ = _trained(40)
    policy.after_load(14)
    assert _first_due(policy, 50, 100) == 50  # past the old schedule's 42: due at once, as before


def test_steps_that_go_back_without_a_load_restart_the_schedule_there():
    policy, _ = _trained(40)
    assert _first_due(policy, 10, 100) == 16  # an interval after the step before the first one


def test_the_time_a_load_took_is_no_step_time():
    policy, _ = _trained(40)
    measured = len(policy.step_times_s)
    policy.after_load(14)
    policy.due(15)
    assert len(policy.step_times_s) == measured
    policy.due(16)
    assert len(policy.step_times_s) == min(measured + 1, policy.step_times_s.maxlen or 0)
