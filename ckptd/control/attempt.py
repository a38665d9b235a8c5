"""Save attempts: which try of which step a message is about, agreed by every rank without talking.

A step can be tried more than once: a save that aborted (full disk, a dead rank) is retried, and a
restarted job saves again steps that its dead predecessor was saving. Every message about a save
(SAVE, SKIP, WRITTEN, FAILED, STEP_COMMITTED, STEP_ABORTED) carries an *attempt id*
``<incarnation>-<n>`` next to the step, so a report of one try is never counted for another:

- ``incarnation`` (12 hex digits) names one launch of the job: a random tag the ranks agree on
  through the launch's torch.distributed store when there is one (ckptd.client.incarnation), else
  computed by every rank from the same inputs, without any communication (:func:`incarnation_for`);
- ``n`` counts this rank's saves of that step in that incarnation (1 for the first try).

Ranks of one launch that save a step the same number of times therefore send the same id. The
coordinator collects each attempt on its own, in its own ``<step>.<attempt>.tmp`` directory
(ckptd.roots), and aborts a step whose ranks send different attempts, naming them.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import CkptdError, ProtocolError
from ..format.rootlayout import ATTEMPT_PATTERN

# Steps name directories (iter_0000100: ckptd.format.rootlayout), the tracker and Megatron-LM's
# tracker; nobody trains for a billion steps, and a step near 2**64 would pin `latest` (and so
# retention) forever.
MAX_STEP = 10**9 - 1
# Ranks of one job: far above any job's (the largest train on about 10^5 ranks).
MAX_WORLD_SIZE = 1 << 20
_ATTEMPT = re.compile(ATTEMPT_PATTERN)
_TAG_NCHARS = 12


@dataclass(frozen=True, kw_only=True)
class Incarnation:
    """One launch of the job: ``tag`` goes on the wire, ``source`` says where it came from."""

    tag: str
    source: str
    weak: bool = False  # derived from the rendezvous address only: a relaunch may repeat it

    def attempt(self, n: int) -> str:
        """The attempt id of this rank's ``n``-th save of a step (n >= 1)."""
        return f"{self.tag}-{n}"


def _tag(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=_TAG_NCHARS // 2).hexdigest()


def incarnation_for(run_id: str, world_size: int, environ: Mapping[str, str] | None = None) -> Incarnation:
    """This launch's incarnation, identical on every rank of it. In order of preference:

    1. ``run_id`` (``CKPTD_RUN_ID``): set it to a value unique per launch on every rank;
    2. torchrun's ``TORCHELASTIC_RUN_ID`` (a fresh uuid with ``--standalone`` or one node; the
       ``--rdzv-id`` otherwise, so give each job its own);
    3. Slurm's ``SLURM_JOB_ID`` with ``SLURM_STEP_ID`` and ``SLURM_RESTART_COUNT`` (srun tasks);

    each with torchrun's ``TORCHELASTIC_RESTART_COUNT`` when set, so an elastic restart is a new
    incarnation. Without any of them, a single process (``world_size`` 1) takes a random
    incarnation (it has nobody to agree with), and several ranks use ``MASTER_ADDR``,
    ``MASTER_PORT`` and ``WORLD_SIZE`` (``weak``: a relaunch on the same rendezvous port repeats it).
    """
    env = os.environ if environ is None else environ
    parts: list[str] = []
    if run_id:
        parts.append(f"CKPTD_RUN_ID={run_id}")
    elif env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        parts.append(f"TORCHELASTIC_RUN_ID={env['TORCHELASTIC_RUN_ID']}")
    elif env.get("SLURM_JOB_ID"):
        parts += [f"{k}={env[k]}" for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT") if k in env]
    weak = False
    if not parts:
        if world_size == 1:
            parts.append(f"single process {os.getpid()} {secrets.token_hex(8)}")
        else:
            weak = True
            parts += [f"{k}={env.get(k, '')}" for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")]
    if "TORCHELASTIC_RESTART_COUNT" in env:
        parts.append(f"TORCHELASTIC_RESTART_COUNT={env['TORCHELASTIC_RESTART_COUNT']}")
    source = ", ".join(parts)
    return Incarnation(tag=_tag(source), source=source, weak=weak)


def check_world(world_size: int, rank: int | None, *, node_report: bool = False) -> None:
    """Refuse a world size outside 0..MAX_WORLD_SIZE and a rank outside it (ProtocolError, for
    messages): the coordinator counts a world's ranks. ``node_report``: a node daemon's own FAILED
    may say rank -1 (the node itself), world size 0."""
    if not 0 <= world_size <= MAX_WORLD_SIZE:
        raise ProtocolError(f"world size {world_size} is outside 0..{MAX_WORLD_SIZE}")
    if rank is not None and not ((node_report and rank == -1) or 0 <= rank < world_size):
        raise ProtocolError(f"rank {rank} is outside the world size {world_size}")


def check_step(step: int) -> None:
    """Refuse a step outside 0..MAX_STEP (ProtocolError, for messages)."""
    if not 0 <= step <= MAX_STEP:
        raise ProtocolError(f"step {step} is outside 0..{MAX_STEP}")


def check_save_step(step: object) -> None:
    """Refuse a step a Checkpointer cannot save (CkptdError naming the bound)."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise CkptdError(f"step must be an int in 0..{MAX_STEP}, got {step!r}")


def check_attempt(attempt: str) -> None:
    """Refuse anything but ``<12 hex digits>-<n>``: attempt ids become directory names."""
    if not _ATTEMPT.fullmatch(attempt):
        raise ProtocolError(f"attempt id {attempt[:40]!r} is not <12 hex digits>-<n>")
