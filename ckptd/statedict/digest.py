"""A digest of common state, to detect ranks whose common state differs from rank 0's.

Only rank 0's common state is saved (Megatron-Core's convention); a rank whose common state
differs (another iteration number, a learning rate it alone changed) would be lost without a
word. Every rank digests its own; the save compares them and logs the ranks that differ, as
Megatron-Core's ``validate_sharding_integrity`` does with ``common_state_dict``.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any


class _DigestPickler(pickle.Pickler):
    """Pickles tensors as (dtype, shape, digest of their bytes) so equal values give equal bytes."""

    def __init__(self, file: io.BytesIO, protocol: int) -> None:
        # torch is imported by the ranks that digest (the node daemon compares digests without it)
        import torch

        super().__init__(file, protocol=protocol)
        self._tensor_types = (torch.Tensor, torch.nn.Parameter)
        self._uint8 = torch.uint8

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, self._tensor_types[0]) and type(obj) in self._tensor_types:
            t = obj.detach().cpu().contiguous().reshape(-1)
            raw = t.view(self._uint8).numpy().tobytes() if t.numel() else b""
            return ("tensor", str(obj.dtype), tuple(obj.shape), hashlib.blake2b(raw, digest_size=16).hexdigest())
        return None


def common_digest(common: Any) -> str | None:
    """A short hex digest of ``common``; None when it cannot be pickled (nothing to compare)."""
    buf = io.BytesIO()
    try:
        _DigestPickler(buf, protocol=4).dump(common)
    except Exception:  # noqa: BLE001 - saving rank 0's common state reports what cannot be pickled
        return None
    return hashlib.blake2b(buf.getvalue(), digest_size=16).hexdigest()


def differing_ranks(digests: list[str | None]) -> list[int]:
    """Ranks whose digest differs from rank 0's (unknown digests never count)."""
    if not digests or digests[0] is None:
        return []
    return [r for r, d in enumerate(digests) if d is not None and d != digests[0]]
