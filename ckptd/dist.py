"""The few collectives a synchronous save needs, over torch.distributed when it is initialized.

Every collective step goes through :meth:`DistContext.agree`, so that an error on one rank is
raised on every rank (with that rank's message) instead of leaving the others hanging.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as tdist

from .errors import CkptdError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    group: Any = None

    @classmethod
    def current(cls, group: Any = None) -> DistContext:
        if tdist.is_available() and tdist.is_initialized():
            return cls(tdist.get_rank(group), tdist.get_world_size(group), group)
        return cls(0, 1, None)

    def all_gather(self, obj: T) -> list[T]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        tdist.all_gather_object(out, obj, group=self.group)
        return out

    def agree(self, step: str, fn: Callable[[], T]) -> list[T]:
        """Run ``fn`` on every rank and gather results; if any rank failed, raise everywhere.

        The raising rank re-raises its own exception; the others raise the same exception class
        naming the failed ranks and their messages.
        """
        error: BaseException | None = None
        try:
            result: Any = fn()
            payload: Any = ("ok", result)
        except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
            error = exc
            payload = ("error", type(exc).__name__, str(exc))
            result = None
        gathered = self.all_gather(payload)
        failures = [(r, p) for r, p in enumerate(gathered) if p[0] == "error"]
        if failures:
            if error is not None:
                raise error
            detail = "; ".join(f"rank {r}: {p[1]}: {p[2]}" for r, p in failures)
            message = f"{step} failed on another rank: {detail}"
            try:
                other = error_class(failures[0][1][1])(message)
            except TypeError:  # a class that takes more than its message (CopyRoundError: a node)
                other = CkptdError(message)
            raise other
        return [p[1] for p in gathered]


def error_class(name: str) -> type[Exception]:
    """The ckptd exception class named ``name`` (another rank's error), else CkptdError."""
    from . import errors

    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, CkptdError):
        return cls
    return CkptdError
