"""Listing a checkpoint root: committed, partial and half-deleted checkpoints, and the tracker.

A *root* is where an asynchronous Checkpointer saves a series of checkpoints; the names of what
it holds (the ``latest`` tracker, ``iter_<step>`` directories, ``.tmp`` attempts, ``.deleting``
leftovers of gc) are :mod:`ckptd.format.rootlayout`'s. A single checkpoint directory (written by
``ckptd.save``, torch DCP or Megatron-Core) holds ``metadata.json``, ``common.pt``, ``.metadata``
and ``__<rank>_<n>.distcp`` files. :func:`resolve_target` tells the two apart for the command-line
tools.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from .format.commitrecord import commit_seq, copied_commit, read_commit_record_checked
from .format.layout import COMMON_PT, DATA_SUFFIX, DCP_METADATA, METADATA_JSON
from .format.rootlayout import (
    MEGATRON_TRACKER,
    MIRRORED_FILE,
    STEP_PREFIX,
    TRACKER_FILE,
    TRACKER_MAX_NBYTES,
    is_node_lock,
    megatron_tracker_name,
    node_lock_name,
    parse_step_dir,
    step_dir_name,
)
from .format.safefs import entry_exists, is_real_dir, is_regular_file, read_regular
from .lineage import Link, WentBack, ancestry, copy_parent, left_behind, left_by, off_lineage, parent_of
from .storage.url import Location

log = logging.getLogger(__name__)


class EntryState(str, enum.Enum):
    COMMITTED = "committed"  # final name and metadata.json (or a DCP .metadata): loadable
    INCOMPLETE = "incomplete"  # final name but no marker: damaged or written by hand
    PARTIAL = "partial"  # *.tmp: in flight or abandoned
    DELETING = "deleting"  # *.deleting: a gc run was interrupted


@dataclass(frozen=True)
class DirUsage:
    nbytes: int
    files: int
    newest_mtime: float  # of the directory and everything in it: the last write activity


def dir_usage(path: Path) -> DirUsage:
    """Bytes, file count and newest mtime under ``path`` (files vanishing meanwhile are skipped)."""
    nbytes = files = 0
    try:
        newest = path.stat().st_mtime
    except FileNotFoundError:
        return DirUsage(0, 0, 0.0)
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                st = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
            except FileNotFoundError:
                continue
            nbytes += st.st_size
            files += 1
            newest = max(newest, st.st_mtime)
    return DirUsage(nbytes, files, newest)


@dataclass
class CheckpointEntry:
    name: str
    path: Path
    step: int
    state: EntryState
    usage: DirUsage
    is_latest: bool = False
    # Its commit record's: its place in commit order (ckptd.format.commitrecord); also of one whose
    # markers are gone (incomplete), whose number the next commit's must pass all the same.
    commit_seq: int = 0
    committed_unix_s: float = 0.0  # ones with a commit record: when they were committed
    # Why its commit record, which is there, cannot be read (damaged, an I/O error): its place in
    # commit order is unknown. Nothing moves the tracker past it, takes it for abandoned, retires
    # it or numbers a commit after it on a guess (it sorts as seq 0 otherwise).
    record_problem: str | None = None
    # record_problem is the storage failing to return it (StorageError): the record may be intact,
    # and read next time.
    record_unreadable: bool = False
    # Its record's: the attempt it committed, the commit it descends from (ckptd.lineage; None: not
    # recorded), and for a mirror's copy the local commit it copies (its seq in the local root and
    # its attempt: a local root lost and begun again numbers from 1 again).
    attempt: str = ""
    parent_seq: int | None = None
    source: tuple[int, str] | None = None

    @property
    def commit_order(self) -> tuple[int, int]:
        """Sort key of committed checkpoints, oldest commit first: the commit record's sequence
        number, then (for checkpoints without one) the step."""
        return (self.commit_seq, self.step)


@dataclass
class RootCatalog:
    """Every step directory of a root, in step order, plus what the tracker says."""

    root: Path
    entries: list[CheckpointEntry] = field(default_factory=list)
    tracker_exists: bool = False
    latest_name: str | None = None
    # Why the tracker cannot be trusted (unreadable, names a missing or uncommitted checkpoint).
    tracker_problem: str | None = None
    others: list[str] = field(default_factory=list)  # unrelated names in the root
    mirrored_name: str | None = None  # the step the mirror's latest copies (MIRRORED_FILE), if any
    # A node's disk of a node-local root (ckptd.roots.nodelocal): its commit records list every
    # rank's data file, on whichever node it is; or, before its first commit, it holds another
    # node's lock file but not node 0's (ckptd.daemon.rootlock: a shared root holds node 0's).
    node_local: bool = False
    # The step Megatron-LM's tracker names, as a directory name (a root Megatron-LM wrote, also
    # after ckptd did); gc keeps it (Megatron-LM resumes it).
    megatron_latest_name: str | None = None

    @property
    def committed(self) -> list[CheckpointEntry]:
        return [e for e in self.entries if e.state is EntryState.COMMITTED]

    @property
    def newest_first(self) -> list[CheckpointEntry]:
        """Committed checkpoints, the last committed first (commit order, not step order: a
        rollback commits a lower step after a higher one)."""
        return sorted(self.committed, key=lambda e: e.commit_order, reverse=True)

    @property
    def highest_commit_seq(self) -> int:
        """The highest commit number the root's commit records hold (0: none), also those of
        checkpoints whose markers are gone (restored, one would pass for the newest commit)."""
        return max((e.commit_seq for e in self.entries), default=0)

    def unknown_commit_number(self) -> CheckpointEntry | None:
        """A checkpoint whose commit record is there but cannot be read: its number, which may be
        the highest, is unknown, and so is the next commit's (:func:`ckptd.roots.posix.next_commit_seq`
        refuses to guess: a commit that repeated a number ordered the two by step, and after a
        rollback the step the job left passed for the newest)."""
        return next(
            (
                e
                for e in self.entries
                if e.record_problem is not None and e.state in (EntryState.COMMITTED, EntryState.INCOMPLETE)
            ),
            None,
        )

    @property
    def branch_first(self) -> list[CheckpointEntry]:
        """:attr:`newest_first` with the checkpoints of branches a rollback abandoned last: a
        fallback past a damaged latest, and retention's count of the last commits, take the
        checkpoints of the branch the job trains on first, never one the job rolled back from
        before the step it rolled back to. The branch is the tracker's target's, also when that
        checkpoint was found damaged (ckptd.recovery); without one, this is commit order."""
        off = {e.name for e in self.off_branch()}
        return [e for e in self.newest_first if e.name not in off] + [e for e in self.newest_first if e.name in off]

    def off_branch(self) -> list[CheckpointEntry]:
        """The committed checkpoints on branches a rollback abandoned, seen from the tracker's
        target, whether or not that target is loadable; none without one. Those committed before
        it that are not its ancestors, by the parent links of their commit records
        (:func:`ckptd.lineage.off_lineage`; where the links end, by the older rule: a higher step
        committed before, :func:`~ckptd.lineage.left_behind`). On a node-local disk also those of
        an earlier numbering, left by versions whose node 0
        numbered its commits by its own disk alone (a replaced one from 1 again; node 0 now numbers
        above every node's disk: ckptd.roots.posix.commit_step): below the step the job resumed
        from they have a lower step, a higher number and an earlier time than the tracker's
        target. All three: a commit the tracker has not caught up with (a rollback's, renamed into
        place before its daemon died) has a lower step and a higher number too, but a later time;
        and clocks step."""
        named = next((e for e in self.entries if e.name == self.latest_name and e.commit_seq), None)
        if named is None:
            return []
        left = {e.name for e in off_lineage(named, self._linked())}
        return [
            e
            for e in self.committed
            if e.record_problem is None
            and (
                e.name in left
                or (
                    self.node_local
                    and e.step < named.step
                    and e.commit_seq > named.commit_seq
                    and e.committed_unix_s + _RENUMBERED_SLACK_S < named.committed_unix_s
                )
            )
        ]

    def parent_of(self, step: int, went_back: WentBack | None, *, agreed: bool) -> CheckpointEntry | None:
        """The commit a new commit of ``step`` descends from (:func:`ckptd.lineage.parent_of`),
        among the committed checkpoints with readable records but ``iter_<step>`` (one the commit
        replaces)."""
        name = step_dir_name(step)
        recorded = [e for e in self.committed if e.commit_seq > 0 and e.record_problem is None and e.name != name]
        seq = parent_of(recorded, step, went_back, agreed=agreed)
        return next((e for e in recorded if e.commit_seq == seq), None)

    def copy_parent(self, source_chain: frozenset[tuple[int, str]], step: int) -> CheckpointEntry | None:
        """A mirror's copy that a new copy of a local commit of ``step`` descends from
        (:func:`ckptd.lineage.copy_parent`; ``source_chain``: that commit's known ancestors in the
        local root, and itself, as (seq, attempt))."""
        copies = [e for e in self.committed if e.source is not None and e.record_problem is None and e.commit_seq]
        seq = copy_parent(((e.commit_seq, e.source, e.step) for e in copies if e.source), source_chain, step)
        return next((e for e in copies if e.commit_seq == seq), None)

    def left_by_commit(self, step: int, seq: int, parent: CheckpointEntry | None) -> list[CheckpointEntry]:
        """The committed checkpoints on the tracker's branch that a new commit of ``step``
        (number ``seq``, descending from ``parent``) leaves on a branch a rollback abandoned."""
        if parent is None:
            return []
        name = step_dir_name(step)
        new = Link(commit_seq=seq, step=step, parent_seq=parent.commit_seq)
        before = {e.name for e in self.off_branch()}
        left = off_lineage(new, [e for e in self._linked() if e.name != name])
        return [e for e in left if e.state is EntryState.COMMITTED and e.name not in before]

    def chain_of(self, seq: int) -> frozenset[tuple[int, str]]:
        """The commit numbered ``seq`` and its known ancestors (:func:`ckptd.lineage.ancestry`), as
        (seq, attempt): a mirror's copy names both of the commit it copies; empty when no such
        commit is here."""
        linked = self._linked()
        entry = next((e for e in linked if e.commit_seq == seq), None)
        if entry is None:
            return frozenset()
        chain = ancestry(entry, linked).chain
        return frozenset((e.commit_seq, e.attempt) for e in linked if e.commit_seq in chain)

    def _linked(self) -> list[CheckpointEntry]:
        """The links of a lineage: checkpoints whose commit records are read, also those whose
        markers are gone. One without a record (ckptd.save's, another tool's) has no place in
        commit order: never taken for one a rollback left (as :func:`_left_commit`)."""
        return [
            e
            for e in self.entries
            if e.commit_seq > 0
            and e.record_problem is None
            and e.state in (EntryState.COMMITTED, EntryState.INCOMPLETE)
        ]

    def latest(self) -> CheckpointEntry | None:
        """The entry the tracker names, when it names a committed checkpoint."""
        for e in self.entries:
            if e.is_latest and e.state is EntryState.COMMITTED:
                return e
        return None

    def abandoned(self, step: int) -> CheckpointEntry | None:
        """The committed ``iter_<step>`` when a rollback abandoned it: the tracker names a
        checkpoint of a lower step that was committed after it (the job resumed from an earlier
        step and saved again). None when there is no such checkpoint, when it is on the current
        branch, or when the tracker cannot be trusted (nothing is taken for abandoned then). Only
        steps above the tracker's (a save of one the new branch reaches again replaces it): for
        them the parent links say what this rule says (ckptd.lineage), and a save of a lower step
        of a left branch is a step committed once."""
        latest = self.latest()
        if latest is None or self.tracker_problem is not None:
            return None
        for e in self.committed:
            if (
                e.step == step
                and e is not latest
                and e.record_problem is None
                and left_behind(step, e.commit_seq, latest.step, latest.commit_seq)
            ):
                return e
        return None

    def superseded(self, step: int, went_back: WentBack | None) -> CheckpointEntry | None:
        """The committed ``iter_<step>`` a save of that step replaces: one a rollback abandoned
        (:meth:`abandoned`), or, from a job that went back (``went_back``), one of a step above
        the one it went back to that was committed before it did. None when there is none (the
        save is refused: a step is committed once)."""
        found = self.abandoned(step)
        if found is not None or went_back is None or step <= went_back.step or self.left_between(step, went_back):
            return found
        for e in self.committed:
            if e.step == step and _left_commit(e, went_back):
                return e
        return None

    def left_between(self, step: int, went_back: WentBack | None) -> list[str]:
        """Commits a job that ``went_back`` left between the step it loaded and ``step``: its save
        of ``step`` does not replace that step's commit while they are there. The new commit
        abandons the left steps above it (a lower step committed after them), not those below,
        which would then pass for the new branch's ancestors (retention keeping them over the step
        it went back to, a fallback resuming them): saved again first (each replaced in turn), or
        removed by hand, they are not."""
        if went_back is None:
            return []
        return [e.name for e in self.committed if went_back.step < e.step < step and _left_commit(e, went_back)]


def is_checkpoint_dir(path: Path) -> bool:
    """True when ``path`` has a checkpoint marker (``metadata.json`` or a DCP ``.metadata``) that is
    a regular file itself: a link is never followed out of a checkpoint (ckptd.format.safefs)."""
    return is_regular_file(path / METADATA_JSON) or is_regular_file(path / DCP_METADATA)


def looks_like_checkpoint_dir(path: Path) -> bool:
    """A checkpoint, possibly damaged: a marker, ``common.pt`` or any data file (of any kind: a
    reader then names what is wrong with it)."""
    if any(entry_exists(path, n) for n in (METADATA_JSON, DCP_METADATA, COMMON_PT)):
        return True
    try:
        return any(n.endswith(DATA_SUFFIX) for n in os.listdir(path))
    except OSError:
        return False


def read_tracker(root: Path) -> tuple[bool, str | None, str | None]:
    """``(exists, name, problem)`` of ``root/latest``; ``name`` is a single directory name."""
    path = root / TRACKER_FILE
    try:
        raw = read_regular(root, TRACKER_FILE, "tracker", TRACKER_MAX_NBYTES)
    except FileNotFoundError:
        return False, None, None
    except (OSError, CorruptCheckpointError) as exc:
        return True, None, f"tracker {path} cannot be read ({exc})"
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return True, None, f"tracker {path} is not UTF-8 text; it is damaged"
    if not name or "/" in name or name in (".", "..") or "\n" in name:
        return True, None, f"tracker {path} holds {raw[:80]!r}, not a checkpoint directory name"
    return True, name, None


def read_megatron_tracker(root: Path) -> str | None:
    """The directory Megatron-LM's tracker (``latest_checkpointed_iteration.txt``) names: the
    ``iter_<step>`` of the number it holds, or ``release``; None when absent or not such text."""
    try:
        raw = read_regular(root, MEGATRON_TRACKER, "Megatron-LM tracker", TRACKER_MAX_NBYTES)
    except (OSError, CorruptCheckpointError):
        return None
    return megatron_tracker_name(raw)


def abandoned_after(latest_name: str | None, step: int, seq: int, latest_seq: Callable[[str], int]) -> bool:
    """Whether a commit of ``step`` with commit sequence number ``seq`` is on a branch a rollback
    abandoned, from the trusted tracker's target alone (:meth:`RootCatalog.abandoned` without
    listing the root): it names a lower step that was committed after it (``latest_seq(name)``:
    that checkpoint's sequence number, 0 without a record). ``latest_name``: None when there is no
    tracker to trust."""
    parsed = None if latest_name is None else parse_step_dir(latest_name)
    if latest_name is None or parsed is None or parsed.partial or parsed.deleting or parsed.step >= step:
        return False  # not a lower step: no record to read
    return left_behind(step, seq, parsed.step, latest_seq(latest_name))


def abandoned_commit(root: Path, step: int, seq: int) -> bool:
    """:func:`abandoned_after` of a directory root: two small reads, not a scan."""
    _, name, problem = read_tracker(root)
    return abandoned_after(None if problem else name, step, seq, lambda n: commit_seq(root / n))


def read_mirrored(root: Path) -> str | None:
    """The step directory name :data:`MIRRORED_FILE` holds; None without one, or an unusable one
    (retention then keeps nothing extra)."""
    try:
        name = read_regular(root, MIRRORED_FILE, "mirror marker", TRACKER_MAX_NBYTES).decode("utf-8").strip()
    except (OSError, CorruptCheckpointError, UnicodeDecodeError):
        return None
    parsed = parse_step_dir(name)
    return name if parsed is not None and not parsed.partial and not parsed.deleting else None


def scan_root(root: str | os.PathLike, *, usage: bool = True) -> RootCatalog:
    """List ``root``: step directories with state, commit order, size and age (``usage``: walks
    every directory), and the tracker's target."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root} is not a directory")
    cat = RootCatalog(root)
    cat.tracker_exists, cat.latest_name, cat.tracker_problem = read_tracker(root)
    # Read also next to ckptd's own: a root Megatron-LM saved into after ckptd did resumes from it.
    cat.megatron_latest_name = read_megatron_tracker(root)
    cat.mirrored_name = read_mirrored(root)
    names = sorted(os.listdir(root))
    locks = {name for name in names if is_node_lock(name)}
    cat.node_local = bool(locks) and node_lock_name(0) not in locks
    for name in names:
        path = root / name
        parsed = parse_step_dir(name)
        # A link named like a step is not one: loading, resuming or collecting it would act on
        # whatever it points to, outside the root.
        if parsed is None or not is_real_dir(path):
            if (
                name not in (TRACKER_FILE, MIRRORED_FILE)
                and not name.startswith((TRACKER_FILE + ".", MIRRORED_FILE + "."))
                and not is_node_lock(name)
            ):
                cat.others.append(name)
            continue
        if parsed.partial:
            state = EntryState.PARTIAL
        elif parsed.deleting:
            state = EntryState.DELETING
        else:
            state = EntryState.COMMITTED if is_checkpoint_dir(path) else EntryState.INCOMPLETE
        # The record of one whose markers are gone too: the tracker's target's tells which branch
        # the job trains on (RootCatalog.off_branch), which a fallback past it must keep to; and
        # the next commit is numbered above each (RootCatalog.highest_commit_seq).
        record, record_problem, unreadable = None, None, False
        if state in (EntryState.COMMITTED, EntryState.INCOMPLETE):
            try:
                record = read_commit_record_checked(path)
            except (CorruptCheckpointError, StorageError) as exc:
                log.warning("%s; its place in commit order is unknown: it is neither retired nor passed over", exc)
                record_problem, unreadable = str(exc), isinstance(exc, StorageError)
        cat.node_local = cat.node_local or (record is not None and record.objects is not None)
        cat.entries.append(
            CheckpointEntry(
                name,
                path,
                parsed.step,
                state,
                dir_usage(path) if usage else DirUsage(0, 0, 0.0),
                is_latest=name == cat.latest_name,
                commit_seq=0 if record is None else record.seq,
                committed_unix_s=0.0 if record is None else record.committed_unix_s,
                record_problem=record_problem,
                record_unreadable=unreadable,
                attempt="" if record is None else record.attempt,
                parent_seq=None if record is None else record.parent_seq,
                source=copied_commit(record),
            )
        )
    cat.entries.sort(key=lambda e: (e.step, e.name))
    if cat.latest_name is not None and cat.tracker_problem is None:
        target = root / cat.latest_name
        if os.path.islink(target):
            cat.tracker_problem = (
                f"tracker {root / TRACKER_FILE} names {cat.latest_name!r}, which is a "
                "symbolic link; ckptd never follows a link inside a checkpoint root"
            )
        elif not target.is_dir():
            cat.tracker_problem = (
                f"tracker {root / TRACKER_FILE} names {cat.latest_name!r}, which does "
                "not exist; restore it or rewrite the tracker"
            )
        elif not is_checkpoint_dir(target):
            cat.tracker_problem = (
                f"tracker {root / TRACKER_FILE} names {cat.latest_name!r}, which is "
                f"not a complete checkpoint ({METADATA_JSON} is missing)"
            )
        elif parse_step_dir(cat.latest_name) is None:
            # A committed checkpoint outside the iter_<step> naming: still list it, it is what loads.
            cat.entries.append(
                CheckpointEntry(
                    cat.latest_name,
                    target,
                    -1,
                    EntryState.COMMITTED,
                    dir_usage(target) if usage else DirUsage(0, 0, 0.0),
                    is_latest=True,
                    commit_seq=commit_seq(target),
                )
            )
            if cat.latest_name in cat.others:
                cat.others.remove(cat.latest_name)
    return cat


def tracker_set_back(cat: RootCatalog, tracker_written_unix_s: float | None) -> str | None:
    """Why the tracker is taken to have been set back on purpose (a rollback by hand: Megatron-LM
    users rewrite it), or None: it names a commit two or more commits before the newest, and was
    written after the newest was committed (``tracker_written_unix_s``: its modification time;
    None: unknown). A commit a crash interrupted between its rename and its tracker leaves the
    tracker one commit behind (two, after an earlier commit whose tracker could not be written
    either), written before that commit; a coordinator start moves it forward
    (ckptd.roots.posix.finish_interrupted_commit)."""
    current = cat.latest()
    ordered = [e for e in cat.newest_first if e.record_problem is None and e.step >= 0]
    if current is None or current.record_problem is not None or not ordered or ordered[0] is current:
        return None
    behind = next((i for i, e in enumerate(ordered) if e is current), None)
    if behind is None or behind == 1 or tracker_written_unix_s is None:
        return None
    if tracker_written_unix_s <= ordered[0].committed_unix_s + _CLOCK_SLACK_S:
        return None
    return (
        f"the tracker names {current.name}, {behind} commits before the newest ({ordered[0].name}): taken "
        "for a rollback by hand, not for an interrupted commit, and left as it is"
    )


# A commit numbered above the tracker's target but made this much before it is of an earlier
# numbering (RootCatalog.off_branch): a replaced disk's first commit comes a relaunch after the old
# disk's last; within one numbering only a clock stepped back that far could do that.
_RENUMBERED_SLACK_S = 60.0

# Between a file's modification time (the file system's clock) and a commit record's time (the
# committing daemon's): what tells a tracker written after a commit from one written before it.
_CLOCK_SLACK_S = 1.0


def _left_commit(e: CheckpointEntry, went_back: WentBack) -> bool:
    """:func:`left_by` of a commit of ckptd's (its record readable): a checkpoint another tool
    wrote (no record, no commit time) is never taken for one a job left, so never replaced (a
    resume that passed over one ckptd cannot read, a Megatron-Core zarr step, would otherwise
    have let the job's save of its step delete it)."""
    return e.commit_seq > 0 and e.record_problem is None and left_by(went_back, e.step, e.committed_unix_s)


def committed_once(root: str | os.PathLike, step: int, went_back: WentBack | None = None) -> bool:
    """``iter_<step>`` of ``root`` is committed and may not be saved again: it exists and is not a
    checkpoint a new save of the step replaces (:meth:`RootCatalog.superseded`: of a branch a
    rollback abandoned, or one the saving job went back from)."""
    if not os.path.lexists(Path(root) / step_dir_name(step)):
        return False
    return scan_root(root, usage=False).superseded(step, went_back) is None


@dataclass(frozen=True)
class Target:
    """What a path given on the command line is: one checkpoint, or a root of several."""

    path: Location  # a directory, or an s3:// prefix
    is_root: bool


def resolve_target(path: str | os.PathLike) -> Target:
    """Classify ``path``; raise CheckpointNotFoundError when it is neither kind.

    A directory with a checkpoint marker, ``common.pt`` or data files is a checkpoint (maybe a
    damaged one); one with a tracker or step directories is a root.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is a file; pass a checkpoint directory or a checkpoint root directory")
    if looks_like_checkpoint_dir(path):
        return Target(path, is_root=False)
    if entry_exists(path, TRACKER_FILE) or any(parse_step_dir(n) for n in os.listdir(path)):
        return Target(path, is_root=True)
    raise CheckpointNotFoundError(
        f"{path} is neither a checkpoint (no {METADATA_JSON}, {DCP_METADATA} or data files) nor a "
        f"checkpoint root (no '{TRACKER_FILE}' tracker or {STEP_PREFIX}* directories)"
    )
