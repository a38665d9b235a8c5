"""torch_dist -> one consolidated ``torch.save`` state dict (every tensor whole, on CPU)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from ..errors import OutputExistsError, OutputInsideCheckpointError
from ..format.durable import atomic_write
from ..mapping import ShardedObject

log = logging.getLogger("ckptd.convert")


def check_output(checkpoint_dir: Any, out_file: str | os.PathLike, overwrite: bool) -> None:
    """Refuse an ``out_file`` inside ``checkpoint_dir`` (links resolved: replacing or adding a file
    there damages the checkpoint being read, e.g. ``out_file`` = its ``__0_0.distcp``), and an
    existing one unless ``overwrite``."""
    out = Path(out_file)
    local = isinstance(checkpoint_dir, (str, os.PathLike)) and not os.fspath(checkpoint_dir).startswith("s3://")
    if local:
        ckpt = Path(checkpoint_dir).resolve()
        # Both the name as written (its directory resolved: atomic_write replaces a link at `out`)
        # and its target, should `out` be a link.
        for target in (out.parent.resolve() / out.name, out.resolve()):
            if target == ckpt or ckpt in target.parents:
                raise OutputInsideCheckpointError(
                    f"{out} is inside the checkpoint {checkpoint_dir} being consolidated (as {target}); "
                    "writing it would damage that checkpoint. Write the consolidated file elsewhere."
                )
    if os.path.lexists(out) and not overwrite:
        raise OutputExistsError(
            f"{out} already exists; pass --overwrite (overwrite=True) to replace it, or choose another path"
        )


def sharded_object_keys(checkpoint_dir: Any) -> list[str]:
    """The unique keys (``key/shard_<offsets>_<shape>``) of the checkpoint's ShardedObjects
    (Megatron's RNG states, ``_extra_state`` s...), from ``.metadata`` alone."""
    from ..api import load_sharded_metadata

    return [k for k, v in load_sharded_metadata(checkpoint_dir).items() if isinstance(v, ShardedObject)]


def load_sharded_objects(checkpoint_dir: Any, allow_unsafe_pickle: bool) -> dict[str, Any]:
    """Every ShardedObject, decoded, by unique key (``common.pt`` is not read). An object outside
    torch's weights-only allow-list raises UnsafePickleError unless ``allow_unsafe_pickle``."""
    from ..loading.loader import LoadRequest, run_load
    from ..loading.view import completed_objects
    from ..opening import opened

    with opened(checkpoint_dir) as ckpt:
        index = ckpt.index(allow_unsafe_pickle)
        keys = sorted(k for k, stored in completed_objects(index).items() if stored.sharded_object)
        if not keys:
            return {}
        request = {k: ShardedObject.empty_from_unique_key(k) for k in keys}
        loaded = run_load(
            index, LoadRequest(request, ckpt.directory, allow_unsafe_pickle, with_common=False, source=ckpt.source)
        )
        return {k: loaded[k] for k in keys}


def consolidate(
    checkpoint_dir: str | os.PathLike,
    out_file: str | os.PathLike,
    *,
    include_common: bool = False,
    allow_unsafe_pickle: bool = False,
    fsync: bool = True,
    progress: Callable[[int], None] | None = None,
    overwrite: bool = True,
) -> dict[str, Any]:
    """Write every tensor of the checkpoint, whole, into ``out_file`` (atomically).

    The file holds ``{key: tensor}`` (load it with ``torch.load(..., weights_only=True)`` and
    ``model.load_state_dict``), or with ``include_common`` ``{"state_dict": {...}, "common": common
    state, "objects": {unique key: value}}``: ``objects`` holds every ShardedObject (Megatron's RNG
    states, ``_extra_state`` s), decoded, under its unique key ``key/shard_<offsets>_<shape>``.
    Without ``include_common`` they are left out, and logged (a weights-only load of the file
    would refuse most of them). Decoding what torch's weights-only unpickler refuses (the common
    state or objects holding numpy arrays, ``BytesIO`` s...) needs ``allow_unsafe_pickle`` (trusted
    checkpoints only). Needs memory for the whole model. ``progress(nbytes)`` is called as tensor
    bytes are read. Returns what was written.

    ``out_file`` must not be inside ``checkpoint_dir`` (raises OutputInsideCheckpointError); an
    existing ``out_file`` is replaced only with ``overwrite`` (the CLI's default is not to).
    """
    from ..api import load_common_state_dict, load_plain_tensors

    check_output(checkpoint_dir, out_file, overwrite)
    tensors = load_plain_tensors(checkpoint_dir, progress=progress, allow_unsafe_pickle=allow_unsafe_pickle)
    payload: dict[str, Any] = tensors
    if include_common:
        payload = {
            "state_dict": tensors,
            "common": load_common_state_dict(checkpoint_dir, allow_unsafe_pickle=allow_unsafe_pickle),
            "objects": load_sharded_objects(checkpoint_dir, allow_unsafe_pickle),
        }
        left_out = []
    else:
        left_out = sharded_object_keys(checkpoint_dir)
    atomic_write(Path(out_file), lambda f: torch.save(payload, cast(BinaryIO, f)), fsync=fsync)
    log.info("consolidated %d tensors of %s into %s", len(tensors), checkpoint_dir, out_file)
    if left_out:
        log.warning(
            "left out the checkpoint's %d ShardedObjects (pass include_common=True / --with-common to "
            "include them): %s",
            len(left_out),
            ", ".join(left_out),
        )
    return payload
