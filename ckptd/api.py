"""Synchronous save and load of sharded state dicts in the torch_dist format.

Order of a multi-rank :func:`save` (every rank calls it; collectives over torch.distributed):

1. (all ranks) take each top-level Stateful's ``state_dict()``, apply factories, split the state
   dict, build item records of everything the rank holds; local checks.
2. (all ranks) gather records, the keys each rank holds without storing them (replicas) and the
   plain items each holds (DCP-style plain tensors and values); every rank assigns each plain
   item held by several ranks to one writer (:func:`ckptd.statedict.holdings.assign_writers`) and
   drops its other copies (:mod:`ckptd.saveexchange`); rank 0 validates global coverage; everyone
   agrees or raises.
3. (all ranks) write ``__<rank>_0.distcp`` and fsync it.
4. (rank 0) gather stored records, write ``common.pt``, ``.metadata``, ``metadata.json`` (last).

Nothing is written before step 2 succeeded, so bad input never touches the target directory.
:func:`load` needs no collectives: each rank reads only the chunks it asked for.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .dist import DistContext
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    SaveFailedError,
    StorageError,
)
from .format.coverage import check_coverage, dedup_plain
from .format.dcp_metadata import CheckpointIndex, common_items, planner_path
from .format.direct import open_data_file
from .format.durable import Opener, atomic_tmp_name, default_opener, fsync_dir, make_dirs_durably
from .format.finalize import finalize, serialize_common
from .format.items import PlannedItem, write_data_file
from .format.layout import (
    COMMON_PT,
    DCP_METADATA,
    METADATA_JSON,
    data_file_name,
    read_backend_metadata,
)
from .format.reader import DataFiles, read_bytes_item, read_common, read_common_pt
from .format.records import ItemRecord
from .format.saveplan import plan_rank
from .format.validate import validate_records
from .loading.execute import ExecOptions, LoadStats
from .loading.keymap import Rule
from .loading.loader import KeysAgreement, LoadRequest, run_load
from .loading.strict import StrictHandling, parse_strict
from .loading.view import CheckpointView, VirtualTensor, completed_objects, is_legacy_grid
from .mapping import ShardedObject, ShardedTensor
from .opening import OpenedCheckpoint, opened
from .s3save import S3SaveTarget
from .saveexchange import (
    check_one_dialect,
    plain_writers,
    planned_record,
    reported_dialect,
    warn_differing_common,
    with_replicated_crcs,
)
from .statedict.content import CONTENT_METADATA_KEY, with_content_metadata
from .statedict.digest import common_digest
from .statedict.holdings import plain_sizes
from .statedict.split import split_state_dict
from .statedict.stateful import expand_stateful, load_stateful
from .statedict.tree import set_path
from .storage.nodeview import NodeLocalCheckpoint
from .storage.url import S3Location, parse_location

log = logging.getLogger(__name__)


def check_save_target(checkpoint_dir: Path) -> None:
    """Raise unless ``checkpoint_dir`` can receive a new checkpoint (absent, or a directory
    holding no checkpoint)."""
    if checkpoint_dir.exists() and not checkpoint_dir.is_dir():
        raise CheckpointExistsError(f"{checkpoint_dir} exists and is not a directory; save to a new directory")
    for marker in (METADATA_JSON, DCP_METADATA):
        if (checkpoint_dir / marker).exists():
            raise CheckpointExistsError(
                f"{checkpoint_dir} already holds a checkpoint ({marker} exists); ckptd never "
                "overwrites one. Save to a new directory, or delete the old one first."
            )


def _remove_partial(root: Path, ctx: DistContext, created_root: bool) -> None:
    """Undo a failed save's files: each rank its data file; rank 0 every rank's data file (all
    writes have ended once a collective step failed) and the metadata files.

    Only called while ``metadata.json`` is absent: the directory never held a checkpoint, so
    nothing but this save's own files is removed.
    """
    names = [data_file_name(ctx.rank)]
    if ctx.rank == 0:
        names = [data_file_name(r) for r in range(ctx.world_size)]
        names += [COMMON_PT, DCP_METADATA, *map(atomic_tmp_name, (COMMON_PT, DCP_METADATA, METADATA_JSON))]
    for name in names:
        try:
            (root / name).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove %s after a failed save: %s", root / name, exc)
    if ctx.rank == 0 and created_root:
        try:
            root.rmdir()  # only if empty
        except OSError:
            pass


def save(
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike | S3Location,
    *,
    process_group: Any = None,
    opener: Opener | None = None,
    fsync: bool = True,
    checksums: bool = True,
    content_metadata: dict | None = None,
) -> None:
    """Save a sharded state dict into ``checkpoint_dir`` (created if needed; must hold no checkpoint),
    a directory or an ``s3://bucket/prefix`` (ckptd.s3save: every rank uploads its data object,
    rank 0 the metadata objects, ``metadata.json`` last).

    Call on every rank of ``process_group`` (default: the world, or a single process when
    torch.distributed is not initialized). Blocks until the checkpoint is complete and durable.
    ``checksums`` records a CRC-32 of every stored item in ``.metadata`` (checked by
    ``ckptd verify``); it is computed while writing, overlapped with the file I/O.

    ``content_metadata`` (a dict describing the checkpoint's content, as Megatron-Core's
    ``save(..., content_metadata=...)``) is stored as Megatron-Core stores it: the state dict's
    ``content_metadata`` entry, in the common state; :func:`load_content_metadata` (or
    Megatron-Core's) reads it back.

    What is stored is what ``torch.distributed.checkpoint.save`` stores: a top-level Stateful
    value (``state_dict()``/``load_state_dict()``) as its ``state_dict()``; a DCP-style plain
    tensor or value held by any set of ranks once, by one of them (see
    :mod:`ckptd.statedict.holdings`; differing copies of a value: the lowest rank's, with a
    warning).

    Errors are raised on every rank (a ckptd exception naming key, rank and file). Bad input is
    detected before anything is written (also a key that ranks hold only as replicas, which no
    rank would store); if writing fails, the files of this save are removed
    again, so ``checkpoint_dir`` never holds a partial checkpoint.
    """
    sharded_state_dict = with_content_metadata(sharded_state_dict, content_metadata)
    ctx = DistContext.current(process_group)
    location = parse_location(checkpoint_dir)
    root = Path(str(location))  # a directory's path; for object storage only named in messages
    prepared: list[PlannedItem] = []
    common: list[bytes] = []
    targets: list[S3SaveTarget] = []

    def prepare() -> dict:
        # Inside the collective: a rank that cannot reach the store (no credentials) fails every
        # rank, instead of leaving them waiting for it in the first collective.
        s3 = S3SaveTarget(location) if isinstance(location, S3Location) else None
        if s3 is not None:
            targets.append(s3)
        split = split_state_dict(expand_stateful(sharded_state_dict))
        if ctx.rank == 0:
            if s3 is not None:
                s3.check()
            else:
                check_save_target(root)
            common.append(serialize_common(split.common))
        plan = plan_rank(split, ctx.rank)
        prepared.extend(plan.items)
        digest = common_digest(split.common) if ctx.world_size > 1 else None
        plain = plain_sizes(split)
        return {
            "records": [planned_record(i, plain, ctx.world_size) for i in plan.items],
            "held": plan.held,
            "plain": plain,
            "common_digest": digest,
            "token": S3SaveTarget.new_token() if s3 is not None and ctx.rank == 0 else "",
            "dialect": reported_dialect(split),
        }

    planned = ctx.agree("checkpoint planning", prepare)
    s3 = targets[0] if targets else None
    check_one_dialect([p["dialect"] for p in planned])
    token = planned[0]["token"]  # names this save's data objects (object storage)
    warn_differing_common([p["common_digest"] for p in planned], ctx.rank, str(root))
    writers = plain_writers([p["plain"] for p in planned])
    by_rank = with_replicated_crcs(ctx, [p["records"] for p in planned], prepared)
    # Every rank decides alike which copy of an item several ranks hold is stored (a plain item's
    # writer, a replicated DTensor chunk's lowest holder), and drops its own other copies.
    kept, differing = dedup_plain([r for records in by_rank for r in records], writers)
    kept_ids = {id(r) for r in kept}
    prepared[:] = [i for i, r in zip(prepared, by_rank[ctx.rank], strict=True) if id(r) in kept_ids]
    created_root = [False]

    def validate() -> None:
        if ctx.rank == 0:
            for warning in differing:
                log.warning("save of %s: %s", root, warning)
            check_coverage(kept, {r: p["held"] for r, p in enumerate(planned)})
            validate_records(kept)
            if s3 is None:
                created_root[0] = not root.exists()
                try:
                    make_dirs_durably(root, fsync=fsync)  # each new parent's entry too, not only root's
                except OSError as exc:
                    raise StorageError.from_oserror(exc, root) from exc

    ctx.agree("checkpoint validation", validate)

    def write() -> list[ItemRecord]:
        if not prepared:
            return []
        if s3 is not None:
            return s3.write(ctx.rank, token, prepared, checksums)
        name = data_file_name(ctx.rank)
        try:
            stored = write_data_file(root, name, prepared, opener or open_data_file, fsync, checksums)
        except OSError as exc:
            raise SaveFailedError(
                f"rank {ctx.rank} could not write {root / name}: {exc}. Nothing was committed "
                "and this save's files were removed; fix the storage (space, permissions) and "
                "save again"
            ) from exc
        return stored

    def commit() -> None:
        if ctx.rank == 0 and s3 is not None:
            s3.finalize([r for recs in stored_by_rank for r in recs], common[0])
        elif ctx.rank == 0:
            records = [r for recs in stored_by_rank for r in recs]
            try:
                finalize(root, records, common[0], opener or default_opener, fsync)
            except OSError as exc:
                raise SaveFailedError(
                    f"rank 0 could not write the metadata of {root}: {exc}. Nothing was "
                    "committed and this save's files were removed; fix the storage and save again"
                ) from exc
            if fsync:
                try:
                    fsync_dir(root.parent if root.parent != root else root)
                except OSError as exc:  # metadata.json is in place: the checkpoint stays, and loads
                    raise SaveFailedError(
                        f"{root} is complete and loads, but its entry in {root.parent} could not be made "
                        f"durable ({exc}): a power loss may lose it; fix the storage (a save into it again "
                        "is refused: it holds a checkpoint)"
                    ) from exc

    try:
        stored_by_rank = ctx.agree("writing data files", write)
        ctx.agree("checkpoint finalization", commit)
    except Exception:
        if s3 is not None:
            s3.remove_partial(ctx.rank, ctx.world_size, token)
        elif not (root / METADATA_JSON).exists():
            _remove_partial(root, ctx, created_root[0])
        raise
    log.info("saved checkpoint %s (rank %d, %d items)", root, ctx.rank, len(prepared))


def load(
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike | S3Location | NodeLocalCheckpoint,
    *,
    allow_unsafe_pickle: bool = False,
    strict: StrictHandling | str | bool = StrictHandling.ASSUME_OK_UNEXPECTED,
    key_mapping: Sequence[Rule] | None = None,
    process_group: Any = None,
    stats: LoadStats | None = None,
    allow_dtype_cast: bool = True,
    verify_partial: bool = False,
) -> Any:
    """Load the entries described by ``sharded_state_dict`` and return the loaded state dict.

    Any state dict ckptd saves can be requested (see :mod:`ckptd.statedict.split`):

    - *Megatron-style* (ckptd's or Megatron-Core's ShardedTensor / ShardedObject /
      ShardedTensorFactory / LocalNonPersistentObject): the result is a new dict that starts from
      the stored common state; ShardedTensors are filled (in their ``data`` tensors when given,
      so loading is in place), ShardedObjects and factories are resolved, and
      LocalNonPersistentObjects are unwrapped, as Megatron-Core's ``dist_checkpointing.load``.
    - *DCP-style* (DTensors, plain tensors and values, e.g. from ``get_state_dict``): filled in
      place and returned, as ``torch.distributed.checkpoint.load``: every tensor and DTensor
      receives its values, every other value is replaced by the stored one.

    Any parallel layout loads any checkpoint: each requested chunk (N-D, ``flattened_range`` or a
    DTensor's shard on any mesh) is assembled from the stored chunks that overlap it, reading only
    those byte ranges. ``allow_shape_mismatch`` tensors are zero-padded / truncated where the
    global shapes differ.

    ``strict`` (a :class:`StrictHandling` or its value string) decides what happens to requested
    keys the checkpoint lacks (default: raise) and stored keys nobody requested; the ``return_*``
    modes return ``(state_dict, missing_keys, unexpected_keys)``, and the ``*_all`` modes exchange
    requested keys over ``process_group`` (call on every rank). A request that matches nothing
    stored while the checkpoint holds tensors raises LoadMismatchError in every mode.
    ``key_mapping`` is a list of :mod:`ckptd.loading.keymap` rules (rename / fuse / split) applied to the
    checkpoint's keys before resharding. ``stats`` (a :class:`ckptd.loading.execute.LoadStats`) is
    filled with what was read. A top-level Stateful value (``state_dict()``/``load_state_dict()``)
    is loaded as ``dcp.load`` does: its ``state_dict()`` is filled, then its ``load_state_dict()``
    is called with it. ``allow_unsafe_pickle`` permits arbitrary objects in the pickled
    state that is decoded (``common.pt`` for Megatron-style requests, requested ShardedObjects
    and values; only for trusted checkpoints). No daemon and no collective is needed (except for
    ``*_all``).

    ``allow_dtype_cast`` (default True, as ``dcp.load`` and Megatron-Core's load do): a tensor
    requested in another dtype than stored is read in the stored dtype and cast with
    ``Tensor.copy_`` (float32 to bfloat16 rounds, float to int truncates); False raises
    LoadMismatchError instead.

    Every item read whole is checked against the CRC-32C recorded at save time (a mismatch is a
    CorruptCheckpointError naming key, file and byte range); so is ``common.pt``. A rank that reads
    only part of an item (a load onto a finer layout) checks the 4 MiB blocks it read against their
    recorded block checksums. In checkpoints without block checksums (older ckptd) such an item
    larger than 64 KiB is checked only with ``verify_partial=True``, reading all of it
    (``Checkpointer.load()`` without ``step`` does, so that a resume never takes bit rot for
    state); otherwise ``LoadStats.items_unverified`` counts it (``ckptd verify`` checks every byte).

    The load holds a lease on ``checkpoint_dir`` (:mod:`ckptd.format.lease`): retention and
    ``ckptd gc`` do not remove it meanwhile. A checkpoint removed anyway (no lease on this
    filesystem, or by hand) raises CheckpointRemovedError; nothing half-loaded is returned.

    ``checkpoint_dir`` may also be a commit of node-local disks (a
    :class:`ckptd.storage.nodeview.NodeLocalCheckpoint`, as ``Checkpointer.load`` passes with config
    ``node_local``): read from this node's disk where it holds the files, else from the mirror.
    """
    agreement = (
        KeysAgreement(DistContext.current(process_group), str(checkpoint_dir))
        if parse_strict(strict).needs_global_keys
        else None
    )
    try:
        with opened(checkpoint_dir) as ckpt:
            index = ckpt.index(allow_unsafe_pickle)

            def load_checked(request: Any) -> Any:
                out = run_load(
                    index,
                    LoadRequest(
                        request,
                        ckpt.directory,
                        allow_unsafe_pickle,
                        strict,
                        key_mapping,
                        process_group,
                        stats,
                        has_common=ckpt.has_common,
                        allow_dtype_cast=allow_dtype_cast,
                        source=ckpt.source,
                        options=ExecOptions(verify_partial=True) if verify_partial else None,
                        agreement=agreement,
                    ),
                )
                ckpt.check_unchanged()  # before a Stateful's load_state_dict takes what was read
                return out

            return load_stateful(sharded_state_dict, load_checked)
    except Exception as exc:
        if agreement is not None:
            agreement.join_failed(exc)
        raise


def load_common_state_dict(checkpoint_dir: str | os.PathLike | S3Location, *, allow_unsafe_pickle: bool = False) -> Any:
    """The whole common (non-sharded) state: ``common.pt`` (saved by rank 0) plus the values stored
    as DCP bytes items (DCP-style saves, plain torch DCP checkpoints), nested as saved."""
    with opened(checkpoint_dir) as ckpt:
        read_backend_metadata(ckpt.directory)
        return read_common(ckpt.directory, allow_unsafe_pickle, source=ckpt.source)


def load_content_metadata(
    checkpoint_dir: str | os.PathLike | S3Location | None = None,
    *,
    preloaded_state_dict: dict[str, Any] | None = None,
    allow_unsafe_pickle: bool = False,
) -> dict | None:
    """The ``content_metadata`` saved with the checkpoint (``save(..., content_metadata=...)``, by
    ckptd or Megatron-Core), or None when it has none; as Megatron-Core's ``load_content_metadata``.

    ``preloaded_state_dict``: a state dict already loaded (e.g. ``ckpt.load(...)``'s result), read
    instead of the checkpoint. Otherwise only ``common.pt`` is decoded (or, for a DCP-style save,
    its values, nested again: an empty ``content_metadata`` of a DCP-style save reads as None, and
    tensors in one are left out).
    """
    if preloaded_state_dict is not None:
        return preloaded_state_dict.get(CONTENT_METADATA_KEY)
    if checkpoint_dir is None:
        raise CheckpointNotFoundError("load_content_metadata needs checkpoint_dir or preloaded_state_dict")
    with opened(checkpoint_dir) as ckpt:
        index = ckpt.index(allow_unsafe_pickle)
        common = read_common_pt(
            ckpt.directory,
            allow_unsafe_pickle,
            expected=ckpt.has_common,
            crc=index.common_crc,
            checksum=index.checksum,
        )
        if isinstance(common, dict) and CONTENT_METADATA_KEY in common:
            return common[CONTENT_METADATA_KEY]
        # A DCP-style save flattens its content_metadata like the rest of the state dict (as torch
        # DCP does): its values are nested again from their DCP paths (its tensors, if any, are
        # not); no other value is decoded.
        items = [o for o in common_items(index) if planner_path(index, o.fqn)[:1] == (CONTENT_METADATA_KEY,)]
        if not items:
            return None
        tree: dict[str, Any] = {}
        with DataFiles(ckpt.directory, ckpt.source) as files:
            for obj in items:
                value = read_bytes_item(files, obj, allow_unsafe_pickle, index.checksum)
                set_path(tree, planner_path(index, obj.fqn), value)
        found = tree.get(CONTENT_METADATA_KEY)
        return found if isinstance(found, dict) else None


def load_tensors_metadata(checkpoint_dir: str | os.PathLike | S3Location) -> dict[str, ShardedTensor]:
    """Every stored tensor as a data-less ShardedTensor covering the whole global tensor."""
    with opened(checkpoint_dir) as ckpt:
        return _tensor_templates(ckpt.index())


def _tensor_templates(index: CheckpointIndex) -> dict[str, ShardedTensor]:
    """Each tensor at its global shape: a tensor Megatron-Core (0.8 to 0.13) stored in its flattened
    grid layout at the shape it records (as Megatron-Core's own ``load_tensors_metadata`` gives
    it), so loading the template translates the grid. At the stored shape, such a tensor came back
    in grid order, and reshaping it to its real shape permuted its values."""
    view = CheckpointView.of_index(index)

    def shape(key: str, t: VirtualTensor) -> tuple[int, ...]:
        real = view.grid_shapes.get(key)
        return real if real is not None and real != t.shape and is_legacy_grid(t, real) else t.shape

    return {
        key: ShardedTensor.from_rank_offsets(
            key, torch.empty(shape(key, t), dtype=t.dtype, device="meta")
        ).without_data()
        for key, t in sorted(view.tensors.items())
    }


def load_sharded_metadata(checkpoint_dir: str | os.PathLike | S3Location) -> dict[str, ShardedTensor | ShardedObject]:
    """Tensors (as in :func:`load_tensors_metadata`) plus data-less ShardedObjects by unique key.

    Byte items of a plain torch DCP checkpoint that are not ShardedObject shards are common
    state (see :func:`load_common_state_dict`), not listed here.
    """
    with opened(checkpoint_dir) as ckpt:
        index = ckpt.index()
    out: dict[str, ShardedTensor | ShardedObject] = dict(_tensor_templates(index))
    for unique_key, stored in sorted(completed_objects(index).items()):
        if stored.sharded_object:
            obj = ShardedObject.empty_from_unique_key(unique_key)
            out[obj.unique_key] = obj
    return out


def load_plain_tensors(
    checkpoint_dir: str | os.PathLike | S3Location,
    *,
    progress: Callable[[int], None] | None = None,
    batch_nbytes: int = 256 << 20,
    allow_unsafe_pickle: bool = False,
) -> dict[str, torch.Tensor]:
    """Every stored tensor, whole, as a plain CPU tensor (no sharding; for inspection/conversion).

    No pickled state is decoded (``common.pt``, objects), so a checkpoint whose common state holds
    arbitrary objects loads without ``allow_unsafe_pickle``; that flag only lets ``.metadata``
    reference classes outside DCP's metadata format (trusted checkpoints only).
    Tensors are read in batches of about ``batch_nbytes``; ``progress(nbytes)`` is called after
    each batch (a CLI hands down a progress bar's ``advance``).
    """
    with opened(checkpoint_dir) as ckpt:
        return _load_plain_tensors(ckpt, progress, batch_nbytes, allow_unsafe_pickle)


def _load_plain_tensors(
    ckpt: OpenedCheckpoint,
    progress: Callable[[int], None] | None,
    batch_nbytes: int,
    allow_unsafe_pickle: bool,
) -> dict[str, torch.Tensor]:
    index = ckpt.index(allow_unsafe_pickle)
    templates = _tensor_templates(index)
    out: dict[str, torch.Tensor] = {}
    batch: dict[str, Any] = {}
    pending = 0

    def flush() -> None:
        nonlocal pending
        if batch:
            loaded = run_load(
                index,
                LoadRequest(batch, ckpt.directory, allow_unsafe_pickle, with_common=False, source=ckpt.source),
            )
            out.update((k, loaded[k]) for k in batch)
            if progress is not None:
                progress(pending)
        batch.clear()
        pending = 0

    for key, sh in templates.items():
        batch[key] = sh
        pending += math.prod(sh.local_shape) * sh.dtype.itemsize  # allocated by the load, once checked
        if pending >= batch_nbytes:
            flush()
    flush()
    return {k: out[k] for k in templates}


__all__ = [
    "save",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_plain_tensors",
]
