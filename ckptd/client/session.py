"""A Checkpointer's session with its node daemon: the link, the staging ring the daemon owns, the
saves in flight, and what follows when the daemon is lost or forgot this rank.

:class:`DaemonSession` holds the three together because losing the daemon concerns all of them
at once: its pending saves fail, the producers writing into its ring stop, and the ring is dropped
(nobody frees its space any more). The Checkpointer (ckptd.client.checkpointer) drives it from the
training thread:

- :meth:`ensure_connected` before a request (a dead daemon is dropped first; the next request
  starts or finds the next one);
- :meth:`known_to_daemon` around a request the daemon may refuse as from an unknown client (it
  took this rank for gone): HELLO again, then the request once more;
- :meth:`pump_quietly` / :meth:`idle` to take the daemon's notifications (:meth:`on_notify`);
- :meth:`daemon_lost` when a request finds the daemon gone: its pending saves fail, and once
  connected to the next daemon the rank asks it to abort their attempts on every rank (an
  ``ABANDON`` naming this rank: ckptd.daemon.commitstate aborts such an attempt unless this rank's
  report of it was counted, the dead daemon having written and reported it). Nobody else can tell
  those saves will never be written, and the coordinator commits attempts in the order they
  began: every later step's commit waited for them until ``commit_timeout_s``;
- :meth:`disconnect` last (BYE: the daemon frees the ring).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

from ..control.protocol import Abandon, Bye, Message, SaveAck, StepAborted, StepCommitted, WriteDone
from ..errors import CkptdError, DaemonError
from ..staging.rankside import StagingRing
from .link import DaemonLink, DaemonLostError, RequestNotTaken
from .pending import PendingSaves
from .rankring import RankRing

log = logging.getLogger(__name__)

_BYE_LINGER_MS = 1000  # closing: how long the BYE may take to leave
BYE_LINGER_S = _BYE_LINGER_MS / 1000


class DaemonSession:
    def __init__(self, rank: int, link: DaemonLink, ring: RankRing, pending: PendingSaves) -> None:
        self.rank = rank
        self.link = link
        self.ring = ring
        self.pending = pending
        # The attempts of the saves a lost daemon held, to abort through the next one (oldest first).
        self.lost: list[tuple[int, str]] = []

    def ensure_connected(self) -> None:
        """Connected to a live node daemon (started if none runs), or raise why not."""
        if self.drop_dead_daemon():
            return
        old = self.link.instance
        self.link.connect()
        if old is not None and old != self.link.instance:
            log.warning("rank %d: node daemon restarted (%s -> %s)", self.rank, old, self.link.instance)
        self._abandon_lost()

    def _abandon_lost(self) -> None:
        """Ask the daemon just connected to abort the attempts whose saves its predecessor died
        holding (see the module docstring), oldest first: an attempt every rank wrote that only
        waited for an older one then commits before its own abort arrives, which a commit ignores.
        Best effort: one that cannot be asked waits out ``commit_timeout_s`` as before."""
        lost, self.lost = self.lost, []
        for step, attempt in lost:
            reason = (
                f"the node daemon of rank {self.rank} died holding its save of step {step} before it reported "
                "it (its next daemon asked to abort it, so later steps need not wait for it)"
            )
            request = Abandon(step=step, attempt=attempt, reason=reason, handed_off=[], abandoning_rank=self.rank)
            try:
                self.link.request(request, SaveAck, match=functools.partial(_acks, step, attempt))
            except CkptdError as exc:
                log.warning(
                    "rank %d: could not ask the node daemon to abort step %d attempt %s, whose save its "
                    "predecessor died holding (%s); the other ranks' saves of it fail after commit_timeout_s",
                    self.rank,
                    step,
                    attempt,
                    exc,
                )
                return
            log.info(
                "rank %d: asked to abort step %d attempt %s (its node daemon died with it)", self.rank, step, attempt
            )

    def drop_dead_daemon(self) -> bool:
        """Whether the link is connected to a live daemon; one found dead is dropped, with its ring
        and the saves in flight (nobody frees ring space any more: a copier stops waiting). So is
        one a request lost: a request that finds the daemon gone closes the link's socket and
        raises wherever it was made (``status()``, a ring's registration, a SKIP...), so a closed
        link with a ring or saves left is a daemon lost that nobody dropped yet; its ring would
        be named in every SAVE to the next daemon (refused) and its saves would never resolve."""
        if self.link.connected and self.link.alive():
            return True
        if self.link.connected or self.ring.current is not None or self.pending:
            self.daemon_lost(self.link.lost or f"the node daemon (pid {self.link.daemon_pid}) died")
        return False

    def daemon_lost(self, reason: str) -> None:
        """Fail every pending save and drop the ring: nobody owns it any more."""
        with contextlib.ExitStack() as teardown:  # the ring is dropped whatever quiesce() raises
            teardown.callback(self.ring.drop, unlink=True)
            self.link.close_socket()
            self.lost += self.pending.daemon_lost(reason)
            self.ring.quiesce(daemon_gone=True)

    def known_to_daemon(self, act: Callable[[], Any], again: Callable[[], None] = lambda: None) -> Any:
        """``act()``; once more (after ``again()``) when the daemon refused it as from an unknown
        client, having said HELLO again (see :meth:`register_again`)."""
        try:
            return act()
        except RequestNotTaken as exc:
            if not exc.unknown_client:
                raise
            self.register_again(exc)
            again()
            return act()

    def register_again(self, refusal: RequestNotTaken) -> None:
        """The daemon refused a request as from an unknown client: it took this rank for gone and
        retired its staging ring (saves in flight there still finish). Say HELLO again on the same
        connection and let the next save register a new ring."""
        log.warning("rank %d: %s; registering with the node daemon again", self.rank, refusal)
        self.ring.quiesce()  # the copier writes into the ring unmapped below
        self.ring.drop(unlink=False)  # the daemon unlinks it once its writes finished
        try:
            self.link.hello_again()
        except DaemonLostError as exc:
            self.daemon_lost(str(exc))
            raise

    def idle(self, ring: StagingRing, timeout_s: float) -> None:
        """While a save waits for the daemon: take its notifications for up to ``timeout_s``;
        raise if it died or the ring was dropped meanwhile."""
        try:
            self.link.pump(timeout_s)
        except DaemonLostError as exc:
            self.daemon_lost(str(exc))
            raise
        if self.ring.current is not ring:
            raise DaemonError("the staging ring was dropped while a save waited for the daemon")

    def on_notify(self, msg: Message) -> None:
        """A notification of the daemon: ring space written out, or a step's outcome."""
        if isinstance(msg, WriteDone):
            ring = self.ring.current
            if ring is not None and msg.generation == ring.generation:
                ring.release(msg.block)
            self.pending.wrote(msg)
        elif isinstance(msg, (StepCommitted, StepAborted)):
            self.pending.resolve(msg)
        else:
            log.warning("rank %d: unexpected %s from the daemon", self.rank, msg.TYPE.name)

    def pump_quietly(self) -> None:
        """Take the notifications that arrived (never blocks); a lost daemon fails the saves."""
        self.ring.children.reap()
        if not self.link.connected:
            self.drop_dead_daemon()  # one a request lost (see there)
            return
        try:
            self.link.pump(0.0)
        except DaemonLostError as exc:
            self.daemon_lost(str(exc))

    def disconnect(self) -> None:
        """Say BYE (the daemon then owns the ring and frees it), resolve what is pending as
        unconfirmed (the daemon still commits it: :meth:`PendingSaves.closed`), drop the ring,
        close the socket: every step runs, whatever one raises. A daemon that died, or that a
        request lost, is dropped as such first: no BYE, its saves fail as its loss fails them."""
        owned_by_daemon = False
        with contextlib.ExitStack() as teardown:  # last in, first run
            teardown.callback(self.link.close, linger_ms=_BYE_LINGER_MS)  # the BYE leaves first
            teardown.callback(self.pending.closed)  # the daemon took them: they still commit
            teardown.callback(lambda: self.ring.drop(unlink=not owned_by_daemon))
            if self.drop_dead_daemon():
                try:
                    self.link.send(Bye())
                    owned_by_daemon = True
                except DaemonError:
                    pass


def _acks(step: int, attempt: str, ack: SaveAck) -> bool:
    return (ack.step, ack.attempt) == (step, attempt)
