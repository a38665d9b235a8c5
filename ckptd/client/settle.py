"""A resume waits for the commits the previous launch left in flight.

A trainer that crashed right after ``save()`` returned leaves its step with the node daemons, which
go on writing and committing it. A relaunch that resumed at once would load the step before, and
its own save of the landed step would later be refused (``CheckpointExistsError``). So before a
resume chooses its checkpoint, the ranks ask their node daemons which attempts they hold undecided
(``IN_FLIGHT``), and wait for those that can still commit, up to ``resume_wait_s``.

An attempt can still commit when no rank failed it and every rank of its world has handed its save
to a node daemon (being written, or written and reported). The ranks gather what their daemons
hold, so an attempt is seen whole where the relaunch runs on the nodes of its predecessor. An
attempt a rank never handed off (it crashed inside ``save()``) cannot commit (the coordinator
aborts it after ``commit_timeout_s``), so nobody waits for it. Neither does anyone for a part
missing because its node received the verdict already: it is decided, and if it committed, the
commit is visible (the coordinator announces a commit after it made it).

Order, on every rank (a collective with torch.distributed initialized, as the resume's choice is):

1. ask this rank's node daemon (a failed question counts as nothing in flight: the resume goes on,
   as it did before waiting existed);
2. gather every rank's answer and rank 0's time waited; :func:`settle_move` decides, from these
   alone, so every rank decides alike: go on, wait another poll, or give up (a WARNING);
3. while waiting, poll again every ``poll_s``; one INFO line says what is waited for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..control.protocol import AttemptInFlight
from ..dist import DistContext

log = logging.getLogger(__name__)

POLL_S = 0.5


@dataclass(frozen=True, kw_only=True)
class SettleMove:
    """What a resume does next: ``waiting`` the steps of the attempts that can still commit (none:
    go on); ``give_up``: it waited ``resume_wait_s`` for them and goes on without."""

    waiting: tuple[int, ...]
    give_up: bool = False

    @property
    def go(self) -> bool:
        return not self.waiting or self.give_up


def committable(parts: Iterable[AttemptInFlight]) -> list[tuple[int, str]]:
    """The attempts (step, attempt id) that can still commit, from every node's part of them:
    none of their ranks failed, and every rank of their world handed its save off."""
    held: dict[tuple[int, str], tuple[set[int], bool, int]] = {}
    for a in parts:
        ranks, failed, world = held.setdefault((a.step, a.attempt), (set(), False, 0))
        ranks.update(a.writing, a.written)
        held[(a.step, a.attempt)] = (ranks, failed or bool(a.failed), max(world, a.world_size))
    return sorted(
        key for key, (ranks, failed, world) in held.items() if not failed and world > 0 and ranks >= set(range(world))
    )


def settle_move(answers: list[list[AttemptInFlight]], waited_s: float, timeout_s: float) -> SettleMove:
    """The next move of a resume from every rank's node daemon's answer and the time rank 0 has
    waited (the same inputs on every rank: the same move)."""
    steps = tuple(sorted({step for step, _ in committable(a for answer in answers for a in answer)}))
    return SettleMove(waiting=steps, give_up=bool(steps) and waited_s >= timeout_s)


def wait_for_commits_in_flight(
    ask: Callable[[], list[AttemptInFlight]],
    timeout_s: float,
    group: Any = None,
    *,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> SettleMove:
    """Steps 1-3 above; ``ask`` asks this rank's node daemon. Returns the last move."""
    ctx = DistContext.current(group)
    start = clock()
    said = False
    while True:
        gathered = ctx.agree("asking the node daemons for commits in flight", lambda: (ask(), clock() - start))
        move = settle_move([attempts for attempts, _ in gathered], gathered[0][1], timeout_s)
        if move.give_up:
            log.warning(
                "rank %d: step(s) %s still not committed by the node daemons after %.0f s (resume_wait_s); "
                "resuming from the latest committed checkpoint. If they commit later, a save of one of "
                "them is refused (CheckpointExistsError): raise CKPTD_RESUME_WAIT_S, or check the daemon's log",
                ctx.rank,
                list(move.waiting),
                timeout_s,
            )
        if move.go:
            if said and not move.give_up:
                log.info("rank %d: the commits in flight are decided", ctx.rank)
            return move
        if not said:
            log.info(
                "rank %d: waiting up to %.0f s (resume_wait_s) for step(s) %s, which the node daemons are "
                "still committing (saved before a crash?), before choosing the checkpoint to resume from",
                ctx.rank,
                timeout_s,
                list(move.waiting),
            )
            said = True
        sleep(poll_s)
