"""The load pipeline behind :func:`ckptd.load`.

Order (every rank runs it independently; only the ``*_ALL`` strict modes exchange the requested
keys with the other ranks of the process group):

1. read ``.metadata`` and build the checkpoint view; apply the key mapping;
2. apply factories and split the request (sharded / common / local);
3. find unexpected (requested, not stored) and, for ``*_ALL``, missing (stored, requested by no
   rank) keys; drop or report them per ``strict``;
4. plan: each requested box is intersected with the stored sources (resharding, flattened
   ranges, shape mismatch padding/truncation);
5. execute: read only the needed byte ranges, directly into the request's tensors;
6. read ShardedObjects, assemble the result on top of the common state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..dist import DistContext
from ..format.dcp_metadata import CheckpointIndex
from ..format.reader import DataFiles, load_object_bytes, read_common
from ..keymap import Rule, apply_key_mapping
from ..mapping import ShardedObject, ShardedTensor
from ..state_dict import Path as SdPath
from ..state_dict import assemble, split_state_dict
from .execute import ExecOptions, LoadStats, execute
from .plan import Planner, missing_key_error
from .strict import Mismatch, StrictHandling, parse_strict, report
from .view import CheckpointView


@dataclass
class LoadRequest:
    """Everything :func:`run_load` needs besides the checkpoint index."""

    sharded_state_dict: Any
    checkpoint_dir: str | os.PathLike
    allow_unsafe_pickle: bool = False
    strict: StrictHandling | str | bool = StrictHandling.ASSUME_OK_UNEXPECTED
    key_mapping: Sequence[Rule] | None = None
    process_group: Any = None
    stats: LoadStats | None = None
    options: ExecOptions | None = None


def _requested_key(sh: ShardedTensor | ShardedObject) -> str:
    return sh.unique_key if isinstance(sh, ShardedObject) else sh.key


def _find_mismatch(view: CheckpointView, sharded: dict, mode: StrictHandling, group: Any) -> Mismatch:
    unexpected = set()
    for sh in sharded.values():
        if isinstance(sh, ShardedObject):
            if sh.unique_key not in view.objects:
                unexpected.add(sh.unique_key)
        elif sh.key not in view.tensors:
            unexpected.add(sh.key)
    missing: set[str] = set()
    if mode.needs_global_keys:
        mine = sorted({_requested_key(sh) for sh in sharded.values()})
        requested = set().union(*map(set, DistContext.current(group).all_gather(mine)))
        missing = (set(view.tensors) | set(view.objects)) - requested
    return Mismatch(missing, unexpected)


def run_load(index: CheckpointIndex, req: LoadRequest) -> Any:
    """Steps 1-6 above; returns the state dict, or ``(state_dict, missing, unexpected)`` for the
    ``return_*`` strict modes."""
    mode = parse_strict(req.strict)
    view = CheckpointView.of_index(index)
    if req.key_mapping:
        apply_key_mapping(view, list(req.key_mapping))
    split = split_state_dict(req.sharded_state_dict)
    common = read_common(req.checkpoint_dir, req.allow_unsafe_pickle)

    mismatch = Mismatch(set(), set())
    if mode is not StrictHandling.ASSUME_OK_UNEXPECTED:
        mismatch = _find_mismatch(view, split.sharded, mode, req.process_group)
        report(mode, mismatch, str(req.checkpoint_dir))
        for path in [p for p, sh in split.sharded.items() if _requested_key(sh) in mismatch.unexpected]:
            del split.sharded[path]

    loaded: dict[SdPath, Any] = {}
    planner = Planner(view)
    pending: list[tuple[SdPath, torch.Tensor, torch.Tensor]] = []
    objects: list[tuple[SdPath, ShardedObject]] = []
    for path, sh in split.sharded.items():
        if isinstance(sh, ShardedObject):
            objects.append((path, sh))
            continue
        sh.validate_metadata_integrity()
        if sh.data is None:
            sh.init_data("cpu")
        data = sh.data
        direct = data.device.type == "cpu" and data.is_contiguous()
        buffer = data if direct else torch.empty(data.shape, dtype=sh.dtype)
        planner.add(sh, buffer)
        pending.append((path, data, buffer))
    execute(planner.plan, req.checkpoint_dir, options=req.options, stats=req.stats)
    for path, data, buffer in pending:
        if buffer is not data:
            data.copy_(buffer)
        loaded[path] = data
    if objects:
        with DataFiles(req.checkpoint_dir) as files:
            for path, sh in objects:
                stored = view.objects.get(sh.unique_key)
                if stored is None:
                    raise missing_key_error(sh.unique_key, sorted(view.objects), "ShardedObject")
                what = f"ShardedObject '{sh.unique_key}'"
                raw = files.read(stored.relative_path, stored.file_offset, stored.length, what)
                loaded[path] = load_object_bytes(raw, f"{what} in {stored.relative_path}",
                                                 req.allow_unsafe_pickle)
    result = assemble(split, common, loaded)
    if mode.returns_mismatch:
        missing = mismatch.missing if mode is StrictHandling.RETURN_ALL else set()
        return result, missing, mismatch.unexpected
    return result
