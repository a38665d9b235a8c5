"""A resume settles the saves the previous launch left with the node daemons.

A trainer that crashed right after ``save()`` returned leaves its step with the node daemons, which
go on writing and committing it. A relaunch that resumed at once would load the step before it,
and its own save of the landed step would be refused ("committed already"). A trainer that
crashed inside ``save()`` on some ranks leaves an attempt that can never commit; the coordinator
aborts it after ``commit_timeout_s``, and until then a relaunch's save of that step is refused as a
second attempt of it. So before a resume chooses its checkpoint, the ranks ask their node daemons
which attempts they hold undecided (``IN_FLIGHT``) and settle those of launches no longer running
(no process that handed one of their saves off is still connected: its Checkpointer was closed,
or its process is gone):

- an attempt every rank of its world handed off, and no rank failed, can still commit: the resume
  waits for it, up to ``resume_wait_s``, or until rank 0 finds its commit on the root (a node whose
  verdict was lost on its way reports its part until it resends);
- an attempt some rank never handed off cannot commit: rank 0 asks the coordinator to abort it now
  (``ABANDON``, through its node daemon), unless the root holds its commit already (a node that
  received the verdict no longer reports its part, and the coordinator announces a commit only once
  it is visible) or rank 0 could not read whether it does. The coordinator aborts it on every node,
  unless the ranks that reported it and those found make up its world (the node daemon that
  reported the others died since: it commits once the rest is written); the resume waits for that
  verdict to reach the nodes. Only where
  the ranks asking are every rank of the job and of the attempt's world (the default process group,
  every one of them answered): a part on a node nobody asked looks missing. Not with node-local
  disks, whose nodes each finish a commit on their own disk after its verdict: there the
  coordinator's timeout aborts it.

Attempts of a running launch (this one's own saves, another Checkpointer's) are left alone, as
are those a rank failed (they abort on their own). Where the relaunch runs on other nodes than its
predecessor, or a node daemon restarted before it reported its ranks, parts are missing: such an
attempt is taken for one that cannot commit.

Order, on every rank (a collective with torch.distributed initialized, as the resume's choice is);
every move is decided from gathered values only, rank 0's clock and settings included, so the
ranks move alike:

1. ask this rank's node daemon (a failed question: the resume waits for nothing it did not see,
   and abandons nothing);
2. gather every rank's answer; when some attempt is to be waited for or abandoned, gather rank 0's
   reading of the root's commit records of those steps (a second small collective);
3. rank 0 abandons the attempts that cannot commit (once each), and the ranks gather which its node
   daemon took;
4. :func:`settle_move` decides: go on, or poll again after ``poll_s``; the attempts waited for are
   the committable ones of the first poll (later ones cannot belong to a launch that is gone) and
   the abandoned ones, until they are decided. After ``resume_wait_s`` the resume goes on with a
   WARNING.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..control.protocol import Abandon, AttemptInFlight, InFlight, InFlightReply, SaveAck
from ..dist import DistContext
from ..errors import CkptdError, DaemonLostError
from ..s3catalog import commit_record_at, tracked_seq
from ..storage.url import Location
from .link import DaemonLink

log = logging.getLogger(__name__)

POLL_S = 0.5
Key = tuple[int, str]  # (step, attempt id)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class InFlightView:
    """The attempts of launches no longer running, merged from every node's parts of them:
    ``committable`` (every rank of the world handed off, none failed) and ``doomed`` (some rank
    never handed off, none failed, and the answers came from every rank of its world), with the
    ranks that did hand it off."""

    committable: tuple[Key, ...]
    doomed: tuple[tuple[Key, tuple[int, ...]], ...]

    @property
    def doomed_keys(self) -> tuple[Key, ...]:
        return tuple(key for key, _ in self.doomed)


def merge(parts: Iterable[AttemptInFlight], asked_world: int) -> InFlightView:
    """The :class:`InFlightView` of every node's parts (ranks of one node answer alike), as asked by
    ``asked_world`` ranks of one process group (0: not every rank answered). A part missing from an
    attempt of another world may be on a node nobody asked: the attempt is then neither waited for
    nor doomed."""
    ranks: dict[Key, set[int]] = {}
    world: dict[Key, int] = {}
    left_alone: set[Key] = set()
    for a in parts:
        key = (a.step, a.attempt)
        ranks.setdefault(key, set()).update(a.writing, a.written)
        world[key] = max(world.get(key, 0), a.world_size)
        if a.live or a.failed:
            left_alone.add(key)
    committable: list[Key] = []
    doomed: list[tuple[Key, tuple[int, ...]]] = []
    for key in sorted(ranks):
        if key in left_alone or world[key] <= 0:
            continue
        if ranks[key] >= set(range(world[key])):
            committable.append(key)
        elif world[key] == asked_world:
            doomed.append((key, tuple(sorted(ranks[key]))))
    return InFlightView(committable=tuple(committable), doomed=tuple(doomed))


@dataclass(frozen=True, kw_only=True)
class SettleMove:
    """What a resume does next: ``waiting`` the attempts it waits for (none: go on); ``give_up``:
    it waited ``resume_wait_s`` for them and goes on without."""

    waiting: tuple[Key, ...]
    give_up: bool = False

    @property
    def go(self) -> bool:
        return not self.waiting or self.give_up


def settle_move(
    view: InFlightView,
    committed: Collection[Key],
    watched: Collection[Key] | None,
    abandoned: Collection[Key],
    waited_s: float,
    timeout_s: float,
) -> SettleMove:
    """The next move from the merged view, the attempts the root holds committed, those waited for
    since the first poll (None: this is the first), those abandoned (waited for until the
    coordinator's verdict reached every node: it keeps one a dead node daemon reported) and rank
    0's time waited and bound."""
    present = (*view.committable, *view.doomed_keys)
    waiting = tuple(
        sorted(
            key
            for key in present
            if key not in committed
            and (key in abandoned or (key in view.committable and (watched is None or key in watched)))
        )
    )
    return SettleMove(waiting=waiting, give_up=bool(waiting) and waited_s >= timeout_s)


def _steps(keys: Iterable[Key]) -> list[int]:
    return sorted({step for step, _ in keys})


def settle_in_flight(
    ask: Callable[[], list[AttemptInFlight] | None],
    committed: Callable[[list[Key]], tuple[set[Key], set[Key]]],
    abandon: Callable[[list[tuple[Key, tuple[int, ...]]]], set[Key]],
    *,
    timeout_s: float,
    may_abandon: bool,
    group: Any = None,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> SettleMove:
    """Steps 1-4 above. ``ask``: this rank's node daemon's answer (None: it could not be asked);
    ``committed``: which of these attempts the root holds committed, and which it could not tell
    (called on rank 0); ``abandon``: ask to abort these attempts, returning those the node daemon
    took (rank 0; it never raises). ``may_abandon`` (rank 0's counts): the ranks asking are every
    rank of the job, in its default group, on shared storage. Returns the last move."""
    ctx = DistContext.current(group)
    start = clock()
    watched: frozenset[Key] | None = None
    tried: set[Key] = set()  # asked to abort, once each
    abandoned: set[Key] = set()  # of those, the ones the node daemon took
    said = False
    while True:
        gathered = ctx.agree(
            "asking the node daemons for saves in flight", lambda: (ask(), clock() - start, timeout_s, may_abandon)
        )
        answers = [answer for answer, *_ in gathered]
        _, waited_s, bound_s, abandoning = gathered[0]
        # Doomed only as seen by every rank of the job: a part on a node nobody asked looks missing.
        whole = abandoning and all(answer is not None for answer in answers)
        view = merge((a for answer in answers for a in answer or ()), ctx.world_size if whole else 0)
        # The root is read for every attempt waited for or to abandon, the abandoned included (one
        # the coordinator kept commits, and a node may miss its verdict until it resends).
        asked = sorted({*view.committable, *view.doomed_keys})
        done: set[Key] = set()
        unknown: set[Key] = set()
        if asked:
            read = ctx.agree(
                "reading the commits of the saves in flight", _on_rank_0(ctx, committed, asked, (done, unknown))
            )
            done, unknown = read[0]
        doomed = [(key, ranks) for key, ranks in view.doomed if key not in tried | done | unknown]
        if doomed:  # a collective too: the attempts rank 0 could ask to abort are waited for
            taken = ctx.agree("abandoning saves that cannot commit", _on_rank_0(ctx, abandon, doomed, abandoned))
            tried.update(key for key, _ in doomed)
            abandoned.update(taken[0])
        move = settle_move(view, done, watched, abandoned, waited_s, bound_s)
        if watched is None:
            watched = frozenset(move.waiting)
        if ctx.rank == 0:
            _say(move, said, bound_s)
        if move.go:
            return move
        said = True
        sleep(poll_s)


def _on_rank_0(ctx: DistContext, fn: Callable[[Any], T], arg: Any, elsewhere: T) -> Callable[[], T]:
    """``fn(arg)`` on rank 0 (``elsewhere`` on the others), for :meth:`DistContext.agree` to spread."""
    return lambda: fn(arg) if ctx.rank == 0 else elsewhere


def _say(move: SettleMove, said: bool, timeout_s: float) -> None:
    """Rank 0's log lines: one when the wait starts, one when it ends."""
    if move.give_up:
        log.log(
            logging.WARNING if timeout_s > 0 else logging.INFO,
            "step(s) %s, handed to the node daemons by an earlier launch, still undecided after %.0f s "
            "(resume_wait_s); resuming from the latest committed checkpoint. If one commits later, this "
            'launch\'s save of that step is refused ("committed already"): raise CKPTD_RESUME_WAIT_S, or '
            "see the daemons' logs",
            _steps(move.waiting),
            timeout_s,
        )
    elif move.go:
        if said:
            log.info("the saves the node daemons were committing are decided; resuming")
    elif not said:
        log.info(
            "waiting up to %.0f s (resume_wait_s) for step(s) %s, which an earlier launch handed to the "
            "node daemons, to be decided, before choosing the checkpoint to resume from",
            timeout_s,
            _steps(move.waiting),
        )


class DaemonsInFlight:
    """The I/O of a Checkpointer's settling (:func:`settle_in_flight`): its node daemon's answer,
    the root's commit records, the abandons. A failure to ask lets the resume go on without
    waiting and vetoes abandoning; an abandon the node daemon did not take leaves the attempt to
    the coordinator's timeout (and nobody waits for it).

    ``link``: the rank's link to its node daemon, connected (None: the Checkpointer is closed);
    ``lost``: what the Checkpointer does when the daemon died (its saves in flight fail)."""

    def __init__(
        self, root: Location, rank: int, link: Callable[[], DaemonLink | None], lost: Callable[[str], None]
    ) -> None:
        self.root = root
        self.rank = rank
        self.link = link
        self.lost = lost

    def settle(self, timeout_s: float, *, shared_root: bool, job_world_size: int, group: Any = None) -> SettleMove:
        """Settle, asking the ranks of ``group``; abandons only where they are every rank of the job
        (the default group of ``job_world_size`` ranks) on a ``shared_root``."""
        whole_job = group is None and DistContext.current().world_size == job_world_size
        return settle_in_flight(
            self.ask,
            self.committed,
            self.abandon,
            timeout_s=timeout_s,
            may_abandon=shared_root and whole_job,
            group=group,
        )

    def ask(self) -> list[AttemptInFlight] | None:
        try:
            link = self.link()
            return None if link is None else link.request(InFlight(), InFlightReply).attempts
        except DaemonLostError as exc:
            self.lost(str(exc))
            log.warning("rank %d: %s; resuming without asking it for saves in flight", self.rank, exc)
        except Exception as exc:  # noqa: BLE001 - whatever stops the question, the resume goes on
            log.warning("rank %d: cannot ask the node daemon for saves in flight (%s)", self.rank, exc)
        return None

    def committed(self, keys: list[Key]) -> tuple[set[Key], set[Key]]:
        """Which of these attempts the root holds committed and named latest (or a later commit),
        and which it could not tell. A commit is complete before its tracker write (the last step
        of a commit): a resume that stopped waiting in between loaded the step before, without a
        word, and its save of the step just committed was refused."""
        done, unknown = set(), set()
        tracked: int | None = None
        for step, attempt in keys:
            try:
                record = commit_record_at(self.root, step)
                if record is not None and record.attempt == attempt and tracked is None:
                    tracked = tracked_seq(self.root)
            except (OSError, CkptdError) as exc:
                log.warning("rank %d: cannot read the commit record of step %d (%s)", self.rank, step, exc)
                unknown.add((step, attempt))
                continue
            if record is not None and record.attempt == attempt and tracked is not None and tracked >= record.seq:
                done.add((step, attempt))
        return done, unknown

    def abandon(self, doomed: list[tuple[Key, tuple[int, ...]]]) -> set[Key]:
        """Ask the node daemon to have these attempts aborted; those it took."""
        taken: set[Key] = set()
        for (step, attempt), ranks in doomed:
            why = (
                f"a relaunch found only ranks {list(ranks)} of it at the node daemons, and its launch gone (a rank "
                "died inside save(), or the node daemon that held the others did)"
            )
            log.warning(
                "step %d attempt %s, saved by an earlier launch, looks unable to commit (only ranks %s of it "
                "are at the node daemons); asking the coordinator to abort it now, so that this launch can "
                "save step %d",
                step,
                attempt,
                list(ranks),
                step,
            )
            request = Abandon(step=step, attempt=attempt, reason=why, handed_off=list(ranks))
            try:
                link = self.link()
                if link is not None:
                    link.request(request, SaveAck, match=_ack_of(step, attempt))
                    taken.add((step, attempt))
            except Exception as exc:  # noqa: BLE001 - rank 0 alone: never raise between collectives
                log.warning("rank %d: could not abort step %d attempt %s: %s", self.rank, step, attempt, exc)
        return taken


def _ack_of(step: int, attempt: str) -> Callable[[SaveAck], bool]:
    return lambda ack: ack.step == step and ack.attempt == attempt
