"""This launch's incarnation, agreed by the ranks through torch.distributed's store when there is one.

Attempt ids (:mod:`ckptd.control.attempt`) must differ between launches of a job, or a relaunch
that saves a step its predecessor saved is answered with the predecessor's verdict. The launcher's
variables do not always tell launches apart: plain ``torchrun`` without ``--standalone`` sets
``TORCHELASTIC_RUN_ID=none``, and ``--rdzv-id`` is often the same name for every launch of a job.
A store does: the default process group's (once ``init_process_group`` ran), or torchrun's agent
store (``TORCHELASTIC_USE_AGENT_STORE=True``) that the workers' process group will use. torchrun's
agent store, though, outlives the workers: one torchrun keeps it through every round of workers it
starts (a restart after a failure, ``--max-restarts``, or after a membership change), and the
default process group's store of such a round is the same store under a prefix. So the ranks agree
per round (:class:`LaunchRound`), on a random tag:

1. each rank counts its Checkpointers of this job in this round (``store.add``), in the order of
   their first ``save()``, ``prepare()`` or ``resume()``: the ``n``-th Checkpointer of every rank
   belongs to the same agreement (one that only reads, such as one rank's that asks ``latest()``,
   is not counted: it would leave that rank's saving Checkpointer one ahead of the others);
2. each rank offers a random tag for ``n`` (``store.compare_set``): the first offer wins, every
   rank reads the winner, nobody waits for another rank.

Counted over the whole store, a rank whose predecessor died before its first save (or a rank new
to the job) would count one behind the others of its round, read the earlier round's tag and save
under the dead round's attempt ids: a re-save of a step could commit the dead round's shards with
its own.

Without a store the caller falls back to :func:`ckptd.control.attempt.incarnation_for`. A store
that fails is an error (:class:`~ckptd.errors.CkptdError`): falling back on this rank alone would
give it other attempt ids than the ranks that agreed, and no save of the launch would commit.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..config import CkptdConfig
from ..control.attempt import Incarnation, incarnation_for
from ..control.endpoints import JobEnv
from ..errors import CkptdError

log = logging.getLogger(__name__)

_TAG = re.compile(r"[0-9a-f]{12}")
_WHAT_TO_DO = (
    "this rank alone cannot choose one (its save attempts would match no other rank's, and no save "
    "of the launch would commit). Set CKPTD_RUN_ID to one value per launch on every rank"
)


@dataclass(frozen=True, kw_only=True)
class LaunchRound:
    """The round of workers this process belongs to, as every rank of it tells alike without
    talking: the world size, and torchrun's restart count when one torchrun runs the whole job.

    A one-node torchrun raises ``TORCHELASTIC_RESTART_COUNT`` for every round after the first (it
    has no membership to change). With several nodes each torchrun counts its own restarts: a
    membership change raises no count, a failure only the failed node's, so ranks of one round
    would read different counts; there only the world size tells rounds apart (README, Launch)."""

    world_size: int
    restart_count: str | None = None  # None: several nodes, or no torchrun

    @classmethod
    def of(cls, env: JobEnv, environ: Mapping[str, str] | None = None) -> LaunchRound:
        variables = os.environ if environ is None else environ
        restarts = variables.get("TORCHELASTIC_RESTART_COUNT") if env.nnodes == 1 else None
        return cls(world_size=env.world_size, restart_count=restarts)

    @property
    def key(self) -> str:
        restart = "" if self.restart_count is None else f"-restart{self.restart_count}"
        return f"world{self.world_size}{restart}"

    def __str__(self) -> str:
        restart = "" if self.restart_count is None else f", torchrun restart {self.restart_count}"
        return f"world size {self.world_size}{restart}"


def launch_store(timeout_s: float) -> Any | None:
    """The store of this launch: the default process group's, or torchrun's agent store; None
    when there is neither. Raises CkptdError when torchrun says it has an agent store that this
    rank cannot reach (see the module docstring)."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if dist.is_initialized():
        try:
            return dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError) as exc:  # a private helper of torch's
            log.info("no store of the default process group (%s)", exc)
            return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not addr or not port:
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, OSError) as exc:
        raise CkptdError(
            f"cannot reach torchrun's agent store at {addr}:{port} ({exc}) to agree on this launch's "
            f"incarnation; {_WHAT_TO_DO}"
        ) from None


def agreed_incarnation(store: Any, job: str, rank: int, launch_round: LaunchRound) -> Incarnation:
    """A random incarnation every rank of this round of the launch agrees on through ``store``
    (see the module docstring); CkptdError when the store fails."""
    prefix = f"ckptd/{job}/{launch_round.key}"
    try:
        n = store.add(f"{prefix}/checkpointers/rank{rank}", 1)
        raw = store.compare_set(f"{prefix}/incarnation/{n}", "", secrets.token_hex(6))
    except (RuntimeError, ValueError, OSError) as exc:
        raise CkptdError(
            f"rank {rank} could not agree on this launch's incarnation through the torch.distributed "
            f"store ({exc}); {_WHAT_TO_DO}"
        ) from None
    tag = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    if not _TAG.fullmatch(tag):
        raise CkptdError(
            f"the torch.distributed store holds {tag[:40]!r} as this launch's incarnation, not 12 hex "
            f"digits (another program's key?); {_WHAT_TO_DO}"
        )
    return Incarnation(
        tag=tag,
        source=f"agreed through the launch's torch.distributed store (Checkpointer {n} of the round: {launch_round})",
    )


def launch_incarnation(config: CkptdConfig, env: JobEnv, job: str) -> Incarnation:
    """This launch's incarnation (attempt ids: ckptd.control.attempt): ``CKPTD_RUN_ID`` when set;
    else, with several ranks, a random one agreed through the launch's torch.distributed store
    (:func:`agreed_incarnation`), unique per round of the launch whatever the launcher sets; else
    one derived from the launcher's variables."""
    if not config.run_id and env.world_size > 1:
        store = launch_store(min(30.0, config.daemon_start_timeout_s))
        if store is not None:
            return agreed_incarnation(store, job, env.rank, LaunchRound.of(env))
    incarnation = incarnation_for(config.run_id, env.world_size)
    if incarnation.weak and env.rank == 0:
        log.warning(
            "no launch id (CKPTD_RUN_ID, TORCHELASTIC_RUN_ID, SLURM_JOB_ID) and no torch.distributed "
            "store: save attempts are named after %s; a relaunch on the same address repeats them. "
            "Set CKPTD_RUN_ID to one value per launch on every rank",
            incarnation.source,
        )
    return incarnation
