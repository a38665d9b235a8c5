"""The read side of a :class:`~ckptd.client.checkpointer.Checkpointer`: which commit of its root
(and of its mirror) is the latest, where it is, and loading it (a resume) or a given step.

A resume on several ranks is a collective (with torch.distributed initialized): rank 0 chooses the
checkpoint and every rank loads its choice, or none (``resume()``: None on every rank alike), so
ranks that each look while a commit lands never load different steps, and never one skips a load
the others wait in. Before choosing, a Checkpointer's resume waits for the saves an earlier launch
left with its node daemons that can still commit, and aborts those that cannot
(:mod:`ckptd.client.settle`). The decisions are :class:`~ckptd.client.tiers.Levels`'; this class
only keeps what a Checkpointer's loads found damaged, so later resumes skip it, and a save of
such a step may replace it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..api import load as sync_load
from ..catalog import WentBack
from ..errors import NoCheckpointYetError
from ..format.commitrecord import read_commit_record
from ..format.rootlayout import committed_step, step_dir_name
from ..recovery import structural_problem
from ..storage.url import Location, S3Location, join, parse_location
from .resume import Candidate
from .tiers import Levels


class RootReader:
    """Loads from a checkpoint root through its :class:`Levels` (the root, and its mirror)."""

    def __init__(self, root: Location, levels: Levels, rank: int) -> None:
        self.root = root
        self._levels = levels
        self._rank = rank
        self._damaged: dict[str, str] = {}  # checkpoint name -> the damage a load found in it
        # The step this Checkpointer last loaded, and when: the commits above it made before, a
        # branch the job left, which its saves of those steps replace (not on node-local disks:
        # _left_to_replace), and what its next commit descends from (ckptd.lineage).
        self._went_back: WentBack | None = None

    def latest(self) -> int | None:
        """The newest committed step, as the root's ``latest`` tracker names it (None: none yet).

        When the tracker is missing, unreadable or names a missing, incomplete or damaged
        checkpoint (also one a load of this Checkpointer found damaged), this is the newest valid
        committed step instead, and a warning is logged (see :func:`ckptd.recovery.resolve_latest`,
        which raises CorruptCheckpointError when checkpoints exist but none is loadable, and
        StorageError or UnknownClassError for one it cannot judge rather than pass it over). With a
        mirror, the mirror's latest copy when the local root lacks it. What this rank reads now:
        ranks that read while the previous launch's daemon finishes a commit can read different
        steps (resume with :meth:`resume`, on every rank). With ``node_local``, the step
        :meth:`load` resumes from, the same on every rank: a collective when torch.distributed is
        initialized (every rank calls it), since only node 0's disk knows the last commit.
        """
        if self._levels.node_local:
            return self._levels.resumed_step(self._damaged)
        return self._levels.resume(self._damaged).step

    def checkpoint_dir(self, step: int | None = None) -> Location:
        """Directory of ``step`` in the local root, else in the mirror when only it has the step;
        default: the one :meth:`load` resumes (the mirror's copy where the local one is damaged;
        ``node_local``: README, Two tiers; then, without ``step``, a collective: every rank calls
        it, as :meth:`latest`)."""
        where = self._levels.step_location(step) if step is not None else self._levels.resumed_location(self._damaged)
        if where is None:
            raise NoCheckpointYetError(f"{self.root} has no committed checkpoint yet")
        return where

    def load(self, sharded_state_dict: dict[str, Any], step: int | None = None, **kwargs: Any) -> Any:
        """:func:`ckptd.load` from ``step``; without it, from the latest intact committed checkpoint,
        falling back past damaged ones, every rank alike (:meth:`ckptd.client.tiers.Levels.load_resumed`;
        with torch.distributed initialized, a collective: rank 0 chooses); a Checkpointer first
        settles what an earlier launch left with its node daemons (:mod:`ckptd.client.settle`).
        With ``node_local``, every rank loads node 0's latest commit (or the mirror's latest copy,
        when newer), reading what its disk holds there and the rest from the mirror's copy
        (ckptd.storage.nodeview; README, Two tiers), and ``load(step=N)`` is a collective too (rank
        0 finds the commit). A Checkpointer's load first decides its lazy saves still copying: it
        writes into their tensors."""
        if step is not None:
            self._before_load(kwargs.get("process_group"), resume=False)
            self._await_saves_above(step)
            out = sync_load(sharded_state_dict, self._levels.step_target(step, kwargs.get("process_group")), **kwargs)
            self._loaded(step)
            return out
        return self._load_resumed(sharded_state_dict, kwargs)

    def _load_resumed(self, sharded_state_dict: Any, kwargs: dict[str, Any]) -> Any:
        self._before_load(kwargs.get("process_group"), resume=True)
        # A resume in the middle of a run (after a loss spike): this Checkpointer's saves in flight
        # land first, so that it resumes the newest commit; one landing after the load would be a
        # step of a branch the job left, and the job's own save of it refused.
        self._await_saves_above(-1, resume=True)
        loaded: list[Candidate] = []
        out = self._levels.load_resumed(sharded_state_dict, self._damaged, self._rank, kwargs, loaded)
        # Below the newest commit when it fell back past damaged ones, or when the tracker was set
        # back by hand: the steps above it are a branch the job left, as after load(step=N). (A
        # candidate's name ends in its directory's: a name, a path or a URL.)
        step = committed_step(parse_location(loaded[-1].name).name) if loaded else None
        self._went_back = None
        if step is not None:
            self._loaded(step)
        return out

    def _loaded(self, step: int) -> None:
        """A load of ``step`` (every rank loads the same: ``load(step=N)`` on each, or a resume,
        whose checkpoint rank 0 chooses for all): what this Checkpointer's saves tell the
        coordinator from now on (ckptd.catalog.WentBack)."""
        self._went_back = WentBack(step=step, before_unix_s=time.time())

    def _left_to_replace(self) -> WentBack | None:
        """What this Checkpointer loaded, where its saves replace the steps it left above it
        (ckptd.catalog.RootCatalog.superseded); None on node-local disks, where the other nodes'
        copies of a replaced step would stay."""
        return None if self._levels.node_local else self._went_back

    def resume(self, sharded_state_dict: dict[str, Any] | Callable[[], dict[str, Any]], **kwargs: Any) -> Any | None:
        """:meth:`load` of the latest intact committed checkpoint, or None on every rank alike when
        there is none yet (a fresh start). Call it on every rank, instead of ``load()`` after
        ``latest() is not None``: each rank reads ``latest()`` on its own, and while the previous
        launch's daemon finishes its first commit one rank can read None and skip the load the
        others wait in. ``sharded_state_dict`` may be a function that makes it, called once the
        checkpoint to load is chosen, never on a fresh start (``get_state_dict`` initializes a
        fresh optimizer's state by taking a step)."""
        try:
            return self._load_resumed(sharded_state_dict, kwargs)
        except NoCheckpointYetError:
            return None

    def _await_saves_above(self, step: int, *, resume: bool = False) -> None:
        """Before a load of ``step`` (or a ``resume``): nothing without saves; a Checkpointer waits
        (briefly) for its saves of higher steps in flight."""

    def _before_load(self, group: Any, *, resume: bool) -> None:
        """Before a load (a ``resume`` chooses its checkpoint after it, as a collective on
        ``group``): nothing to do without saves; a Checkpointer settles its own and its daemons'."""

    def wait_mirrored(self, step: int, timeout_s: float = 600.0) -> None:
        """With a mirror (config ``mirror="s3://..."``): return once ``step`` is committed in the
        object store too (a local commit is copied in the background, newest first, so a step that
        a newer one overtook before its copy started is never mirrored); SaveTimeoutError after
        ``timeout_s``."""
        self._levels.wait_mirrored(step, timeout_s)

    def _replaces_damaged(self, step: int) -> bool:
        """Whether a save of ``step``, committed already in a directory root, goes to the
        coordinator anyway: the commit is ckptd's and structurally damaged (a data file lost or
        cut short). The coordinator checks again and replaces it only then
        (ckptd.roots.posix.damaged_commit). (One above the step this Checkpointer last loaded,
        committed before that load, goes anyway: see :class:`ckptd.catalog.WentBack`.)"""
        if isinstance(self.root, S3Location) or self._levels.node_local:
            return False
        path = join(self.root, step_dir_name(step))
        if not isinstance(path, Path) or read_commit_record(path) is None:
            return False  # not ckptd's commit: never replaced
        try:
            return structural_problem(path, damage_only=True) is not None
        except Exception:  # noqa: BLE001 - removed or unreadable meanwhile: refused as committed
            return False


def forget_damage(damaged: dict[str, str], root: Location, name: str) -> None:
    """A save committed ``name`` anew (replacing a damaged one): what a load found in the old one
    (``damaged``, by name or by path) is no longer true of the checkpoint under that name."""
    damaged.pop(name, None)
    damaged.pop(str(join(root, name)), None)
