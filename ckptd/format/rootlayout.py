"""What a checkpoint root holds: the names of its trackers, step directories and partial saves.

A *root* is where an asynchronous Checkpointer saves a series of checkpoints::

    <root>/
      latest                              tracker: name of the newest committed checkpoint
      latest_checkpointed_iteration.txt   Megatron-LM's tracker: that step's number (never 0)
      iter_0000100/                       committed (the final name appears only after the commit)
      iter_0000200.<attempt>.tmp/         an attempt in flight, or abandoned by a crash: never loaded
        __1_0.distcp.<random>.part        a data file its writer has not finished
      iter_0000050.deleting/              being removed by gc (renamed first, so never mistaken
                                          for a committed checkpoint)
      .ckptd-n0.lock                      held by node 0's daemon while it runs: one job per root
                                          (ckptd.daemon.rootlock); one per node

``<attempt>`` is an attempt id ``<12 hex digits>-<n>`` (:mod:`ckptd.control.attempt`); older ckptd
versions wrote ``iter_0000200.tmp``, which is still a partial save. Every module that names or
recognises one of these entries takes the names from here; what is inside one checkpoint
directory is :mod:`ckptd.format.layout`'s.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

TRACKER_FILE = "latest"
# Two tiers (ckptd.roots.mirror): the local step the mirror's latest checkpoint copies, written by
# the mirror thread; retention keeps that step until a newer one is mirrored, so that a resume
# after a rollback finds the mirror's commit in the local root and knows the local one is newer.
MIRRORED_FILE = "ckptd_mirrored"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
STEP_PREFIX = "iter_"
TMP_SUFFIX = ".tmp"  # an attempt's directory until its commit renames it
DELETING_SUFFIX = ".deleting"
PART_SUFFIX = ".part"  # a data file being written inside an attempt's directory
TRACKER_MAX_NBYTES = 4096  # a tracker holds one directory name
LOCK_PREFIX, LOCK_SUFFIX = ".ckptd-n", ".lock"

# Attempt ids become directory names, so they are checked against this before anything is named
# after them (ckptd.control.attempt).
ATTEMPT_PATTERN = r"[0-9a-f]{12}-[1-9][0-9]{0,8}"
_STEP_DIR = re.compile(
    rf"{STEP_PREFIX}(\d+)(?:(?:\.({ATTEMPT_PATTERN}))?({re.escape(TMP_SUFFIX)}|{re.escape(DELETING_SUFFIX)}))?",
    re.ASCII,
)


class StepDirName(NamedTuple):
    """A step directory's name taken apart."""

    step: int
    attempt: str | None  # only in an attempt's name (and in its ``.deleting`` name)
    suffix: str  # "" (committed name), TMP_SUFFIX or DELETING_SUFFIX

    @property
    def partial(self) -> bool:
        return self.suffix == TMP_SUFFIX

    @property
    def deleting(self) -> bool:
        return self.suffix == DELETING_SUFFIX


def parse_step_dir(name: str) -> StepDirName | None:
    """``name`` as a step directory of a root, or None when it is not one: only the names ckptd
    and Megatron-LM give (``iter_`` and the step in at least 7 ASCII digits, no other leading
    zero); ``iter_100``, ``iter_١٠٠`` or a name ending in a newline is none (a hand-made name taken
    for step 100 could be loaded by a resume, or removed by retention)."""
    m = _STEP_DIR.fullmatch(name)
    if m is None or m.group(1) != f"{int(m.group(1)):07d}":
        return None
    return StepDirName(int(m.group(1)), m.group(2), m.group(3) or "")


def committed_step(name: str) -> int | None:
    """The step of a committed directory name (``iter_0000100`` -> 100), else None."""
    parsed = parse_step_dir(name)
    return parsed.step if parsed is not None and not parsed.suffix else None


def step_dir_name(step: int) -> str:
    """The committed directory name of ``step``: ``iter_0000100`` (Megatron-LM's naming)."""
    return f"{STEP_PREFIX}{step:07d}"


def tmp_dir_name(step: int, attempt: str) -> str:
    """The directory attempt ``attempt`` (a checked attempt id) of ``step`` is written into."""
    return f"{step_dir_name(step)}.{attempt}{TMP_SUFFIX}"


def tmp_dir(root: Path, step: int, attempt: str) -> Path:
    """Where attempt ``attempt`` of ``step`` is written until its commit."""
    return root / tmp_dir_name(step, attempt)


def deleting_name(name: str) -> str:
    """What gc renames the step directory ``name`` to before it deletes it."""
    return name.removesuffix(TMP_SUFFIX) + DELETING_SUFFIX


def part_file_name(name: str, token: str) -> str:
    """The private name data file ``name`` is written under until it is complete."""
    return f"{name}.{token}{PART_SUFFIX}"


def is_part_file(name: str) -> bool:
    return name.endswith(PART_SUFFIX)


def node_lock_name(node: int) -> str:
    """The lock file node ``node``'s daemon holds in the root while it runs."""
    return f"{LOCK_PREFIX}{node}{LOCK_SUFFIX}"


def is_node_lock(name: str) -> bool:
    return name.startswith(LOCK_PREFIX) and name.endswith(LOCK_SUFFIX)


def tracker_bytes(checkpoint_name: str) -> bytes:
    """What the ``latest`` tracker holds when it names ``checkpoint_name``."""
    return f"{checkpoint_name}\n".encode()


def megatron_tracker_bytes(step: int) -> bytes:
    """What Megatron-LM's tracker holds when it names ``step``."""
    return f"{step}\n".encode()


def megatron_tracker_name(raw: bytes) -> str | None:
    """The directory Megatron-LM's tracker holding ``raw`` names: the ``iter_<step>`` of the
    number it holds, or ``release``; None when it is not such text."""
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    if text == "release":
        return text
    return step_dir_name(int(text)) if text.isdigit() and len(text) <= 9 else None  # steps < 10^9
