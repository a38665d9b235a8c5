"""What the coordinator asks the root before it decides on a report (ckptd.daemon.commitstate's
:class:`~ckptd.daemon.commitevents.RootFacts`), asked on a worker thread: the loop never waits for
storage.

A :class:`Question` is plain data computed on the loop from the state machine
(:meth:`CommitState.asks_holds_commit`, :meth:`CommitState.may_start` for both possible answers),
so :func:`answer` reads nothing but the root.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..catalog import WentBack
from ..roots.base import RootStore
from .commitevents import RootFacts


@dataclass(frozen=True, kw_only=True)
class Question:
    step: int
    attempt: str
    holds_commit: bool  # ask whether iter_<step> is still committed by this (remembered) attempt
    committed_once_if_held: bool  # then ask whether the step is committed already, if it holds ...
    committed_once_if_not: bool  # ... or if it does not (or was not asked)
    went_back: WentBack | None = None  # the report's: a step its job left is neither held nor committed once

    @property
    def asks(self) -> bool:
        return self.holds_commit or self.committed_once_if_held

    def unknown(self) -> RootFacts:
        """The facts when the root could not answer: a remembered commit stands, and the step is
        taken as not committed (the commit itself refuses a committed step)."""
        return RootFacts(known=False)


def answer(store: RootStore, q: Question) -> RootFacts:
    """Ask ``store`` (on a worker thread)."""
    holds = store.holds_commit(q.step, q.attempt, q.went_back) if q.holds_commit else True
    starts = q.committed_once_if_held if holds else q.committed_once_if_not
    return RootFacts(holds_commit=holds, committed_once=starts and store.committed_once(q.step, q.went_back))
