"""Which branch of a root a commit is on, after rollbacks: pure decisions over commit records.

A job that goes back (``ckpt.load(sd, step=20)`` with 30 and 40 committed) and trains on commits a
new branch: 25, 35, 45... Its commits descend from 20; 30 and 40 are on the branch it left. Step
numbers cannot tell the two apart once the new branch passes the old one's steps (45 is above 40,
and is no descendant of it), nor can commit order (20 was committed before 30). So each commit
record names the commit it descends from, ``parent_seq`` (:class:`ckptd.format.commitrecord.CommitRecord`),
decided by the coordinator at the commit from what the job's ranks say they last loaded
(:class:`WentBack`, on the wire with every save: :func:`parent_of`), and the branch the job trains
on is the chain of parents from the tracker's target (:func:`ancestry`).

Where the chain ends without a known start (a record without ``parent_seq``: written before records named
parents, or by a commit whose ranks disagreed on what they loaded; or a parent link that is not
one a commit makes), the older rule takes over from the oldest commit of the chain: a commit is on a
branch a rollback abandoned when it is of a higher step and was committed before it
(:func:`left_behind`). Where the chain reaches a parent that is no longer there (retention, or a
removal by hand), the commits made after that parent are not on the chain, and so left; the ones
before it are judged by the older rule. A commit made after the tracker's target is never taken
for a left one (a commit whose tracker a crash interrupted is newer than it).

Every parent link a commit writes is to a lower step and an earlier commit, and :func:`ancestry`
follows no other: so a commit of a higher step than the tracker's target is on an abandoned
branch exactly when the older rule says so (:func:`left_behind`), and the lineage only adds the
left commits of lower steps that the older rule took for ancestors.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


@dataclass(frozen=True, kw_only=True)
class WentBack:
    """The step a job last loaded (``ckpt.load(sd, step=30)``, or a resume) and when
    (``before_unix_s``, the rank's clock). Its saves of steps above it that were committed before
    it loaded (a branch it left: 40, after going back to 30 with 40 committed) replace them
    (:meth:`ckptd.catalog.RootCatalog.superseded`), as its first save at a step the old branch
    lacks would have abandoned them; what it committed since stays committed once, and is what
    its next commit descends from (:func:`parent_of`). A commit made within the clocks' difference
    after the load could be taken for one before: only a job saving one step twice, or twice in
    all, that fast would notice."""

    step: int
    before_unix_s: float


def agreed_went_back(reported: Iterable[tuple[int, float]]) -> WentBack | None:
    """The step the job last loaded, when every rank's report names the same (Save.went_back_to),
    as of the earliest rank's load; None when one loaded none or they differ (then nothing above
    it is replaced: a save of such a step is refused, as a step is committed once)."""
    values = list(reported)
    steps = {step for step, _ in values}
    if len(steps) != 1 or min(steps) < 0:
        return None
    return WentBack(step=steps.pop(), before_unix_s=min(t for _, t in values))


def loads_agree(reported: Collection[tuple[int, float]]) -> bool:
    """Whether every rank's report names the same step loaded, or none loaded any (-1): only
    then is the commit's parent known (:func:`parent_of`)."""
    return len({step for step, _ in reported}) == 1


class Recorded(Protocol):
    """A commit as its record places it (:class:`ckptd.catalog.CheckpointEntry`)."""

    @property
    def commit_seq(self) -> int: ...  # 0: no record

    @property
    def step(self) -> int: ...

    @property
    def parent_seq(self) -> int | None: ...  # None: not recorded


class Timed(Recorded, Protocol):
    @property
    def committed_unix_s(self) -> float: ...


@dataclass(frozen=True, kw_only=True)
class Link:
    """A commit about to be made, as :func:`off_lineage` takes it."""

    commit_seq: int
    step: int
    parent_seq: int | None


R = TypeVar("R", bound=Recorded)
T = TypeVar("T", bound=Timed)


def left_behind(step: int, seq: int, latest_step: int, latest_seq: int) -> bool:
    """The older rollback rule: a commit of ``step`` (commit sequence number ``seq``) is on an
    abandoned branch when a commit of a lower step (``latest_step``) was committed after it."""
    return step > latest_step and seq < latest_seq


def left_by(went_back: WentBack | None, step: int, committed_unix_s: float) -> bool:
    """Whether a commit of ``step`` made at ``committed_unix_s`` is one a job that ``went_back``
    left: above the step it loaded, committed before it loaded (:class:`WentBack`)."""
    return went_back is not None and step > went_back.step and committed_unix_s < went_back.before_unix_s


@dataclass(frozen=True)
class Ancestry:
    """The known part of a commit's lineage: ``chain``, the commit numbers of the commit and its
    ancestors followed through their records; ``oldest``, the last commit of the chain; and
    ``known_above``: the commits numbered above it and below ``oldest`` are on the chain or on a
    branch the job left (``oldest``'s parent when that is no longer there, else ``oldest``'s own
    number: nothing below is known)."""

    chain: frozenset[int]
    oldest: Recorded
    known_above: int


def ancestry(target: Recorded, commits: Iterable[Recorded]) -> Ancestry:
    """Follow ``target``'s parent links through ``commits`` (readable records only: a commit whose
    record cannot be read is no link), as long as each leads to an earlier commit of a lower step."""
    by_seq = {c.commit_seq: c for c in commits if c.commit_seq > 0}
    chain = {target.commit_seq}
    cur = target
    while True:
        parent_seq = cur.parent_seq
        if parent_seq is None or not 0 < parent_seq < cur.commit_seq:
            return Ancestry(frozenset(chain), cur, cur.commit_seq)
        parent = by_seq.get(parent_seq)
        if parent is None:  # removed since: what was committed after it is on no chain through it
            return Ancestry(frozenset(chain), cur, parent_seq)
        if parent.step >= cur.step or parent.commit_seq in chain:
            return Ancestry(frozenset(chain), cur, cur.commit_seq)  # no link a commit writes
        chain.add(parent.commit_seq)
        cur = parent


def off_lineage(target: Recorded, commits: Sequence[R]) -> list[R]:
    """The ``commits`` (readable records) on branches a rollback left, seen from ``target`` (the
    tracker's): committed before it, not its ancestors (see the module docstring)."""
    known = ancestry(target, commits)
    oldest = known.oldest
    return [
        c
        for c in commits
        if 0 < c.commit_seq < target.commit_seq
        and c.commit_seq not in known.chain
        and (c.commit_seq > known.known_above or left_behind(c.step, c.commit_seq, oldest.step, oldest.commit_seq))
    ]


def parent_of(commits: Sequence[T], step: int, went_back: WentBack | None, *, agreed: bool) -> int | None:
    """The commit a new commit of ``step`` descends from (its ``parent_seq``), among ``commits``
    (the root's, readable records): when the job went back (``went_back``), its newest commit
    made since, else the commit of the step it loaded that was there when it loaded; without one,
    the newest commit. None when that is unknown: the ranks did not all say the same (``agreed``
    False), the commit the job loaded is not there (removed since, or loaded from a mirror), or
    the one found is not of a lower step (a job that saves a lower step without loading it goes
    back to where nothing says)."""
    if not agreed:
        return None
    recorded = [c for c in commits if c.commit_seq > 0]
    if went_back is None:
        candidates = recorded
    else:
        candidates = [
            c for c in recorded if c.step > went_back.step and c.committed_unix_s >= went_back.before_unix_s
        ] or [c for c in recorded if c.step == went_back.step and c.committed_unix_s < went_back.before_unix_s]
    parent = max(candidates, key=lambda c: c.commit_seq, default=None)
    return parent.commit_seq if parent is not None and parent.step < step else None


def copy_parent(
    copies: Iterable[tuple[int, tuple[int, str], int]], source_chain: frozenset[tuple[int, str]], step: int
) -> int | None:
    """The parent of a mirror's copy of a local commit of ``step``: the newest copy (``copies``:
    ``(its seq in the mirror, (the local seq and attempt it copies), its step)``) of one of the
    local commit's known ancestors (``source_chain``, its :func:`ancestry` in the local root, as
    (seq, attempt): a local root lost and begun again numbers from 1 again, so a number alone
    would take an old run's copy for an ancestor). None when the mirror holds no copy of one (the
    mirror skips steps a newer commit overtook)."""
    mine = [(seq, copied_step) for seq, source, copied_step in copies if source in source_chain]
    newest = max(mine, default=None)
    return newest[0] if newest is not None and newest[1] < step else None
