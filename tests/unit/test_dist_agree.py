"""DistContext.agree raises on every rank when one failed: the others raise the failed rank's error
class, naming rank and message (ckptd.dist)."""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.dist import DistContext
from ckptd.errors import CkptdError, CopyRoundError, StorageError


class _TwoRanks(DistContext):
    """Rank 0 of two, whose rank 1 answered ``other`` (the gather's transport is torch's)."""

    def __init__(self, other: Any) -> None:
        super().__init__(0, 2, None)
        self.other = other

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj, self.other]


def test_another_ranks_error_is_raised_as_its_class_or_as_a_ckptd_error():
    with pytest.raises(StorageError, match=r"planning failed on another rank: rank 1: StorageError: no space"):
        _TwoRanks(("error", "StorageError", "no space")).agree("planning", lambda: 1)
    # A class that takes more than a message (CopyRoundError names a node) raised a TypeError.
    with pytest.raises(CkptdError, match=r"rank 1: CopyRoundError: boom") as err:
        _TwoRanks(("error", "CopyRoundError", "boom")).agree("copy", lambda: 1)
    assert type(err.value) is CkptdError and not isinstance(err.value, CopyRoundError)
    assert _TwoRanks(("ok", 2)).agree("fine", lambda: 1) == [1, 2]
