"""Handing a staged save to the node daemon: its SAVE, and what follows when no SAVE_ACK comes.

The SAVE names the try's attempt id, the ring range the save's producer fills (its control block
and start), the item list or only its layout's id (ckptd.client.layout), how the producer seals the
save (ckptd.staging.producer), rank 0's common state, the plain-key digest and the step the job
last loaded (ckptd.catalog.WentBack). When its SAVE_ACK does not come, the producer is told whether
the daemon never took the save or may still write it:

- the daemon died (DaemonLostError): ``cancel`` (nobody reads the ring any more); the session drops
  the daemon and asks the next one to abort the attempt (ckptd.client.session);
- the daemon refused it, or it never went out (RequestNotTaken, ProtocolError): ``cancel``, and the
  ring range is given back; the other ranks are told at once (a SKIP: ckptd.client.tries), unless
  the daemon took this rank for gone (``save()`` tries again) or the attempt id is another save's;
- no answer (a timeout, an interrupt): ``detach``; the daemon may still write the save, so its
  control block stays taken until the daemon's WRITE_DONE for it.

A refused or unanswered SAVE also makes the layout cache forget the last layout: the daemon may
not hold it.
"""

from __future__ import annotations

import logging

from ..catalog import WentBack
from ..control.endpoints import JobEnv
from ..control.protocol import Save, SaveItem
from ..errors import ProtocolError
from ..format.repeat import PlannedSave
from ..staging.producer import Claim, Producer
from ..staging.rankside import StagingRing
from .layout import LayoutCache
from .link import DaemonLink, DaemonLostError, RequestNotTaken
from .session import DaemonSession
from .tries import StepTries

log = logging.getLogger(__name__)


class SaveHandoff:
    """Hands one Checkpointer's staged saves to its node daemon (see the module docstring)."""

    def __init__(
        self, env: JobEnv, link: DaemonLink, session: DaemonSession, layout: LayoutCache, tries: StepTries
    ) -> None:
        self.env = env
        self.link = link
        self.session = session
        self.layout = layout
        self.tries = tries

    def message(
        self,
        attempt: str,
        ring: StagingRing,
        claim: Claim,
        producer: Producer,
        plan: PlannedSave,
        wire: tuple[list[SaveItem], str, list[str]],
        went_back: WentBack | None,
    ) -> Save:
        """The SAVE of ``claim`` (staged into ``ring`` by ``producer``) as ``attempt``; ``wire``:
        its ``(items, layout, held)`` as the layout cache gives them (ckptd.client.layout)."""
        items, layout, held = wire
        snap = producer.snapshot
        return Save(
            step=claim.step,
            attempt=attempt,
            rank=self.env.rank,
            world_size=self.env.world_size,
            generation=ring.generation,
            block=claim.block,
            items=items,
            common=plan.common,
            common_digest=plan.common_digest,
            layout=layout,
            ring_start=claim.start,
            snapshot_pid=snap.pid,
            seal=snap.seal,
            seal_offset=snap.seal_offset,
            plain_digest=plan.plain,
            held=held,
            went_back_to=-1 if went_back is None else went_back.step,
            went_back_unix_s=0.0 if went_back is None else went_back.before_unix_s,
        )

    def send(self, msg: Save, producer: Producer, ring: StagingRing, claim: Claim) -> None:
        """Send the SAVE and wait for its SAVE_ACK; when none comes, tell the producer whether the
        daemon never took the save (cancel: the range is given back) or may still write it (detach)."""
        try:
            self.link.announce(msg)
        except DaemonLostError as exc:
            producer.cancel()  # nobody reads the ring any more: nothing is written into it
            self.session.daemon_lost(str(exc))
            # The daemon may have died with the SAVE unread or untold: the next one is asked to
            # abort this attempt, else the other ranks' saves of it hold every later commit.
            self.session.lost.append((msg.step, msg.attempt))
            raise
        except (RequestNotTaken, ProtocolError) as exc:
            producer.cancel()
            ring.unclaim(claim.block, claim.start, claim.placements)  # not sent, or refused: never taken
            self.layout.forget()
            # An unknown client: save() tries again; an attempt in use: it is another save's.
            if not (isinstance(exc, RequestNotTaken) and (exc.unknown_client or exc.attempt_in_use)):
                self.tries.tell_others(
                    msg.step, msg.attempt, f"rank {self.env.rank} could not save step {msg.step}: {exc}"
                )
            raise
        except BaseException:
            # No answer (timeout, interrupt): the daemon may still write this save, so its control
            # block stays taken until the daemon's WRITE_DONE for it.
            producer.detach()
            self.layout.forget()
            log.warning(
                "rank %d: no answer to the SAVE of step %d; its staging block %d stays reserved "
                "until the daemon frees it",
                self.env.rank,
                msg.step,
                claim.block,
            )
            raise
