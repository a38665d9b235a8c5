"""Resuming from the latest intact checkpoint of a root (:meth:`ckptd.Checkpointer.load` without
``step``).

Order of one resume, on every rank:

1. :func:`ckptd.recovery.resolve_resumable` chooses the checkpoint (the tracker's, else the newest
   valid committed one), leaving out those a load already found damaged, on rank 0, and every
   rank takes its choice (ranks that each looked at the root could see it before and after a
   commit moved the tracker, and load different steps); on node-local disks,
   :meth:`ckptd.client.tiers.Levels.candidate` chooses (:func:`load_agreed`);
2. :func:`ckptd.load` loads it, holding a lease so that retention leaves it alone meanwhile;
3. with several ranks (torch.distributed initialized), the ranks gather every rank's outcome (an
   ``all_gather_object`` of a few bytes, as each agreement above is), so that they act alike: all
   return, all fall back, or all raise;
4. a checkpoint found damaged (a checksum mismatch, a damaged item: CorruptCheckpointError on any
   rank; items read only in part, onto another layout, are checked too: by their block
   checksums, or with ``verify_partial`` in checkpoints without them) is
   remembered as damaged, logged as a WARNING and step 1 runs again: the intact checkpoint
   committed last before it is loaded (the request is filled anew, so nothing of the damaged one
   stays in it); one removed or replaced while it was loaded (CheckpointRemovedError),
   or removed after it was chosen (CheckpointNotFoundError on every rank, and rank 0 finds its
   directory gone), is chosen again from the latest, once per name. Any other error is raised on
   every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..api import load as sync_load
from ..dist import DistContext, error_class
from ..errors import (
    CheckpointNotFoundError,
    CheckpointRemovedError,
    CorruptCheckpointError,
    LoadMismatchError,
    NoCheckpointYetError,
)
from ..loading.execute import LoadStats
from ..loading.strict import StrictHandling, parse_strict
from ..recovery import resolve_resumable
from ..s3catalog import checkpoint_exists
from ..storage.url import Location, join

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A checkpoint to try: its ``name`` (what ``damaged`` records: its directory's name, or its
    full path or URL where another level may hold a copy of it), what :func:`ckptd.load` opens,
    whether it still exists (asked on rank 0 after every rank failed with
    CheckpointNotFoundError), and what is loaded instead when it is found damaged (the warning's
    words)."""

    name: str
    target: Any
    exists: Callable[[], bool]
    fallback: str = "the intact one committed last before it"


def load_latest(
    root: Location,
    sharded_state_dict: Any,
    damaged: dict[str, str],
    rank: int,
    kwargs: dict[str, Any],
    loaded: list[Candidate] | None = None,
) -> Any:
    """Steps 1-4 above; ``damaged`` (checkpoint name -> what a load found) is updated in place.

    Raises NoCheckpointYetError when ``root`` has no committed checkpoint, and
    CorruptCheckpointError when checkpoints exist but none loads.
    """

    ctx = DistContext.current(kwargs.get("process_group"))

    def resolved() -> str | None:
        # The load that follows unpickles what .metadata names if the caller allows it: so may the check.
        choice = resolve_resumable(root, damaged=damaged, allow_unsafe_pickle=bool(kwargs.get("allow_unsafe_pickle")))
        return None if choice is None else choice.entry.name

    def choose() -> Candidate:
        name = ctx.agree("choosing the checkpoint to resume from", lambda: resolved() if ctx.rank == 0 else None)[0]
        if name is None:
            raise NoCheckpointYetError(f"{root} has no committed checkpoint yet")
        path = join(root, name)
        return Candidate(name, path, lambda: checkpoint_exists(path))

    return load_agreed(choose, sharded_state_dict, damaged, rank, kwargs, loaded)


def load_agreed(
    choose: Callable[[], Candidate],
    sharded_state_dict: Any,
    damaged: dict[str, str],
    rank: int,
    kwargs: dict[str, Any],
    loaded: list[Candidate] | None = None,
) -> Any:
    """Steps 2-4 above for the checkpoint ``choose()`` names (step 1), again after each one found
    damaged or removed; ``choose`` is called on every rank alike (it may be a collective).
    ``sharded_state_dict`` may be a function that makes it: called once, when a checkpoint was
    chosen (a failure in it fails the load on every rank, as a load's does)."""
    ctx = DistContext.current(kwargs.get("process_group"))
    made: list[Any] = [] if callable(sharded_state_dict) else [sharded_state_dict]
    # An item read only in part is checked too (by its blocks' checksums; in checkpoints without
    # them, by reading all of it): bit rot found here falls back to an intact checkpoint instead
    # of being resumed (README: Guarantees).
    kwargs = {"verify_partial": True, **kwargs}
    # Counts what each load copied into the request (the caller's stats, when given, accumulate).
    stats = kwargs.get("stats") or LoadStats()
    kwargs["stats"] = stats
    removed: set[str] = set()
    polluted_by: str | None = None  # the checkpoint whose failed load copied into the request, and why it failed
    while True:
        candidate = choose()
        name = candidate.name
        error: Exception | None = None
        result: Any = None
        copied_before = stats.bytes_copied
        try:
            if not made:
                # Agreed: a rank whose factory raised skipped the load's collectives the others
                # went into (strict="*_all" gathers the keys), and they paired with later ones.
                ctx.agree("making the state dict to load", lambda: made.append(sharded_state_dict()))
            result = sync_load(made[0], candidate.target, **kwargs)
        except Exception as exc:  # noqa: BLE001 - agreed on with the other ranks below
            error = exc
        # Whether this rank copied into the request: one that loaded all of a checkpoint another
        # rank found damaged holds its values as much as one that failed midway.
        wrote = stats.bytes_copied > copied_before
        gathered = ctx.all_gather((None if error is None else (type(error).__name__, str(error)), wrote))
        failed = [(r, o) for r, (o, _) in enumerate(gathered) if o is not None]
        if not failed:
            if loaded is not None:
                loaded.append(candidate)  # what was resumed (the caller's record of it)
            return result
        kinds = {error_class(o[0]) for _, o in failed}
        detail = "; ".join(f"rank {r}: {o[1]}" for r, o in failed)
        if any(issubclass(k, CorruptCheckpointError) for k in kinds):
            damaged[name] = detail
            log.warning(
                "rank %d: checkpoint %s is damaged (%s); falling back to %s",
                rank,
                candidate.target,
                detail,
                candidate.fallback,
            )
            if any(w for _, w in gathered):
                kwargs, polluted_by = _raising_unexpected(kwargs), polluted_by or f"the damaged {name}"
        elif (
            all(issubclass(k, CheckpointNotFoundError) for k in kinds)
            and name not in removed
            # removed or replaced while it was read (a re-save after a rollback replaces it)
            and (all(issubclass(k, CheckpointRemovedError) for k in kinds) or not _exists_on_rank0(ctx, candidate))
        ):
            removed.add(name)
            log.info("rank %d: %s was removed while it was being loaded; loading the latest again", rank, name)
            if any(w for _, w in gathered):  # the next latest may lack keys it filled, as after damage
                kwargs = _raising_unexpected(kwargs)
                polluted_by = polluted_by or f"{name}, removed or replaced while it was loaded"
        elif polluted_by is not None and all(issubclass(k, LoadMismatchError) for k in kinds):
            raise LoadMismatchError(
                f"loading {candidate.target} failed: {detail}. The resume fell back to it from "
                f"{polluted_by}, whose load had already filled part of the state dict: a key {name} lacks "
                f"would keep those values, so it is an error here whatever `strict` says. Load {name} "
                "explicitly into a state dict made anew"
            ) from error
        elif error is not None:
            raise error
        else:
            raise next(iter(kinds))(f"loading {candidate.target} failed on another rank: {detail}")


# Modes that skip a requested key the checkpoint lacks, leaving its value as it was.
_SKIPS_UNEXPECTED = (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL, StrictHandling.IGNORE_ALL)


def _raising_unexpected(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The load's arguments for a fallback past a damaged checkpoint whose load filled part of the
    request already: a requested key the older checkpoint lacks would keep the damaged one's
    value under a mode that skips such keys, so it raises LoadMismatchError instead.
    (The ``return_*`` modes keep theirs: they hand the caller the keys that were skipped.)"""
    strict = kwargs.get("strict")
    if strict is None or parse_strict(strict) not in _SKIPS_UNEXPECTED:
        return kwargs
    return {**kwargs, "strict": StrictHandling.RAISE_UNEXPECTED}


def _exists_on_rank0(ctx: DistContext, candidate: Candidate) -> bool:
    """Whether ``candidate`` still exists, as rank 0 finds it (every rank calls this)."""
    return bool(ctx.agree(f"looking for {candidate.name}", lambda: candidate.exists() if ctx.rank == 0 else True)[0])
