"""Synchronous save and load of sharded state dicts in the torch_dist format.

Order of a multi-rank :func:`save` (every rank calls it; collectives over torch.distributed):

1. (all ranks) apply factories, split the state dict, build item records; local checks.
2. (all ranks) gather records; rank 0 validates global coverage; everyone agrees or raises.
3. (all ranks) write ``__<rank>_0.distcp`` and fsync it.
4. (rank 0) gather stored records, write ``common.pt``, ``.metadata``, ``metadata.json`` (last).

Nothing is written before step 2 succeeded, so bad input never touches the target directory.
:func:`load` needs no collectives: each rank reads only the chunks it asked for.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from .dist import DistContext
from .errors import CheckpointExistsError, ShardingError
from .format.dcp_metadata import CheckpointIndex, read_index
from .format.durable import Opener, default_opener, fsync_dir
from .format.finalize import finalize, serialize_common
from .format.items import PlannedItem, plan_object, plan_tensor, write_data_file
from .format.layout import DCP_METADATA, METADATA_JSON, data_file_name, read_backend_metadata
from .format.reader import DataFiles, load_object_bytes, read_common
from .format.records import ItemRecord, storage_layout
from .format.validate import check_local_duplicates, validate_records
from .load.execute import execute
from .load.plan import ReadPlan, missing_key_error
from .load.plan import plan_tensor as plan_tensor_read
from .mapping import ShardedObject, ShardedTensor, is_main_replica
from .state_dict import Path as SdPath
from .state_dict import SplitStateDict, assemble, split_state_dict

log = logging.getLogger(__name__)


def plan_save(split: SplitStateDict, rank: int) -> list[PlannedItem]:
    """Items this rank stores: main replicas only, in state-dict order."""
    items: list[PlannedItem] = []
    for path, sh in split.sharded.items():
        if not is_main_replica(sh.replica_id):
            continue
        if isinstance(sh, ShardedTensor):
            if sh.data is None:
                raise ShardingError(f"ShardedTensor '{sh.key}' at {path} has no data to save")
            items.append(plan_tensor(sh, rank))
        else:
            items.append(plan_object(sh, rank))
    check_local_duplicates([i.record for i in items], rank)
    return items


def check_save_target(checkpoint_dir: Path) -> None:
    for marker in (METADATA_JSON, DCP_METADATA):
        if (checkpoint_dir / marker).exists():
            raise CheckpointExistsError(
                f"{checkpoint_dir} already holds a checkpoint ({marker} exists); ckptd never "
                "overwrites one. Save to a new directory, or delete the old one first."
            )


def save(
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    process_group: Any = None,
    opener: Opener = default_opener,
    fsync: bool = True,
) -> None:
    """Save a sharded state dict into ``checkpoint_dir`` (created if needed; must hold no checkpoint).

    Call on every rank of ``process_group`` (default: the world, or a single process when
    torch.distributed is not initialized). Blocks until the checkpoint is complete and durable.
    """
    ctx = DistContext.current(process_group)
    root = Path(checkpoint_dir)
    split = split_state_dict(sharded_state_dict)
    prepared: list[PlannedItem] = []

    def prepare() -> list[dict]:
        if ctx.rank == 0:
            check_save_target(root)
        items_ = plan_save(split, ctx.rank)
        prepared.extend(items_)
        return [i.record.to_wire() for i in items_]

    planned = ctx.agree("checkpoint planning", prepare)

    def validate() -> None:
        if ctx.rank == 0:
            validate_records([ItemRecord.from_wire(r) for rank_recs in planned for r in rank_recs])
            root.mkdir(parents=True, exist_ok=True)

    ctx.agree("checkpoint validation", validate)

    def write() -> list[dict]:
        if not prepared:
            return []
        stored = write_data_file(root, data_file_name(ctx.rank), prepared, opener, fsync)
        return [r.to_wire() for r in stored]

    stored_by_rank = ctx.agree("writing data files", write)
    common_bytes = serialize_common(split.common) if ctx.rank == 0 else b""

    def commit() -> None:
        if ctx.rank == 0:
            records = [ItemRecord.from_wire(r) for recs in stored_by_rank for r in recs]
            finalize(root, records, common_bytes, opener, fsync)
            if fsync:
                fsync_dir(root.parent if root.parent != root else root)

    ctx.agree("checkpoint finalization", commit)
    log.info("saved checkpoint %s (rank %d, %d items)", root, ctx.rank, len(prepared))


def _open_checkpoint(checkpoint_dir: str | os.PathLike, allow_unsafe_pickle: bool) -> CheckpointIndex:
    read_backend_metadata(checkpoint_dir)
    return read_index(checkpoint_dir, allow_unsafe_pickle)


def load(
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    allow_unsafe_pickle: bool = False,
) -> dict[str, Any]:
    """Load the entries described by ``sharded_state_dict`` and return a plain state dict.

    The result starts from the stored common state; ShardedTensors are filled (in their ``data``
    tensors when given, so loading is in place), ShardedObjects and factories are resolved, and
    LocalNonPersistentObjects are unwrapped. Works with any world size and any chunking whose
    global shapes match the checkpoint. ``allow_unsafe_pickle`` permits arbitrary objects in
    ``common.pt``/ShardedObjects (only for trusted checkpoints).
    """
    index = _open_checkpoint(checkpoint_dir, allow_unsafe_pickle)
    split = split_state_dict(sharded_state_dict)
    common = read_common(checkpoint_dir, allow_unsafe_pickle)
    loaded: dict[SdPath, Any] = {}
    plan = ReadPlan()
    pending: list[tuple[SdPath, ShardedTensor, torch.Tensor, torch.Tensor]] = []
    objects: list[tuple[SdPath, ShardedObject]] = []
    for path, sh in split.sharded.items():
        if isinstance(sh, ShardedObject):
            objects.append((path, sh))
            continue
        if sh.data is None:
            sh.init_data("cpu")
        _, _, sizes = storage_layout(sh)
        data = sh.data
        direct = data.device.type == "cpu" and data.is_contiguous()
        target = data.view(sizes) if direct else torch.empty(sizes, dtype=sh.dtype)
        plan_tensor_read(plan, sh, target, index)
        pending.append((path, sh, data, target))
    execute(plan, checkpoint_dir)
    for path, sh, data, target in pending:
        if target.data_ptr() != data.data_ptr() or target.device != data.device:
            data.copy_(target.view(data.shape))
        loaded[path] = data
    if objects:
        with DataFiles(checkpoint_dir) as files:
            for path, sh in objects:
                stored = index.objects.get(sh.unique_key)
                if stored is None:
                    raise missing_key_error(sh.unique_key, sorted(index.objects), "ShardedObject")
                what = f"ShardedObject '{sh.unique_key}'"
                raw = files.read(stored.relative_path, stored.file_offset, stored.length, what)
                loaded[path] = load_object_bytes(raw, f"{what} in {stored.relative_path}", allow_unsafe_pickle)
    return assemble(split, common, loaded)


def load_common_state_dict(checkpoint_dir: str | os.PathLike, *, allow_unsafe_pickle: bool = False) -> Any:
    """Only the common (non-sharded) state, saved by rank 0."""
    read_backend_metadata(checkpoint_dir)
    return read_common(checkpoint_dir, allow_unsafe_pickle)


def load_tensors_metadata(checkpoint_dir: str | os.PathLike) -> dict[str, ShardedTensor]:
    """Every stored tensor as a data-less ShardedTensor covering the whole global tensor."""
    index = _open_checkpoint(checkpoint_dir, False)
    return {
        key: ShardedTensor.from_rank_offsets(key, torch.empty(t.shape, dtype=t.dtype, device="meta")).without_data()
        for key, t in sorted(index.tensors.items())
    }


def load_sharded_metadata(checkpoint_dir: str | os.PathLike) -> dict[str, ShardedTensor | ShardedObject]:
    """Tensors (as in :func:`load_tensors_metadata`) plus data-less ShardedObjects by unique key."""
    out: dict[str, ShardedTensor | ShardedObject] = dict(load_tensors_metadata(checkpoint_dir))
    index = read_index(checkpoint_dir)
    for unique_key in sorted(index.objects):
        try:
            obj = ShardedObject.empty_from_unique_key(unique_key)
        except ShardingError:
            continue  # a plain DCP byte item (not a ShardedObject): not part of the sharded view
        out[obj.unique_key] = obj
    return out


def load_plain_tensors(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every stored tensor, whole, as a plain CPU tensor (no sharding; for inspection/conversion)."""
    templates = load_tensors_metadata(checkpoint_dir)
    request: dict[str, Any] = {}
    for key, sh in templates.items():
        sh.init_data("cpu")
        request[key] = sh
    loaded = load(request, checkpoint_dir)
    return {k: loaded[k] for k in templates}


__all__ = [
    "save",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_plain_tensors",
]
