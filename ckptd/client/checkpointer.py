"""Asynchronous, crash-consistent saves of sharded state dicts into a checkpoint root.

Typical use, on every rank (torchrun or a single process; saves use no collective)::

    with ckptd.Checkpointer("/ckpts/run1") as ckpt:     # connects to (or starts) the node daemon
        ckpt.resume(sharded_state_dict)                  # the last committed step (None: none yet)
        for it in ...:
            ...
            h = ckpt.save(sharded_state_dict, step=it)   # returns once the shards are staged
            ...                                          # training may mutate its tensors now
        h.wait()                                         # committed, or raises why not

Order of one :meth:`Checkpointer.save` on a rank:

1. deliver pending notifications; raise an earlier save's failure nobody observed yet;
2. take each top-level Stateful's ``state_dict()`` (:mod:`ckptd.statedict.stateful`) and plan
   the items (:mod:`ckptd.client.saveplanner`; local checks only): every plain item of a
   DCP-style state dict the rank holds, or only its share once a verdict confirmed that every
   rank holds the same plain keys (:mod:`ckptd.statedict.holdings`), laid out one after the
   other (aligned offsets); a DCP-style state dict of the structure saved (or prepared) before
   reuses that plan (:mod:`ckptd.format.repeat`);
3. create this rank's staging ring on the first save (unless ``prepare()`` or a byte budget did),
   sized by ``staging_budget`` (:mod:`ckptd.staging.ring`), and register it with the daemon, which
   owns it from then on; items larger than the ring are split into chunks;
4. with ``on_full="skip"``, when earlier saves still hold the ring and this one does not fit
   beside them, skip this step (the daemon tells the coordinator, which aborts the step on every
   rank at once, and every rank's save of it resolves as SKIPPED); an idle ring takes a save of
   any size (:mod:`ckptd.staging.backpressure`); otherwise take a control block and the save's
   range of the ring;
5. start the save's producer (:mod:`ckptd.staging.producer`, chosen by
   :class:`~ckptd.client.rankring.RankRing`): while the ring is still being pinned for CUDA, a
   device snapshot (:mod:`ckptd.staging.devsnap`); with ``snapshot="lazy"`` (or ``"auto"`` while an
   optimizer is attached) the copier thread (:mod:`ckptd.staging.lazy`); with ``snapshot="auto"``
   and plain CPU shards, a forked copy-on-write child that copies them while training goes on
   (:mod:`ckptd.staging.fork`; when the child would wait for ring space while an earlier child
   still waits, wait here first: :mod:`ckptd.staging.children`); otherwise (CUDA shards,
   ``snapshot="copy"``) ``save()`` itself, after the SAVE, while the daemon drains the ring (DMA
   on a side stream for CUDA tensors: :mod:`ckptd.staging.devcopy`); each producer waits for
   ring space the daemon frees;
6. send ``SAVE`` with this try's attempt id (``<incarnation>-<n>``: the launch, computed alike on
   every rank, and how many times this Checkpointer saved the step; see
   :mod:`ckptd.control.attempt`), the rank's plain-key digest and, when its layout changed since
   the last SAVE or ``prepare()`` sent one, the item list and the keys it holds without storing
   them (else only the layout's id: :mod:`ckptd.client.layout`), and wait for its ``SAVE_ACK``;
   tell the producer whether the daemon took the save (``after_ack``: an inline producer copies
   now), never took it (``cancel``; a fork child is killed) or may have (``detach``; see
   :mod:`ckptd.client.handoff`); return the
   :class:`SaveHandle`, which resolves through its future as the daemon's notifications arrive
   (:mod:`ckptd.client.pending`). The daemon writes each item once it is produced and publishes
   the file once the producer sealed the save; outcomes of other attempts of the step never
   resolve the handle.

A failure of steps 2-5 (or a SAVE the daemon refused) is raised here and told to the other ranks
as a SKIP under this try's attempt id (:mod:`ckptd.client.tries`), so their saves of the step fail
at once instead of after ``commit_timeout_s``, and a retry has the same attempt id on every rank.
An earlier save's failure raised in step 1 is not this step's: it counts no try and tells nobody.

The commit happens in the background (:mod:`ckptd.daemon`); the handle learns the outcome.
Not thread-safe: use a Checkpointer from one thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import weakref
from typing import Any

from ..config import CkptdConfig, parse_budget
from ..control.attempt import check_save_step
from ..control.endpoints import Endpoints, JobEnv
from ..control.protocol import (
    LayoutOk,
    Message,
    RegisterLayout,
    Status,
    StatusReply,
)
from ..dist import DistContext
from ..errors import (
    CheckpointExistsError,
    CkptdError,
    SaveSkippedError,
)
from ..format.durable import make_dirs_durably
from ..format.items import largest_object
from ..format.rootlayout import step_dir_name
from ..gcpause import gc_paused
from ..roots.posix import committed_once_advice
from ..s3catalog import committed_at, scan_any
from ..staging.children import KILL_REAP_S
from ..staging.devsnap import tensor_nbytes_by_device
from ..staging.lazy import STOP_MARGIN_S
from ..staging.producer import Claim
from ..statedict.content import with_content_metadata
from ..statedict.stateful import expand_stateful
from ..storage.s3client import S3Client
from ..storage.url import Location, S3Location, join, parse_location
from .handle import SaveFuture, SaveHandle, SaveStatus
from .handoff import SaveHandoff
from .incarnation import launch_incarnation
from .layout import LayoutCache
from .link import DaemonLink, DaemonLostError, RequestNotTaken, abandon_dropped, weakly
from .pending import PendingSaves, settle_above, wait_for_all
from .policy import AutoInterval
from .rankring import RankRing
from .reader import RootReader, forget_damage
from .saveplanner import SavePlanner
from .session import BYE_LINGER_S, DaemonSession
from .settle import DaemonsInFlight
from .stats import SaveRecord, SaveStats
from .tiers import Levels
from .tries import StepTries

log = logging.getLogger(__name__)

# close(timeout_s) returns within timeout_s plus at most this (see Checkpointer._stop_producers).
CLOSE_MARGIN_S = STOP_MARGIN_S + BYE_LINGER_S + KILL_REAP_S


class Checkpointer(RootReader):
    """Asynchronous saves into ``root`` through this node's ckptd daemon (see the module docstring),
    and loads from it (:class:`~ckptd.client.reader.RootReader`).

    ``config`` defaults to :meth:`CkptdConfig.from_env`; an auto-started daemon gets the same
    settings. The rank's place in the job comes from torchrun's variables (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT), else a single process.
    """

    def __init__(
        self, root: str | os.PathLike, *, config: CkptdConfig | None = None, env: JobEnv | None = None
    ) -> None:
        self.config = config if config is not None else CkptdConfig.from_env()
        self.env = env if env is not None else JobEnv.detect()
        # Refused before anything is made (the root directory, the daemon's connection).
        self._policy = (
            AutoInterval(self.config.mtbf_s, self.config.restart_s, self.env.world_size)
            if self.config.policy == "auto"
            else None
        )
        self.root = parse_location(root)  # a directory, or s3://bucket/prefix (URLs of other schemes are refused)
        if isinstance(self.root, S3Location):
            S3Client(self.root).check_access()  # credentials, endpoint and bucket work, or a clear error now
        else:
            make_dirs_durably(self.root, fsync=self.config.fsync)
        super().__init__(
            self.root, Levels.configured(self.root, self.config, self.env.node, self.env.world_size), self.env.rank
        )
        self.endpoints = Endpoints.for_job(self.root, self.env, self.config)
        # The link reaches back to this Checkpointer only weakly: a Checkpointer dropped without
        # close() is then freed at once (not in a cyclic garbage collection, where pyzmq's
        # Context.__del__ could wait forever on a socket collected in the same pass), and the
        # finalizer closes its socket within a bounded linger.
        self._link = DaemonLink.for_job(self.endpoints, self.env, self.config, weakly(self._on_notify))
        self._layout = LayoutCache()
        self._planner = SavePlanner(self.env.rank, self.env.world_size, self.config.check_common)
        self._plain = self._planner.plain  # whether every rank holds this rank's plain keys (ckptd.statedict.holdings)
        self._ring = RankRing(
            self.env.rank, self.env.local_world_size, self.endpoints.shm_prefix, self.config, self._link
        )
        # Handles in flight, failures not observed yet. Told of commits through the damage table
        # alone: a reference back to this Checkpointer would make a dropped one wait for a cyclic
        # collection (see the link above).
        self._pending = PendingSaves(
            self.env.rank, self._plain, committed=functools.partial(forget_damage, self._damaged, self.root)
        )
        self._session = DaemonSession(self.env.rank, self._link, self._ring, self._pending)
        self._stats = SaveStats()
        self._closed = False
        # Agreed by the first save, prepare() or resume(): only Checkpointers that save take part.
        self._tries = StepTries(
            self.env,
            functools.partial(launch_incarnation, self.config, self.env, self.endpoints.job),
            self._link,
            self._session.ensure_connected,
        )
        self._handoff = SaveHandoff(self.env, self._link, self._session, self._layout, self._tries)
        try:
            self._link.connect()
            if parse_budget(self.config.staging_budget)[1]:
                self._ensure_budgeted_ring()
        except BaseException:
            self._session.disconnect()  # BYE (the daemon frees a ring made here), the ring, the socket
            raise
        # Only once the constructor cannot fail: one that raised released what it opened and was
        # never the caller's to close, so it must not be reported as dropped without close().
        self._finalizer = weakref.finalize(self, abandon_dropped, self._link, self.env.rank)

    def _ensure_budgeted_ring(self) -> None:
        """A byte budget: the ring's size is known, so it is made now, and its pinning can start.
        Not when another running process saves as this rank: this Checkpointer may then only load
        (an evaluation's), and its save() says why it cannot save."""
        try:
            self._ring.ensure(0)
        except RequestNotTaken as exc:
            if not exc.rank_held:
                raise
            log.info("rank %d: %s; this Checkpointer can load, not save", self.env.rank, exc)

    # --- public API -------------------------------------------------------------------------
    def save(
        self, sharded_state_dict: dict[str, Any], step: int, *, content_metadata: dict | None = None
    ) -> SaveHandle:
        """Stage this rank's shards of ``step`` and hand them to the daemon (see module docstring).

        Returns once the bytes are in shared memory and the daemon acknowledged the request.
        Raises at once for local problems (bad state dict, step already committed, daemon
        unreachable); failures found later surface on the handle. On an ``s3://`` root, a step
        committed already fails its handle instead (save() asks the store nothing). ``content_metadata`` is stored
        as :func:`ckptd.save` stores it (Megatron-Core's ``content_metadata``).
        """
        with gc_paused():  # its per-item temporaries must not set off full collections
            if self._policy is None:
                return self._save_known(sharded_state_dict, step, content_metadata)
            try:
                handle = self._save_known(sharded_state_dict, step, content_metadata)
            except Exception:
                # Every rank saves at the same steps and agrees on the next one after each save (a
                # collective): a rank whose save raised (a full /dev/shm, a lost daemon...) joins
                # the agreement too, else the ranks' next collectives, training's own, mismatch.
                self._policy.after_save(step, self.stats())
                raise
            try:
                if self._stats.committed == 0 and self._policy.persist_floor_s is None:
                    self._policy.measure_first_commit(handle.future)
            finally:  # a wait that raised (a lazy snapshot's copy timed out) joins the agreement too
                self._policy.after_save(step, self.stats())
            return handle

    def _save_known(self, sharded_state_dict: dict[str, Any], step: int, content_metadata: dict | None) -> SaveHandle:
        sharded_state_dict = with_content_metadata(sharded_state_dict, content_metadata)
        self._tries.agree()
        tries = self._tries.count(step)
        return self._session.known_to_daemon(
            lambda: self._save(sharded_state_dict, step), again=lambda: self._tries.restore(step, tries)
        )

    def _save(self, sharded_state_dict: dict[str, Any], step: int) -> SaveHandle:
        self._check_open()
        t0 = time.perf_counter()
        check_save_step(step)
        # An earlier save's failure is raised here, but it is no failure of this step: nothing is
        # told to the other ranks (a SKIP would abort this step everywhere, and so on at each save).
        self._ring.fence()  # an earlier lazy save is decided before this one is planned
        self._session.pump_quietly()
        self._pending.raise_unobserved()
        if step in self._pending:
            raise CkptdError(f"step {step} is already being saved; wait for its handle first")
        final = join(self.root, step_dir_name(step))
        # A commit after this rank's load is after the earliest rank's too, which the coordinator
        # goes by: refused here as there (ckptd.catalog.WentBack).
        if (
            self._asks_committed()
            and committed_at(self.root, step, self._left_to_replace())
            and not self._replaces_damaged(step)
        ):
            raise CheckpointExistsError(f"{final} is committed already; {self._refusal_advice(step)}")
        with self._tries.announcing_failure(step):
            # A top-level Stateful is saved as what its state_dict() returns now (ckptd.statedict.stateful).
            t_plan = time.perf_counter()
            plan = self._planner.plan(expand_stateful(sharded_state_dict))
            plan_s = time.perf_counter() - t_plan
            items, placements, nbytes = plan.items, plan.placements, plan.nbytes
            self._session.ensure_connected()
            ring, items, placements, nbytes = self._ring.ring_for(items, placements, nbytes)
            t_slot = time.perf_counter()
            skip = self.config.on_full == "skip" and ring.must_skip(placements)
        if skip:  # its SKIP takes this try's attempt id itself
            return self._skip(step, t0, nbytes)
        with self._tries.announcing_failure(step):
            self._ring.wait_block(ring, step, lambda s: self._session.idle(ring, s))
            ring.check_room(ring.next_start, placements)  # a full /dev/shm fails here, cleanly
            block, start = ring.claim(placements)
            claim = Claim(step=step, block=block, start=start, items=items, placements=placements)
            queue_wait_s = time.perf_counter() - t_slot
            # Before the fork: while the child runs, every page the trainer writes is copied.
            wire = self._layout.items_for(ring.generation, items, placements, plan.held)
            t_copy = time.perf_counter()
            try:
                producer, waited_s = self._ring.start(
                    ring, claim, self._link.daemon_pid, lambda s: self._session.idle(ring, s)
                )
            except BaseException:
                ring.unclaim(block, start, placements)  # nothing was sent, no child copies into it
                self._layout.forget()
                raise
        copy_s = time.perf_counter() - t_copy - waited_s
        queue_wait_s += waited_s
        attempt = self._tries.next(step)
        msg = self._handoff.message(attempt, ring, claim, producer, plan, wire, self._went_back)
        t_send = time.perf_counter()
        self._handoff.send(msg, producer, ring, claim)
        t_ack = time.perf_counter()
        handoff_s = t_ack - t_send
        waited_s = producer.after_ack()  # the rest of an inline copy, issued once the daemon took the save
        copy_s += time.perf_counter() - t_ack - waited_s
        queue_wait_s += waited_s
        stall_s = time.perf_counter() - t0
        record = SaveRecord(step, nbytes, stall_s, queue_wait_s, plan_s=plan_s, copy_s=copy_s, handoff_s=handoff_s)
        handle = self._new_handle(record, attempt, final)
        self._pending.add(handle)
        self._plain.sent(step, plan.plain)
        log.debug("rank %d: step %d staged in %.3f s", self.env.rank, step, handle.stall_s)
        return handle

    def _refusal_advice(self, step: int) -> str:
        """What to do about a save of ``step`` that a commit refuses (scanned only then)."""
        went_back = self._left_to_replace()
        if went_back is None or step <= went_back.step:
            return "save under a new step"
        return committed_once_advice(scan_any(self.root, usage=False), step, went_back)

    def _asks_committed(self) -> bool:
        """Whether save() asks the root if the step is committed, to raise at once. The coordinator
        refuses a committed step anyway (the handle fails), so the question is only asked where it
        is a local read: not of an ``s3://`` root, where it was a round trip to the store inside
        every save's stall, and a hung store hung save() itself; nor of a node-local disk but node
        0's (another node's may hold a step of a history node 0 no longer has)."""
        if isinstance(self.root, S3Location):
            return False
        return self.env.node == 0 or not self._levels.node_local

    def prepare(self, sharded_state_dict: dict[str, Any], *, wait: bool = True) -> None:
        """Create this rank's staging ring now, sized for saves of ``sharded_state_dict`` as its
        first ``save()`` would size it, and remember the plan, so a first save of the same
        structure is not planned again (ckptd.format.repeat) and sends the daemon only the id of
        its item list, registered here (ckptd.client.layout): that save's stall is then a steady
        save's. In a process that uses CUDA the ring is pinned (ckptd.staging.pinning; about 0.5 s
        per GiB on an H100 machine, some 20 times the device-to-host copy) and, with ``wait``
        (default), ``prepare()`` returns once it is, so the first save is a steady one;
        ``wait=False`` returns at once and pins in the background (a first save before that ends
        takes a device snapshot). Call it once, before the training loop, with the state you will
        save (every rank). Checks the state dict as a save does, and raises its errors. A byte
        budget (``staging_budget="8GiB"``) makes the constructor create and pin the ring in the
        background, but plans nothing.
        """
        self._check_open()
        self._tries.agree()  # here, not in the first save's stall (a round trip to the store)
        self._session.known_to_daemon(lambda: self._prepare(sharded_state_dict, wait))

    def _prepare(self, sharded_state_dict: dict[str, Any], wait: bool) -> None:
        plan = self._planner.plan(expand_stateful(sharded_state_dict))
        device = next((d for d in tensor_nbytes_by_device(plan.items) if d.type == "cuda"), None)
        self._session.ensure_connected()
        ring = self._ring.ensure(plan.nbytes, device=device, holds=largest_object(plan.items))
        # Items larger than the ring are split by each save (on the GPU, for CUDA tensors).
        if all(p.nbytes <= ring.capacity for p in plan.placements):
            self._layout.register(
                self._send_layout, self.env.rank, ring.generation, plan.items, plan.placements, plan.held
            )
        if wait:
            self._ring.wait_pinned()

    def _send_layout(self, msg: RegisterLayout) -> None:
        self._link.request(msg, LayoutOk, match=lambda ok: ok.layout == msg.layout)

    def before_update(self) -> None:
        """With lazy snapshots: call before changing saved tensors (the optimizer step); returns
        once they may change. CPU copies still running are waited for; CUDA copies are ordered
        before the work queued next on the current streams, without blocking. This *fences* the
        pending lazy saves: each is sealed (and commits) if none of its tensors changed since
        ``save()``, and fails otherwise, never saving torn values. ``save()``, ``handle.wait()``
        and ``close()`` fence too. Without lazy snapshots it does nothing.
        """
        self._ring.fence()

    def attach(self, optimizer: Any) -> Any:
        """Call :meth:`before_update` before every ``optimizer.step()`` (a step pre-hook); returns
        a handle whose ``.remove()`` detaches it. With ``snapshot="auto"`` (the default) the saves
        are lazy snapshots while an optimizer is attached: the fence is then guaranteed before
        every update, and a lazy snapshot costs the loop least (see the README's "Choosing a
        snapshot mode"); after the last ``remove()`` they are fork/DMA snapshots again."""
        fence = weakly(self.before_update)  # the ring holds the optimizer, which holds the hook
        return self._ring.attach(optimizer.register_step_pre_hook(lambda *_: fence()), optimizer)

    def due(self, step: int) -> bool:
        """policy="auto": whether to save at ``step``; call it once per training step on every rank.

        True on the first call; afterwards every ``interval`` steps, where the interval is the
        Young/Daly optimum for the measured stall, commit latency and step time and the configured
        ``mtbf_s`` (see :mod:`ckptd.client.policy`). With ``policy="manual"`` it raises.
        """
        if self._policy is None:
            raise CkptdError(
                "Checkpointer.due() needs policy='auto' (CkptdConfig(policy='auto', "
                "mtbf_s=...) or CKPTD_POLICY=auto CKPTD_MTBF_S=...)"
            )
        return self._policy.due(step)

    @property
    def pending(self) -> list[SaveHandle]:
        self._session.pump_quietly()
        return self._pending.handles()

    def wait_all(self, timeout_s: float | None = None) -> None:
        """Wait for every pending save, ``timeout_s`` in all; raise the first failure (after all
        finished), or SaveTimeoutError when saves are still pending at the timeout; also the failure
        of an earlier save nobody observed."""
        handles = self._pending.handles()  # before notifications resolve some and drop them
        self._session.pump_quietly()
        wait_for_all(handles, timeout_s)
        self._pending.raise_unobserved()

    def stats(self) -> dict[str, Any]:
        """This rank's save measurements: counters, last/mean/max of stall, ring wait, persist
        and commit latency over the recent saves, and those saves (see :mod:`ckptd.client.stats`).
        Delivers pending notifications first, so finished saves are counted."""
        self._session.pump_quietly()
        return self._stats.as_dict()

    def status(self) -> dict[str, Any]:
        """The node daemon's status (rings, writes in flight, pending steps, coordinator)."""
        self._check_open()
        self._session.ensure_connected()
        return self._link.request(Status(), StatusReply).info

    def _before_load(self, group: Any, *, resume: bool) -> None:
        """A load writes into the tensors a lazy save may still be copying: decide those saves
        first. A resume then settles what an earlier launch left with the node daemons
        (ckptd.client.settle)."""
        if resume:  # every rank resumes: the agreement here, not in the first save's stall
            self._tries.agree()
        if resume:  # a collective: a rank whose lazy copy failed here left the others in the next one
            DistContext.current(group).agree("deciding this rank's saves before the resume", self._decide_own_saves)
        else:  # load(step=N) may be one rank's alone
            self._decide_own_saves()
        if resume:
            daemons = DaemonsInFlight(self.root, self.env.rank, self._connected_link, self._session.daemon_lost)
            daemons.settle(
                self.config.resume_wait_s,
                shared_root=not self._levels.node_local,
                job_world_size=self.env.world_size,
                group=group,
            )

    def _await_saves_above(self, step: int, *, resume: bool = False) -> None:
        """Before ``load(step=step)`` or a ``resume``: this Checkpointer's saves of higher steps
        in flight land first, for at most ``coordinator_timeout_s`` (see
        :func:`ckptd.client.pending.settle_above`): one committed after the load would pass for
        the new branch's, which the job's next commit descends from (ckptd.lineage)."""
        settle_above(self._pending.handles(), step, self.config.coordinator_timeout_s)

    def _loaded(self, step: int) -> None:
        """A load of ``step``: also, with ``policy="auto"``, the next save is an interval after it
        (:meth:`ckptd.client.policy.AutoInterval.after_load`)."""
        super()._loaded(step)
        if self._policy is not None:
            self._policy.after_load(step)

    def _decide_own_saves(self) -> None:
        self._session.drop_dead_daemon()
        self._ring.fence()

    def _connected_link(self) -> DaemonLink | None:
        """The link to the node daemon, connected (None: this Checkpointer is closed)."""
        if not self._closed:
            self._session.ensure_connected()
        return None if self._closed else self._link

    def close(self, timeout_s: float | None = None, *, wait: bool = True) -> None:
        """Wait for pending saves (``wait``), say BYE (the daemon frees our ring), disconnect.

        Returns within ``timeout_s`` (default ``close_timeout_s``) plus at most
        :data:`CLOSE_MARGIN_S` (2.5 s), whatever the daemon does; raises SaveTimeoutError when
        ``wait`` and saves were still pending then. Snapshot producers still copying into the
        staging ring at that deadline are stopped and their saves fail. An auto-started daemon
        exits by itself once no rank is connected and nothing is in flight for ``idle_exit_s``.
        Raises the first failure of a save nobody waited for; one still pending when it disconnects
        is no failure (the daemon still commits it): its handle resolves unconfirmed.
        """
        if self._closed:
            return
        deadline = time.monotonic() + (self.config.close_timeout_s if timeout_s is None else timeout_s)
        failed: BaseException | None = None  # raised once closed: a save's failure, or the wait's error
        try:
            if wait and self._pending and self._link.connected:
                self._ring.fence(deadline)
                self.wait_all(max(0.0, deadline - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - raised below, after the teardown
            failed = exc
        self._closed = True
        try:
            with contextlib.ExitStack() as teardown:  # every step runs, whatever one raises
                teardown.callback(self._finalizer.detach)
                self._stop_producers(deadline)
        except Exception as exc:
            if failed is None:
                raise
            # The save's failure is what the caller must learn; the teardown's is logged.
            log.warning("rank %d: closing failed too: %s: %s", self.env.rank, type(exc).__name__, exc)
        if failed is not None:
            raise failed
        self._pending.raise_unobserved()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close(wait=False)
            except Exception as exc:  # noqa: BLE001 - the error that ended the block is the one raised
                log.warning("while closing after an error: %s: %s", type(exc).__name__, exc)

    # --- internals -----------------------------------------------------------------------------
    def _stop_producers(self, deadline: float) -> None:
        """Closing: stop what produces saves into the ring, then disconnect, by ``deadline``
        (monotonic) plus :data:`CLOSE_MARGIN_S` (the copier's stop, the BYE's linger, reaping the
        children killed at the deadline). A producer only writes into this rank's ring: stopping
        one fails its save, nothing else. A fork child runs in its own session and survives the
        trainer; it is killed only here, when close() runs out of time."""
        with contextlib.ExitStack() as teardown:  # each step runs, whatever an earlier one raises
            teardown.callback(self._ring.children.close, deadline)
            teardown.callback(self._session.disconnect)
            self._ring.stop_copier(deadline)

    def _on_notify(self, msg: Message) -> None:
        self._session.on_notify(msg)

    def _check_open(self) -> None:
        if self._closed:
            raise CkptdError("this Checkpointer is closed")

    def _new_handle(self, record: SaveRecord, attempt: str, path: Location) -> SaveHandle:
        self._stats.add(record)
        # The handle resolves through its future, which this Checkpointer drives while it is waited for.
        return SaveHandle(
            SaveFuture(record.step, record, self._stats, self._session.pump_quietly, self._wait_for), path, attempt
        )

    def _skip(self, step: int, t0: float, nbytes: int) -> SaveHandle:
        reason = (
            f"the staging ring of rank {self.env.rank} had no room for it: earlier saves were "
            "still being persisted (on_full='skip')"
        )
        log.warning("step %d skipped: %s", step, reason)
        attempt = self._tries.next(step)
        self._tries.tell_others(step, attempt, reason, skipped=True)
        record = SaveRecord(step, 0, time.perf_counter() - t0, 0.0)
        handle = self._new_handle(record, attempt, join(self.root, step_dir_name(step)))
        handle.future.set_result(SaveStatus.SKIPPED, SaveSkippedError(f"step {step} was skipped: {reason}"))
        return handle

    def _wait_for(self, future: SaveFuture, timeout_s: float | None) -> None:
        """Deliver notifications until ``future`` is resolved or ``timeout_s`` passed (a SaveFuture's wait)."""
        timeout = self.config.commit_timeout_s + self.config.coordinator_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        # The training thread waits here, so nothing changes meanwhile: fence this save's lazy
        # snapshot and those before it. A copy not done by the caller's timeout stays pending (a
        # later wait or fence decides it).
        if not self._ring.fence(None if timeout_s is None else deadline, keep_late=True, until_step=future.step):
            self._session.pump_quietly()  # the save may have been decided meanwhile all the same
            return
        while future.status is SaveStatus.PENDING:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if not self._link.connected:
                self._session.drop_dead_daemon()  # a request lost the daemon: its saves resolve now
                return
            try:
                self._link.pump(min(remaining, 0.2))
            except DaemonLostError as exc:
                self._session.daemon_lost(str(exc))
