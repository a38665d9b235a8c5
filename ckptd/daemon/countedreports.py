"""Which reports each recent commit counted: what lets the coordinator answer a resend from memory.

A node resends its WRITTEN when a verdict does not come (it was lost on its way). By then retention
or a rollback may have retired the commit, so the root no longer tells. Each WRITTEN names its save
by the SAVE's random seal (``Written.report_id``); the coordinator keeps, per commit, the ids of the
reports it counted, and its verdict:

- a report whose id a commit counted is a resend: answered with that commit, whatever came since
  (another commit of the same attempt id too: each is kept);
- a report of a remembered attempt with another id is a new save (a relaunch repeated the attempt
  id): collected anew, never answered from memory; so is a FAILED of a rank (every rank of a
  commit wrote);
- unknown (no ids kept, no id in the report, a node's FAILED of rank -1): the root is asked, as
  before ids existed.

Kept: at least the last :data:`COUNTED_MEMORY` commits, and every one younger than a node's
resends can come (``commit_timeout_s + 2 * coordinator_timeout_s``), at most
:data:`COUNTED_MEMORY_MAX`; 8 bytes a rank each. Pure: the time comes from the caller.
"""

from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict

from ..control.protocol import Failed, StepCommitted, Written

COUNTED_MEMORY = 64
COUNTED_MEMORY_MAX = 1024
Key = tuple[int, str]  # (step, attempt)


class CountedReports:
    """The ids of the reports each recent commit counted (see the module docstring)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # By attempt, its commits (a repeated attempt id may commit again): ids, verdict, when.
        self._by_key: OrderedDict[Key, list[tuple[array[int], StepCommitted, float]]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(commits) for commits in self._by_key.values())

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def remember(self, key: Key, ids: set[int], outcome: StepCommitted, now: float) -> None:
        """Attempt ``key`` committed (``outcome``) at ``now``, counting the reports ``ids``."""
        self._by_key.setdefault(key, []).append((array("Q", sorted(ids)), outcome, now))
        self._by_key.move_to_end(key)
        while len(self) > COUNTED_MEMORY_MAX or (
            len(self) > COUNTED_MEMORY and next(iter(self._by_key.values()))[-1][2] < now - self.window_s
        ):
            oldest = next(iter(self._by_key))
            commits = self._by_key[oldest]
            commits.pop(0)
            if not commits:
                del self._by_key[oldest]

    def counted(self, msg: Written | Failed) -> bool | None:
        """Whether a remembered commit of ``msg``'s attempt counted this very report: True (a
        resend), False (a new save's report), None (unknown; see the module docstring)."""
        commits = self._by_key.get((msg.step, msg.attempt))
        if commits is None:
            return None
        if isinstance(msg, Failed):
            return False if msg.rank >= 0 else None
        if not msg.report_id:
            return None
        return self._commit_of(commits, msg.report_id) is not None

    def outcome(self, msg: Written | Failed) -> StepCommitted:
        """The verdict of the remembered commit that counted ``msg`` (:meth:`counted` is True)."""
        found = self._commit_of(self._by_key[(msg.step, msg.attempt)], msg.report_id if isinstance(msg, Written) else 0)
        if found is None:
            raise KeyError(f"no commit of step {msg.step} attempt {msg.attempt} counted this report")
        return found

    @staticmethod
    def _commit_of(commits: list[tuple[array[int], StepCommitted, float]], report_id: int) -> StepCommitted | None:
        for ids, outcome, _ in commits:
            at = bisect.bisect_left(ids, report_id)
            if at < len(ids) and ids[at] == report_id:
                return outcome
        return None
