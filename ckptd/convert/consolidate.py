"""torch_dist -> one consolidated ``torch.save`` state dict (every tensor whole, on CPU)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from ..format.durable import atomic_write

log = logging.getLogger("ckptd.convert")


def consolidate(
    checkpoint_dir: str | os.PathLike,
    out_file: str | os.PathLike,
    *,
    include_common: bool = False,
    allow_unsafe_pickle: bool = False,
    fsync: bool = True,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write every tensor of the checkpoint, whole, into ``out_file`` (atomically).

    The file holds ``{key: tensor}`` (load it with ``torch.load(..., weights_only=True)`` and
    ``model.load_state_dict``), or ``{"state_dict": {...}, "common": common state}`` with
    ``include_common``. Needs memory for the whole model. ``progress(nbytes)`` is called as
    tensor bytes are read. Returns what was written.
    """
    from ..api import load_common_state_dict, load_plain_tensors

    tensors = load_plain_tensors(checkpoint_dir, progress=progress, allow_unsafe_pickle=allow_unsafe_pickle)
    payload: dict[str, Any] = tensors
    if include_common:
        payload = {
            "state_dict": tensors,
            "common": load_common_state_dict(checkpoint_dir, allow_unsafe_pickle=allow_unsafe_pickle),
        }
    atomic_write(Path(out_file), lambda f: torch.save(payload, cast(BinaryIO, f)), fsync=fsync)
    log.info("consolidated %d tensors of %s into %s", len(tensors), checkpoint_dir, out_file)
    return payload
