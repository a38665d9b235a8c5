"""Which reports each recent commit counted: what lets the coordinator answer a resend from memory.

A node resends its WRITTEN when a verdict does not come (it was lost on its way). By then retention
or a rollback may have retired the commit, so the root no longer tells. Each WRITTEN names its save
by the SAVE's random seal (``Written.report_id``); the coordinator keeps, per commit, the ids of the
reports it counted, and its verdict:

- a report whose id a commit counted is a resend: answered with that commit, whatever came since;
- a report of a remembered attempt with another id is a new save (a relaunch repeated the attempt
  id): collected anew, never answered from memory;
- unknown (no ids kept, no id in the report): the root is asked, as before ids existed.

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
        self._by_key: OrderedDict[Key, tuple[array[int], StepCommitted, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def remember(self, key: Key, ids: set[int], outcome: StepCommitted, now: float) -> None:
        """Attempt ``key`` committed (``outcome``) at ``now``, counting the reports ``ids``."""
        self._by_key[key] = (array("Q", sorted(ids)), outcome, now)
        self._by_key.move_to_end(key)
        while len(self._by_key) > COUNTED_MEMORY_MAX or (
            len(self._by_key) > COUNTED_MEMORY and next(iter(self._by_key.values()))[2] < now - self.window_s
        ):
            self._by_key.popitem(last=False)

    def counted(self, msg: Written | Failed) -> bool | None:
        """Whether the remembered commit of ``msg``'s attempt counted this very report: True (a
        resend), False (a new save's report), None (unknown: no commit kept, a WRITTEN without an
        id, a FAILED)."""
        kept = self._by_key.get((msg.step, msg.attempt))
        if kept is None or not isinstance(msg, Written) or not msg.report_id:
            return None
        ids = kept[0]
        at = bisect.bisect_left(ids, msg.report_id)
        return at < len(ids) and ids[at] == msg.report_id

    def outcome(self, key: Key) -> StepCommitted:
        """The verdict of the remembered commit of ``key`` (which :meth:`counted` found)."""
        return self._by_key[key][1]
