"""A digest of common state, to detect ranks whose common state differs from rank 0's.

Only rank 0's common state is saved (Megatron-Core's convention); a rank whose common state
differs (another iteration number, a learning rate it alone changed) would be lost without a
word. Every rank digests its own; the save compares them and logs the ranks that differ, as
Megatron-Core's ``validate_sharding_integrity`` does with ``common_state_dict``.
"""

from __future__ import annotations

import hashlib
import io
import logging
import pickle
from typing import Any

log = logging.getLogger(__name__)


class _DigestPickler(pickle.Pickler):
    """Pickles tensors as (dtype, shape, digest of their bytes) so equal values give equal bytes."""

    def __init__(self, file: io.BytesIO, protocol: int) -> None:
        # torch is imported by the ranks that digest (the node daemon compares digests without it)
        import torch

        super().__init__(file, protocol=protocol)
        self._tensor_types = (torch.Tensor, torch.nn.Parameter)
        self._uint8 = torch.uint8
        self._strided = torch.strided

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, self._tensor_types[0]) and type(obj) in self._tensor_types:
            if obj.layout is not self._strided:  # sparse and other layouts: their saved bytes
                raw = _saved_bytes(obj)
            else:
                # A conjugate or negative view's memory holds the conjugates or negations: resolved
                # first (its view as bytes raised, and the whole check was given up without a word).
                t = obj.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
                raw = t.view(self._uint8).numpy().tobytes() if t.numel() else b""
            return ("tensor", str(obj.dtype), tuple(obj.shape), hashlib.blake2b(raw, digest_size=16).hexdigest())
        return None


def _saved_bytes(t: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(t.detach().cpu(), buf)
    return buf.getvalue()


def common_digest(common: Any) -> str | None:
    """A short hex digest of ``common``; None when it cannot be pickled (nothing to compare)."""
    buf = io.BytesIO()
    try:
        _DigestPickler(buf, protocol=4).dump(common)
    except Exception as exc:  # noqa: BLE001 - saving rank 0's common state reports what cannot be pickled
        log.warning(
            "the common state could not be digested (%s: %s): whether ranks differ is not checked",
            type(exc).__name__,
            exc,
        )
        return None
    return hashlib.blake2b(buf.getvalue(), digest_size=16).hexdigest()


def differing_ranks(digests: list[str | None]) -> list[int]:
    """Ranks whose digest differs from rank 0's (unknown digests never count)."""
    if not digests or digests[0] is None:
        return []
    return [r for r, d in enumerate(digests) if d is not None and d != digests[0]]
