"""Which level a Checkpointer with a mirror reads from: its local root or the object-store mirror
(the decision: :func:`ckptd.roots.mirror.resume_from`).

Order for one resume (:meth:`ckptd.Checkpointer.load` without ``step``), on every rank:

1. :meth:`Levels.resume` resolves the latest intact checkpoint of each level
   (:func:`ckptd.recovery.resolve_resumable`) and the local commit the mirror's copies;
2. with torch.distributed initialized, the ranks gather what each found locally (one
   ``all_gather_object`` of a few bytes): a rank that sees another local checkpoint than the
   others in a shared root makes every rank read the mirror. Node-local disks (config
   ``node_local``): only rank 0 resolves (node 0's disk is the commit authority) and the ranks
   gather its decision, so a node that lags behind never rolls the job back to an older copy;
3. every rank loads rank 0's choice (:func:`ckptd.client.resume.load_agreed`): in a shared root,
   the chosen level's checkpoint (:meth:`Levels.shared_candidate`); on node-local disks rank 0's
   commit, from its node's disk where it holds the files and from the mirror otherwise
   (:meth:`Levels.candidate`, ckptd.storage.nodeview). A checkpoint found damaged sends every
   rank back to step 1: in a shared root it is remembered by its full path or URL, so a damaged
   local copy of a commit leaves the mirror's copy of it to resume from (the later commit wins,
   :func:`ckptd.roots.mirror.resume_level`), before any older commit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ..catalog import abandoned_commit, read_mirrored
from ..config import CkptdConfig
from ..dist import DistContext
from ..errors import CheckpointNotFoundError, CkptdError, CorruptCheckpointError, NoCheckpointYetError, SaveTimeoutError
from ..format.commitrecord import read_commit_record
from ..format.rootlayout import committed_step, step_dir_name
from ..recovery import LatestChoice, resolve_resumable
from ..roots.mirror import (
    MIRROR,
    CommitRef,
    LocalFind,
    copies_commit,
    local_latest,
    orders_disagree,
    resume_from,
)
from ..s3catalog import checkpoint_exists, committed_at, read_s3_commit_record, read_s3_tracker
from ..storage.nodeview import NodeLocalCheckpoint
from ..storage.s3client import S3Client
from ..storage.url import Location, S3Location, UnsupportedLocationError, join, parse_location
from .abandoned import past_abandoned_copies
from .resume import Candidate, load_agreed, load_latest

log = logging.getLogger(__name__)

_POLL_S = 0.5


def mirror_location(mirror: str, root: Location) -> S3Location | None:
    """The ``mirror`` setting checked (an ``s3://`` prefix the credentials reach, of a local
    root), or None when it is empty."""
    if not mirror:
        return None
    where = parse_location(mirror)
    if not isinstance(where, S3Location):
        raise UnsupportedLocationError(
            f"config mirror={mirror!r}: a mirror is an s3://bucket/prefix (checkpoints of {root} are copied there)"
        )
    if isinstance(root, S3Location):
        raise CkptdError(
            f"config mirror={mirror!r}: the root {root} is on object storage already; a mirror is the second "
            "tier of a local root (a node-local disk or a shared filesystem)"
        )
    S3Client(where).check_access()  # credentials, endpoint and bucket work, or a clear error now
    return where


@dataclass(frozen=True)
class Resume:
    """Where a resume reads: the level's ``root`` and the checkpoint this rank resolved there;
    node-local disks on the local level: no ``choice`` but rank 0's ``commit``, the one every rank
    loads (None: node 0's disk holds none)."""

    root: Location
    choice: LatestChoice | None
    commit: CommitRef | None = None

    @property
    def step(self) -> int | None:
        if self.commit is not None:
            return self.commit.step
        return None if self.choice is None else self.choice.step


@dataclass(frozen=True)
class Look:
    """What one rank found in the levels: the root's latest intact checkpoint and, with a mirror,
    the mirror's, the local commit that one copies, and this rank's :class:`LocalFind`;
    ``local_problem``: why the local root's own copy of that commit, which it holds, cannot be
    resumed (found damaged), or why no local checkpoint can (None: neither); ``mirror_problem``:
    why no checkpoint of the mirror can."""

    local_choice: LatestChoice | None
    mirror_choice: LatestChoice | None = None
    mirrored: CommitRef | None = None
    find: LocalFind | None = None
    local_problem: str | None = None
    mirror_problem: str | None = None


class Levels:
    """The levels a Checkpointer reads: its root, and the mirror (when configured). ``node_local``:
    the root is this node's own disk (config ``node_local``); ``wait_s`` bounds how long a read of a
    commit there waits for the mirror's copy of files this disk lacks; ``node``: this node's id."""

    def __init__(
        self,
        root: Location,
        mirror: S3Location | None,
        *,
        node_local: bool = False,
        wait_s: float = 600.0,
        node: int = 0,
        world_size: int = 1,
    ) -> None:
        self.root = root
        self.world_size = world_size  # the job's ranks
        self.mirror = mirror
        self.node_local = node_local and mirror is not None and isinstance(root, Path)
        self.wait_s = wait_s
        self.node = node

    @classmethod
    def configured(cls, root: Location, config: CkptdConfig, node: int, world_size: int = 1) -> Levels:
        """The levels of a Checkpointer on ``root`` with ``config``, on node ``node`` of a job of
        ``world_size`` ranks."""
        return cls(
            root,
            mirror_location(config.mirror, root),
            node_local=config.node_local,
            # A resume on node-local disks waits this long for the mirror's copy of files its
            # node lacks: the job's bound on persisting one step (README: Two tiers).
            wait_s=config.mirror_timeout_s,
            node=node,
            world_size=world_size,
        )

    def load_resumed(
        self,
        sharded_state_dict: Any,
        damaged: dict[str, str],
        rank: int,
        kwargs: dict[str, Any],
        loaded: list[Candidate] | None = None,
    ) -> Any:
        """:meth:`ckptd.Checkpointer.load` without ``step`` (steps 1-3 above), on every rank;
        ``loaded`` gets the checkpoint resumed."""
        group = kwargs.get("process_group")
        unsafe = bool(kwargs.get("allow_unsafe_pickle"))  # the load unpickles what .metadata names: so may the check
        args = (sharded_state_dict, damaged, rank, kwargs, loaded)
        if self.node_local:
            return load_agreed(lambda: self.candidate(damaged, group, allow_unsafe_pickle=unsafe), *args)
        if self.mirror is None:  # the root is the only level: load_latest's choice is the whole decision
            return load_latest(self.root, *args)
        return load_agreed(lambda: self.shared_candidate(damaged, group, allow_unsafe_pickle=unsafe), *args)

    def shared_candidate(
        self, damaged: dict[str, str], group: Any = None, *, allow_unsafe_pickle: bool = False
    ) -> Candidate:
        """A shared root with a mirror: the checkpoint every rank loads now, of the level
        :meth:`resume` chooses (a collective: every rank calls it, as ``load_agreed`` does). It is
        named by its full path or URL, which ``damaged`` records when a load finds it damaged: the
        other level's copy of the same commit stays a candidate."""
        resume = self.resume(damaged, collective=True, group=group, allow_unsafe_pickle=allow_unsafe_pickle)
        if resume.commit is not None:  # the oldest of the commits the ranks found (they differed)
            path: Location = join(self.root, step_dir_name(resume.commit.step))
        elif resume.choice is None:
            raise NoCheckpointYetError(f"{self.root} and its mirror {self.mirror} hold no committed checkpoint yet")
        else:
            path = resume.choice.entry.path
        return Candidate(
            str(path),
            path,
            lambda: checkpoint_exists(path),
            fallback="an intact copy of the same commit in the other level (the local root or the mirror), else "
            "the intact one committed last before it",
        )

    def resume(
        self, damaged: dict[str, str], *, collective: bool = False, group: Any = None, allow_unsafe_pickle: bool = False
    ) -> Resume:
        """The level to resume from and its latest intact checkpoint (steps 1-2 above);
        ``collective``: every rank calls it, and every rank gets rank 0's decision (ranks that
        looked at the root at different moments, while a commit moved the tracker, would otherwise
        load different steps). Node-local disks: rank 0 alone looks, at its node's disk and the
        mirror; a shared root with a mirror: every rank looks and rank 0 decides from what they all
        found (the mirror's copy when the ranks see different commits). ``allow_unsafe_pickle``:
        the structural checks unpickle any class (ckptd.recovery.resolve_latest)."""
        ctx = DistContext.current(group)
        if self.node_local and collective and ctx.world_size == 1 < self.world_size:
            raise CkptdError(
                f"resuming from node-local disks (config node_local) needs torch.distributed initialized on every "
                f"one of the job's {self.world_size} ranks: only node 0's disk knows the last commit, and the ranks "
                "agree on it through a collective. Call torch.distributed.init_process_group() before "
                "Checkpointer.latest() or load()"
            )
        if not collective or ctx.world_size == 1:
            return self._decide([self._look(damaged, allow_unsafe_pickle)])
        if self.node_local or self.mirror is None:
            decided = ctx.agree(
                "choosing the checkpoint to resume from",
                lambda: self._decide([self._look(damaged, allow_unsafe_pickle)]) if ctx.rank == 0 else None,
            )
            return cast(Resume, decided[0])
        return self._decide(
            ctx.agree("looking for the checkpoint to resume from", lambda: self._look(damaged, allow_unsafe_pickle))
        )

    def _look(self, damaged: dict[str, str], allow_unsafe_pickle: bool = False) -> Look:
        """What this rank finds in the levels (:class:`Look`)."""
        unsafe = allow_unsafe_pickle
        if self.mirror is None or not isinstance(self.root, Path):  # no mirror without a local root
            return Look(
                resolve_resumable(self.root, damaged=damaged, node_local=self.node_local, allow_unsafe_pickle=unsafe)
            )
        # Nothing is said of a level's fallback here: which level the job resumes from is decided
        # from both (_decide, which says it), and a local fallback the mirror overrides is none.
        # A level where checkpoints exist but none loads leaves the other one to resume from.
        unloadable = mirror_unloadable = None
        try:
            local_choice = resolve_resumable(
                self.root, damaged=damaged, node_local=self.node_local, log_fallback=False, allow_unsafe_pickle=unsafe
            )
        except CorruptCheckpointError as exc:
            local_choice, unloadable = None, str(exc)
        local_record = None if local_choice is None else read_commit_record(local_choice.entry.path)
        local = _ref(local_choice, None if local_record is None else (local_record.attempt, local_record.seq))
        try:
            mirror_choice = resolve_resumable(
                self.mirror, damaged=damaged, log_fallback=False, allow_unsafe_pickle=unsafe
            )
        except CorruptCheckpointError as exc:
            mirror_choice, mirror_unloadable = None, str(exc)
        mirror_choice, record, mirrored, replaced = past_abandoned_copies(
            self.root, self.mirror, mirror_choice, damaged, allow_unsafe_pickle=unsafe
        )
        mirror_unloadable = replaced or mirror_unloadable
        holds = mirrored is not None and _local_holds(self.root, mirrored)
        # Proof that both seqs are of this root's commit order (resume_level), asked only where
        # the step and the commit order disagree: one or two small GETs.
        copied = (
            not holds
            and local is not None
            and record is not None
            and orders_disagree(local, mirrored)
            and _mirror_copies_local(self.root, self.mirror, local, record.seq)
        )
        problem = unloadable
        if holds and mirrored is not None and (local is None or local.seq < mirrored.seq):
            # The local root holds the mirror's commit but resolved an older one: its copy is damaged.
            name = step_dir_name(mirrored.step)
            skipped = dict(local_choice.skipped) if local_choice is not None else {}
            problem = damaged.get(str(join(self.root, name))) or skipped.get(name) or unloadable or "it is damaged"
        find = LocalFind(commit=local, holds_mirrored=holds, copied=copied)
        return Look(local_choice, mirror_choice, mirrored, find, problem, mirror_unloadable)

    def _decide(self, looks: list[Look]) -> Resume:
        """Where to resume, from what every rank found (``looks``, by rank; rank 0's decides)."""
        mine = looks[0]
        if mine.find is None:  # no mirror
            return Resume(self.root, mine.local_choice)
        if mine.local_choice is None and mine.mirror_choice is None:
            # Checkpoints exist, none loads: never a fresh start (ckptd.recovery)
            problems = [p for p in (mine.local_problem, mine.mirror_problem) if p is not None]
            if problems:
                raise CorruptCheckpointError(
                    f"no checkpoint of {self.root} or of its mirror {self.mirror} can be loaded: "
                    + " Also: ".join(problems)
                )
        finds = [look.find for look in looks if look.find is not None]
        level, commit = resume_from(finds, mine.mirrored, node_local=self.node_local, rank=0)
        self._say(level, mine)
        if level == MIRROR:
            return Resume(cast(S3Location, self.mirror), mine.mirror_choice)
        if self.node_local:
            return Resume(self.root, None, commit)
        if mine.find is not None and commit is not None and commit != mine.find.commit:
            log.warning(
                "the ranks found different latest commits in %s (%s): resuming from the oldest of them, step %d, "
                "which every rank holds (the mirror's latest copy is of step %s)",
                self.root,
                ", ".join(sorted({f"step {f.commit.step}" for f in finds if f.commit is not None})),
                commit.step,
                "none" if mine.mirrored is None else mine.mirrored.step,
            )
            return Resume(self.root, None, commit)
        return Resume(self.root, mine.local_choice)

    def _say(self, level: str, look: Look) -> None:
        """Log why the resume does not read what the chosen level's tracker names."""
        choice = look.mirror_choice if level == MIRROR else look.local_choice
        if level == MIRROR and look.local_problem is not None and choice is not None:
            mirrored = look.mirrored
            if look.find is not None and look.find.holds_mirrored and mirrored is not None:
                local = join(self.root, step_dir_name(mirrored.step))
                log.warning(
                    "the local copy of step %d (commit %s, seq %d), %s, cannot be loaded: %s; resuming from the "
                    "mirror's intact copy of the same commit, %s. `ckptd verify %s` lists what is damaged there "
                    "(retention removes it in time)",
                    mirrored.step,
                    mirrored.attempt,
                    mirrored.seq,
                    local,
                    look.local_problem,
                    choice.entry.path,
                    local,
                )
            else:
                log.warning("%s; resuming from the mirror's copy %s instead", look.local_problem, choice.entry.path)
        if level != MIRROR and look.mirror_problem is not None and choice is not None:
            log.warning("%s; resuming from the local %s", look.mirror_problem, choice.entry.path)
        if choice is not None and choice.fallback_reason is not None:
            log.warning("%s", choice.fallback_reason)

    def candidate(self, damaged: dict[str, str], group: Any = None, *, allow_unsafe_pickle: bool = False) -> Candidate:
        """Node-local disks: the checkpoint every rank loads now (:meth:`resume` with every rank,
        as :func:`ckptd.client.resume.load_agreed` asks for it). Raises NoCheckpointYetError
        when neither node 0's disk nor the mirror holds one."""
        while True:
            resume = self.resume(damaged, collective=True, group=group, allow_unsafe_pickle=allow_unsafe_pickle)
            if resume.commit is None or not resume.commit.attempt:
                break
            target = self.node_local_commit(resume.commit)
            # Named by its path on the disks: found damaged (a flipped bit on one node's disk) or
            # lost with a node, the mirror's copy of the same commit stays a candidate.
            key = str(join(self.root, target.name))
            lost = self._lost_with_a_node(target, group)
            if lost is None:
                log.info("resuming from step %d (commit %s, node 0's latest)", target.step, target.attempt)
                # Whether it was removed must be answered alike on every node (they hold different
                # files): never; a node that lost its files reads them from the mirror's copy.
                return Candidate(
                    key,
                    target,
                    lambda: False,
                    fallback="the mirror's copy of the same commit, else the intact one committed last before it",
                )
            damaged[key] = lost
            log.warning("%s; resuming from the newest checkpoint that can be loaded", lost)
        if resume.commit is not None:  # not a Checkpointer's commit (ckptd.save): no view of it
            path: Location = join(self.root, step_dir_name(resume.commit.step))
        elif resume.choice is not None:
            path = resume.choice.entry.path
        else:
            if self.node_local:
                self._check_nothing_elsewhere(group)
            raise NoCheckpointYetError(
                f"{self.root} on node 0 (the commit authority with node_local) and the mirror {self.mirror} hold "
                "no committed checkpoint"
            )
        return Candidate(str(path), path, lambda: checkpoint_exists(path))

    def resumed_step(self, damaged: dict[str, str], group: Any = None) -> int | None:
        """Node-local disks: the step :meth:`load_resumed` loads now, agreed by every rank (a
        collective); None when there is none."""
        try:
            candidate = self.candidate(damaged, group)
        except NoCheckpointYetError:
            return None
        if isinstance(candidate.target, NodeLocalCheckpoint):
            return candidate.target.step
        return committed_step(candidate.target.name)

    def _check_nothing_elsewhere(self, group: Any) -> None:
        """Node 0's disk and the mirror hold no checkpoint: raise CorruptCheckpointError if another
        node's disk holds commits (node 0's disk went before the mirror copied any: they cannot be
        loaded without node 0's files), rather than let the job start over silently."""

        def mine() -> tuple[int, int | None]:
            latest = local_latest(self.root) if isinstance(self.root, Path) else None
            return self.node, None if latest is None else latest.step

        found = DistContext.current(group).agree("looking for commits on the nodes' disks", mine)
        held = {node: step for node, step in found if step is not None}
        if held:
            raise CorruptCheckpointError(
                f"the commits the disks of nodes {sorted(held)} hold (up to step {max(held.values())}) cannot be "
                f"loaded: node 0's disk (the commit authority with node_local) holds none of them, nor does the "
                f"mirror {self.mirror} (node 0 was replaced, or its disk lost, before any copy). To start over, "
                f"move {self.root}'s iter_* directories and 'latest' away on every node"
            )

    def _lost_with_a_node(self, target: NodeLocalCheckpoint, group: Any) -> str | None:
        """Why ``target`` can never be loaded, or None: a node's disk holds none of its files
        (neither ``iter_<step>`` of the commit nor the attempt's directory: a replaced node, a lost
        disk) and the mirror has no copy of it, which the daemons can then never complete either.
        Every rank gathers what its node holds, so all decide alike without waiting."""
        found = DistContext.current(group).agree(
            f"looking for the files of step {target.step} on the nodes' disks",
            lambda: (self.node, target.held_here(), target.read_copy() is not None),
        )
        bare = sorted({node for node, holds, _ in found if not holds})
        if not bare or any(copied for _, _, copied in found):
            return None
        return (
            f"step {target.step} (commit {target.attempt}) cannot be loaded: the disks of nodes {bare} hold none of "
            f"its files (replaced nodes, or lost disks) and the mirror {target.mirror} has no copy of it"
        )

    def node_local_commit(self, commit: CommitRef) -> NodeLocalCheckpoint:
        if self.mirror is None or not isinstance(self.root, Path):
            raise CkptdError(f"{self.root}: node-local disks need a local root and a mirror")
        return NodeLocalCheckpoint(
            root=self.root,
            step=commit.step,
            attempt=commit.attempt,
            seq=commit.seq,
            mirror=self.mirror,
            wait_s=self.wait_s,
            node=self.node,
        )

    def step_target(self, step: int, group: Any = None) -> Location | NodeLocalCheckpoint:
        """What ``load(step=...)`` reads: :meth:`step_location`; with node-local disks the newest
        commit of the step that node 0's disk or the mirror's copy records, read from this disk
        and the mirror: with torch.distributed initialized, rank 0 looks and every rank takes its
        answer (a collective: a node whose disk lags behind could otherwise load another commit
        of the step, one a rollback abandoned)."""
        if not self.node_local or self.mirror is None or not isinstance(self.root, Path):
            return self.step_location(step)
        ctx, root, mirror = DistContext.current(group), self.root, self.mirror
        commit = ctx.agree(
            f"choosing the commit of step {step} to load",
            lambda: _step_commit(root, mirror, step) if ctx.rank == 0 else None,
        )[0]
        if commit is None or not commit.attempt:
            return self.step_location(step)
        return self.node_local_commit(commit)

    def resumed_location(self, damaged: dict[str, str]) -> Location | None:
        """The directory a resume reads (None: no checkpoint yet): :meth:`resume`'s choice in a
        shared root, which is the mirror's copy where the local one is damaged; on node-local disks,
        :meth:`step_location` of the commit it resumes, or the mirror's copy it reads instead."""
        if self.node_local:
            try:
                candidate = self.candidate(damaged)
            except NoCheckpointYetError:
                return None
            if isinstance(candidate.target, NodeLocalCheckpoint):
                return self.step_location(candidate.target.step)
            return cast(Location, candidate.target)  # the mirror's copy (the disks' is damaged), or a ckptd.save's
        choice = self.resume(damaged).choice
        return None if choice is None else choice.entry.path

    def step_location(self, step: int) -> Location:
        """Where ``iter_<step>`` is read from: the local root, or the mirror when only it has the step.
        On an ``s3://`` root a step without its commit object is not committed (its metadata may be
        there already: a commit in flight, or one taken back) and raises CheckpointNotFoundError."""
        if self.mirror is not None and not committed_at(self.root, step) and committed_at(self.mirror, step):
            return join(self.mirror, step_dir_name(step))
        name = step_dir_name(step)
        if isinstance(self.root, S3Location) and read_s3_commit_record(S3Client(self.root), name) is None:
            raise CheckpointNotFoundError(
                f"{self.root.url(name)} is not a committed checkpoint: it has no commit object (a save in "
                "flight, or one that failed, whose objects the next daemon start or `ckptd gc` removes). "
                "Load a committed step (`ckptd ls` lists them)"
            )
        return join(self.root, name)

    def wait_mirrored(self, step: int, timeout_s: float) -> None:
        """Return once the mirror holds ``step`` committed as a copy of the commit of ``step`` the
        local root holds (:func:`ckptd.roots.mirror.copies_commit`; on node-local disks, as this
        node's disk records it); SaveTimeoutError after ``timeout_s``."""
        if self.mirror is None or not isinstance(self.root, Path):
            raise CheckpointNotFoundError(f"{self.root} has no mirror (config mirror='s3://bucket/prefix')")
        deadline = time.monotonic() + timeout_s
        client = S3Client(self.mirror)
        while (why := self._not_mirrored(step, self.root, self.mirror, client)) is not None:
            overtaken = _overtaken(step, self.root, client)
            if overtaken is not None:
                raise CheckpointNotFoundError(
                    f"step {step} will never be copied to the mirror {self.mirror}: the mirror copies only the newest "
                    f"local commit, and step {overtaken.step} (committed after it) was copied first; wait for step "
                    f"{overtaken.step} instead"
                )
            if time.monotonic() >= deadline:
                raise SaveTimeoutError(
                    f"step {step} was not copied to the mirror {self.mirror} within {timeout_s:.0f} s ({why}); the "
                    "coordinator's daemon status ('mirror' in Checkpointer.status() on node 0, or `ckptd "
                    "status`) says what the upload is doing or why it failed"
                )
            time.sleep(_POLL_S)

    def _not_mirrored(self, step: int, root: Path, mirror: S3Location, client: S3Client) -> str | None:
        """Why the ``mirror``'s ``iter_<step>`` is not a committed copy of the local ``root``'s
        commit of ``step`` (yet); None when it is."""
        name = step_dir_name(step)
        copy = read_s3_commit_record(client, name)
        if copy is None:
            return f"the mirror has no commit of step {step} yet"
        copied = CommitRef.copied_by(copy)
        local = _local_commit(root, step)
        left_behind = copied is not None and local is None and abandoned_commit(root, step, copied.seq)
        # A node's disk other than node 0's may hold an older commit of the step than node 0's
        # (its daemon missed the rename of a re-save): node 0's disk is the commit authority.
        lag = self.node_local and self.node != 0
        if not copies_commit(copied, local, left_behind_locally=left_behind, local_may_lag=lag):
            where = join(mirror, name)
            if copied is None:
                return f"{where} is not a copy of a local commit (its commit record names no source)"
            if local is None:
                return (
                    f"{where} copies commit {copied.attempt} (seq {copied.seq}) of {root}, which a rollback "
                    "there left behind"
                )
            return (
                f"{where} copies commit {copied.attempt} (seq {copied.seq}), not {local.attempt} (seq "
                f"{local.seq}), which {join(root, name)} holds: the step was saved again after a rollback, "
                "and the mirror, which copies only the newest local commit, has not copied it (never, once a "
                "newer step overtook it)"
            )
        if not committed_at(mirror, step):
            return f"{join(mirror, name)} is on a branch a rollback in the mirror left behind"
        return None


def _ref(choice: LatestChoice | None, commit: tuple[str, int] | None) -> CommitRef | None:
    """The commit a resolved checkpoint is: ``commit`` (attempt, seq) from its record (or, for a
    mirror's, the local commit it copies); none known: attempt "" (a checkpoint of ckptd.save,
    DCP or Megatron-Core, or a mirror's that copies nothing)."""
    if choice is None or choice.step is None:
        return None
    attempt, seq = commit if commit is not None else ("", 0)
    return CommitRef(step=choice.step, attempt=attempt, seq=seq)


def _mirror_copies_local(root: Path, mirror: S3Location, local: CommitRef, latest_copy_seq: int) -> bool:
    """Whether ``mirror`` held a copy of a commit of the local ``root`` before its latest copy
    (mirror commit ``latest_copy_seq``): of ``local`` (its latest intact one), or of the one its
    ``ckptd_mirrored`` names (the mirror's latest copy when the copier wrote it).

    A copy committed after the mirror's latest proves nothing of the latest's history: it is the
    copy of a replaced disk's first commits (numbered from 1 again), committed while the mirror's
    tracker still names the old disk's last copy."""
    commits = [local]
    named = read_mirrored(root)
    marked = CommitRef.of_record(None if named is None else read_commit_record(root / named))
    if marked is not None:
        commits.append(marked)
    client = S3Client(mirror)
    for commit in commits:
        copy = read_s3_commit_record(client, step_dir_name(commit.step))
        if copy is not None and copy.source == commit.source() and copy.seq <= latest_copy_seq:
            return True
    return False


def _overtaken(step: int, root: Path, client: S3Client) -> CommitRef | None:
    """The local commit the mirror's latest copy copies, when ``root`` holds it, committed after
    its commit of ``step``, and the mirror holds no copy of ``step`` (it never will); else None."""
    local = _local_commit(root, step)
    if local is None or read_s3_commit_record(client, step_dir_name(step)) is not None:
        return None
    name = read_s3_tracker(client)[1]
    latest = None if name is None else CommitRef.copied_by(read_s3_commit_record(client, name))
    # Seqs of one commit order only: the local root holds the commit the mirror's latest copies (a
    # replaced disk numbers its commits from 1 again, and its step would be copied next).
    if latest is None or latest.seq <= local.seq or _local_commit(root, latest.step) != latest:
        return None
    return latest


def _local_commit(root: Path, step: int) -> CommitRef | None:
    """The commit ``iter_<step>`` of ``root`` records (None: none, or no record)."""
    return CommitRef.of_record(read_commit_record(root / step_dir_name(step)))


def _local_holds(root: Path, commit: CommitRef) -> bool:
    return bool(commit.attempt) and _local_commit(root, commit.step) == commit


def _step_commit(root: Path, mirror: S3Location, step: int) -> CommitRef | None:
    """The commit of ``step`` node 0's disk (``root``) holds, else the one the mirror's copy
    records. Every commit is made on node 0's disk first, and a later commit of a step replaces the
    one there: a copy of another commit of the step is of an older one, or of an earlier numbering
    (a replaced disk numbers its commits from 1 again, so commit numbers cannot tell)."""
    name = step_dir_name(step)
    record = read_commit_record(root / name) if committed_at(root, step) else None
    if record is not None:
        return CommitRef(step=step, attempt=record.attempt, seq=record.seq)
    copy = read_s3_commit_record(S3Client(mirror), name)
    source = None if copy is None else copy.source
    return None if source is None else CommitRef(step=step, attempt=str(source["attempt"]), seq=int(source["seq"]))
