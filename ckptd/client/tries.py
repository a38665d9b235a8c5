"""A rank's tries of each step: their attempt ids, and the SKIPs that end a try on every rank.

Every try of a step counts, also one the daemon refuses or one that fails before its SAVE went
out, so that a rank's n-th try of a step has the same attempt id (``<incarnation>-<n>``,
:mod:`ckptd.control.attempt`) as every other rank's n-th try. A try that this rank cannot save is
told to the coordinator at once (a SKIP under its attempt id): the other ranks' saves of it fail
with the reason, instead of waiting out ``commit_timeout_s`` for this rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..control.attempt import Incarnation
from ..control.endpoints import JobEnv
from ..control.protocol import Skip
from ..errors import CkptdError
from .link import DaemonLink, RequestNotTaken

log = logging.getLogger(__name__)


class StepTries:
    """The tries of each step by one Checkpointer; ``connect`` (re)connects its ``link``.
    ``incarnation`` gives the launch's incarnation (ckptd.client.incarnation), asked once, by the
    first :meth:`agree`: a Checkpointer that never saves (one rank's, reading ``latest()``) takes
    no part in the ranks' agreement, so their saving Checkpointers still agree."""

    def __init__(
        self, env: JobEnv, incarnation: Callable[[], Incarnation], link: DaemonLink, connect: Callable[[], None]
    ) -> None:
        self.env = env
        self._agree = incarnation
        self._incarnation: Incarnation | None = None
        self.link = link
        self.connect = connect
        self._tries: dict[int, int] = {}  # step -> tries of it so far

    def agree(self) -> Incarnation:
        """The launch's incarnation, agreed on the first call (CkptdError when it cannot be: the
        next call asks again)."""
        if self._incarnation is None:
            self._incarnation = self._agree()
        return self._incarnation

    @property
    def incarnation(self) -> Incarnation:
        return self.agree()

    def count(self, step: int) -> int:
        return self._tries.get(step, 0)

    def restore(self, step: int, tries: int) -> None:
        """Count ``tries`` of ``step`` again: the daemon did not take the last one (it had forgotten
        this rank), so the retry is that same try, as the other ranks' daemons took it."""
        self._tries[step] = tries

    def next(self, step: int) -> str:
        """The attempt id of this try of ``step``."""
        n = self._tries[step] = self.count(step) + 1
        return self.incarnation.attempt(n)

    @contextmanager
    def announcing_failure(self, step: int) -> Iterator[None]:
        """A failure of this rank's try of ``step`` before its SAVE went out is told to the other
        ranks under the try's attempt id (:meth:`abort_everywhere`), then raised; not a refusal as
        from an unknown client, which ``save()`` recovers from by trying again, nor one because
        another save is being written under that attempt id (it is that save's to decide), nor one
        because another running process saves as this rank (the step is that launch's: its abort
        would abort that launch's save; the try is counted, the other ranks wait out
        ``commit_timeout_s``)."""
        try:
            yield
        except Exception as exc:
            if isinstance(exc, RequestNotTaken) and exc.rank_held:
                self.next(step)  # counted all the same: a retry's attempt id stays the other ranks'
            elif not (isinstance(exc, RequestNotTaken) and (exc.unknown_client or exc.attempt_in_use)):
                self.abort_everywhere(step, f"rank {self.env.rank} could not save step {step}: {exc}")
            raise

    def abort_everywhere(self, step: int, reason: str) -> None:
        """This rank will not save this try of ``step``: a SKIP with the reason."""
        self.tell_others(step, self.next(step), reason)

    def tell_others(self, step: int, attempt: str, reason: str, *, skipped: bool = False) -> None:
        """A SKIP of ``attempt`` (``skipped``: by the on_full="skip" policy, not a failure);
        best-effort for a failure (logged when it cannot go out), raised for a policy skip."""
        env = self.env
        msg = Skip(step=step, attempt=attempt, rank=env.rank, world_size=env.world_size, reason=reason, skipped=skipped)
        if skipped:
            self.link.announce(msg)
            return
        try:
            self.connect()
            self.link.announce(msg)
        except CkptdError as exc:
            log.warning(
                "rank %d: could not abort step %d on the other ranks (%s); they fail after commit_timeout_s",
                self.env.rank,
                step,
                exc,
            )
