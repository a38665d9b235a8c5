"""What a load does when the request and the checkpoint disagree on keys (Megatron's StrictHandling).

Terms (as Megatron-Core defines them):

- *unexpected* keys are requested but not in the checkpoint (known on each rank locally);
- *missing* keys are in the checkpoint but requested by no rank (needs every rank's request, so
  the ``*_ALL`` modes exchange requested keys over the process group: call ``load`` on every
  rank of it).

Keys are ShardedTensor keys and ShardedObject unique keys, after key mapping.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum

from ..errors import LoadMismatchError

log = logging.getLogger("ckptd.loading")


class StrictHandling(Enum):
    """How :func:`ckptd.load` handles unexpected and missing keys (values as in Megatron-Core)."""

    #: Unexpected keys raise LoadMismatchError when planning reads (the default; no extra work).
    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    #: Log unexpected keys (WARNING) and skip them; missing keys are ignored.
    LOG_UNEXPECTED = "log_unexpected"
    #: Log unexpected and missing keys (WARNING); skip the unexpected ones.
    LOG_ALL = "log_all"
    #: Raise LoadMismatchError listing every unexpected key, before reading anything.
    RAISE_UNEXPECTED = "raise_unexpected"
    #: Raise LoadMismatchError listing unexpected and missing keys, before reading anything.
    RAISE_ALL = "raise_all"
    #: Skip unexpected keys and return ``(state_dict, missing, unexpected)`` (missing empty).
    RETURN_UNEXPECTED = "return_unexpected"
    #: Skip unexpected keys and return ``(state_dict, missing, unexpected)``.
    RETURN_ALL = "return_all"
    #: Skip unexpected keys silently.
    IGNORE_ALL = "ignore_all"

    @property
    def needs_global_keys(self) -> bool:
        return self in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @property
    def returns_mismatch(self) -> bool:
        return self in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict(strict: StrictHandling | str | bool) -> StrictHandling:
    """Accept the enum, its value string (``"raise_all"``) or name, or a bool (True = assume ok,
    False = log unexpected, as Megatron-LM's ``--dist-ckpt-strictness`` defaults)."""
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, bool):
        return StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED
    if isinstance(strict, str):
        for mode in StrictHandling:
            if strict.lower() in (mode.value, mode.name.lower()):
                return mode
    raise LoadMismatchError(
        f"strict={strict!r} is not a strict-handling mode; use one of {[m.value for m in StrictHandling]}"
    )


@dataclass
class Mismatch:
    missing: set[str]
    unexpected: set[str]


def report(strict: StrictHandling, mismatch: Mismatch, checkpoint: str) -> None:
    """Log or raise according to ``strict`` (the caller already dropped unexpected keys)."""
    missing = mismatch.missing if strict.needs_global_keys else set()
    unexpected = mismatch.unexpected
    if not missing and not unexpected:
        return
    parts = []
    if unexpected:
        parts.append(f"requested but not in the checkpoint (unexpected, this rank): {sorted(unexpected)}")
    if missing:
        parts.append(f"in the checkpoint but requested by no rank (missing): {sorted(missing)}")
    msg = f"load of {checkpoint}: " + "; ".join(parts)
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        raise LoadMismatchError(
            msg + ". Fix the request or the key mapping, or pass a non-raising strict mode "
            "(e.g. strict='log_all') to skip them."
        )
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
        log.warning("%s", msg)
