"""The load pipeline behind :func:`ckptd.load`.

Order (every rank runs it independently; only the ``*_ALL`` strict modes exchange the requested
keys with the other ranks of the process group):

1. read ``.metadata`` and build the checkpoint view; apply the key mapping;
2. take the request apart (:func:`ckptd.statedict.split.split_state_dict`: Megatron-style or
   DCP-style, factories and DTensors as pieces);
3. match every requested entry with what is stored: a tensor chunk, a ShardedObject, a DCP bytes
   item, or (for plain values and tensors the checkpoint keeps in ``common.pt``) the common state;
   unexpected entries (requested, not stored) and, for ``*_ALL``, missing ones (stored, requested
   by no rank) are dropped or reported per ``strict``; a request that matches nothing at all
   while the checkpoint holds data raises;
4. plan: each requested box is intersected with the stored sources (resharding, flattened
   ranges, shape mismatch padding/truncation);
5. execute: read only the needed byte ranges, directly into the request's tensors;
6. read ShardedObjects and bytes items; assemble the result (Megatron-style: a new dict on top
   of the common state; DCP-style: the request, filled in place).

Pickled state is decoded only where asked for: ``common.pt`` for a Megatron-style request (its
result is built on it, as Megatron-Core's is), bytes items only when requested.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..dist import DistContext
from ..errors import CorruptCheckpointError, LoadMismatchError
from ..format.dcp_metadata import CheckpointIndex
from ..format.reader import (
    DataFiles,
    RangeSource,
    load_object_bytes,
    read_bytes_item,
    read_common_pt,
    read_object_item,
)
from ..mapping import ByteItem, ShardedObject, ShardedTensor
from ..statedict.assemble import assemble
from ..statedict.split import FACTORY_PART, Dialect, SplitStateDict, split_dcp_v2_3, split_state_dict
from ..statedict.tree import Path as SdPath
from ..statedict.tree import dcp_fqn, get_path, path_str, set_path
from .execute import ExecOptions, LoadStats, execute
from .keymap import Rule, apply_key_mapping
from .plan import Planner, missing_key_error
from .strict import Mismatch, StrictHandling, parse_strict, report
from .view import CheckpointView

_ABSENT = object()


@dataclass
class LoadRequest:
    """Everything :func:`run_load` needs besides the checkpoint index.

    ``with_common=False`` leaves ``common.pt`` undecoded (the result then holds only what was
    requested; :func:`ckptd.load_plain_tensors` uses it). ``has_common``: whether the checkpoint
    has ``common.pt``, as known when it was opened (None: decided when it is read).
    ``allow_dtype_cast``: read a tensor requested in another dtype in the stored one and cast it
    (as ``dcp.load``); False raises LoadMismatchError.
    """

    sharded_state_dict: Any
    checkpoint_dir: str | os.PathLike
    allow_unsafe_pickle: bool = False
    strict: StrictHandling | str | bool = StrictHandling.ASSUME_OK_UNEXPECTED
    key_mapping: Sequence[Rule] | None = None
    process_group: Any = None
    stats: LoadStats | None = None
    options: ExecOptions | None = None
    with_common: bool = True
    has_common: bool | None = None
    allow_dtype_cast: bool = True
    source: RangeSource | None = None  # a checkpoint on object storage (ckptd.format.reader.RangeSource)
    agreement: KeysAgreement | None = None  # a ``*_all`` load's gather, joined by the caller on a failure before it


class _Common:
    """``common.pt``, checked against its recorded checksum and decoded on first use only."""

    def __init__(self, req: LoadRequest, index: CheckpointIndex) -> None:
        self._req = req
        self._index = index
        self._tree: Any = _ABSENT

    def tree(self) -> Any:
        if self._tree is _ABSENT:
            self._tree = read_common_pt(
                self._req.checkpoint_dir,
                self._req.allow_unsafe_pickle,
                expected=self._req.has_common,
                crc=self._index.common_crc,
                checksum=self._index.checksum,
            )
        return self._tree

    def get(self, path: SdPath) -> Any:
        tree = self.tree()
        return _ABSENT if tree is None else get_path(tree, path, _ABSENT)


def _requested_key(sh: ShardedTensor | ShardedObject | ByteItem) -> str:
    return sh.unique_key if isinstance(sh, ShardedObject) else sh.key


def _match(
    view: CheckpointView, split: SplitStateDict, common: _Common, cast: bool
) -> tuple[set[str], dict[SdPath, tuple[ShardedTensor | ByteItem, Any]], int]:
    """``(unexpected keys, entries taken from common.pt by path, number of matched entries)``.

    A DCP-style plain tensor or value the checkpoint keeps in ``common.pt`` (saved Megatron-style)
    is taken from there; so is nothing else.
    """
    unexpected: set[str] = set()
    from_common: dict[SdPath, tuple[ShardedTensor | ByteItem, Any]] = {}
    matched = 0
    for path, sh in split.sharded.items():
        if isinstance(sh, ShardedObject):
            found = sh.unique_key in view.objects
        elif isinstance(sh, ByteItem):
            stored = view.objects.get(sh.key)
            found = stored is not None and not stored.sharded_object
        else:
            found = sh.key in view.tensors
        if not found and split.dialect is Dialect.DCP and FACTORY_PART not in path:
            value = common.get(path)
            if value is not _ABSENT and (
                isinstance(sh, ByteItem) or (isinstance(sh, ShardedTensor) and _fits(sh, value, cast))
            ):
                from_common[path] = (sh, value)
                found = True
            elif isinstance(sh, ShardedTensor) and isinstance(value, torch.Tensor):
                raise LoadMismatchError(
                    f"tensor '{sh.key}': the checkpoint keeps it in its common state (common.pt) with shape "
                    f"{tuple(value.shape)} and dtype {value.dtype}, but shape {sh.global_shape} and dtype "
                    f"{sh.dtype} were requested{'' if cast else ' (allow_dtype_cast=False)'}; request what "
                    "is stored, or map another key to it with key_mapping=[...]"
                )
        if not found and isinstance(sh, ShardedTensor) and _stored_nowhere_empty(sh, view, common, path):
            # Nothing to read: a tensor of no element that the checkpoint holds in no form (an
            # earlier ckptd left a DTensor of none out, and a load of it failed on the one rank
            # that requested it, while the others went on into the next collective).
            from_common[path] = (sh, sh.without_data().init_data("cpu"))
            found = True
        if found:
            matched += 1
        else:
            unexpected.add(_requested_key(sh))
    return unexpected, from_common, matched


def _stored_nowhere_empty(sh: ShardedTensor, view: CheckpointView, common: _Common, path: SdPath) -> bool:
    """A requested tensor of no element under a key the checkpoint has no tensor, value or common
    entry of (a value or entry it has is a mismatch to report, not an empty tensor)."""
    return (
        math.prod(sh.global_shape) == 0
        and sh.key not in view.tensors
        and sh.key not in view.objects
        and common.get(path) is _ABSENT
    )


def _fits(sh: ShardedTensor, value: Any, cast: bool) -> bool:
    return (
        isinstance(value, torch.Tensor) and (cast or value.dtype == sh.dtype) and tuple(value.shape) == sh.global_shape
    )


@dataclass
class _Matched:
    """Steps 1-3 on this rank: the view, the request taken apart, and what matched."""

    view: CheckpointView
    split: SplitStateDict
    common: _Common
    unexpected: set[str]
    from_common: dict[SdPath, tuple[ShardedTensor | ByteItem, Any]]
    matched: int

    def requested(self) -> list[str]:
        return sorted({_requested_key(sh) for sh in self.split.sharded.values()})

    def missing(self, requested: set[str]) -> set[str]:
        """Stored tensors and ShardedObjects not in ``requested`` (common values never count)."""
        stored = set(self.view.tensors) | {k for k, o in self.view.objects.items() if o.sharded_object}
        return stored - requested


def _matched(index: CheckpointIndex, req: LoadRequest) -> _Matched:
    view = CheckpointView.of_index(index)
    if req.key_mapping:
        apply_key_mapping(view, list(req.key_mapping))
    split = split_state_dict(req.sharded_state_dict)
    if split.dialect is Dialect.DCP:
        split = _as_flattened_when_saved(view, split, req.sharded_state_dict)
    common = _Common(req, index)
    if split.dialect is Dialect.MEGATRON and req.with_common:
        _plain_tensors_from_items(view, split, common)
    unexpected, from_common, matched = _match(view, split, common, req.allow_dtype_cast)
    return _Matched(view, split, common, unexpected, from_common, matched)


def _as_flattened_when_saved(view: CheckpointView, split: SplitStateDict, request: dict) -> SplitStateDict:
    """The request flattened as the checkpoint's torch flattened it when it saved, decided as
    ``dcp.load`` decides it (``DefaultLoadPlanner.create_local_plan``): torch <= 2.3 stored a dict
    or list holding no tensor as one bytes item (``train`` for ``{"step": 7, "epoch": 7}``), so
    when a stored key this request does not have is one of the keys the request has flattened that
    way, the request is read that way, each such container loaded whole from its item (it replaces
    the request's, as ``dcp.load`` puts it back). Otherwise ``train.step`` would not match ``train``,
    and a non-raising strict mode would leave the request's values as they were."""
    unrequested = (set(view.tensors) | set(view.objects)) - set(split.dcp_paths)
    if not unrequested:
        return split
    old = split_dcp_v2_3(request)
    return old if unrequested & set(old.dcp_paths) else split


def _plain_tensors_from_items(view: CheckpointView, split: SplitStateDict, common: _Common) -> None:
    """A Megatron-style request's plain tensors that the checkpoint stores as tensor items under
    their DCP keys and not in ``common.pt`` (a DCP-style save) are loaded as those items, in place,
    as their plain values are from bytes items (:func:`_megatron_common`); they were left out."""
    for path, value in split.plain.items():
        key = dcp_fqn(path)
        if type(value) in (torch.Tensor, torch.nn.Parameter) and key in view.tensors and common.get(path) is _ABSENT:
            split.sharded[path] = ShardedTensor.whole(key, value)


@dataclass
class KeysAgreement:
    """The one collective of a ``*_all`` load, every rank's requested keys, which every rank joins
    once (DistContext.agree): with its keys, or with the error that stopped its load before them
    (opening the checkpoint, reading its index), so the others raise that error too instead of
    pairing their gather with another collective (a resume's outcome gather) and hanging."""

    ctx: DistContext
    where: str
    joined: bool = False

    def gather(self, mine: Callable[[], list[str]]) -> list[list[str]]:
        self.joined = True
        return self.ctx.agree(f"load of {self.where}", mine)

    def join_failed(self, exc: Exception) -> None:
        """This rank's load failed with ``exc``: join the gather with it, unless it did already
        (the caller raises ``exc``)."""
        if self.joined:
            return

        def failed() -> list[str]:
            raise exc

        with contextlib.suppress(Exception):  # this rank's own error, raised by the caller
            self.gather(failed)


def _matched_everywhere(index: CheckpointIndex, req: LoadRequest, where: str) -> tuple[_Matched, set[str]]:
    """Steps 1-3, and every rank's requested keys (:class:`KeysAgreement`): a rank whose steps 1-3
    failed fails that collective on every rank."""
    local: list[_Matched] = []

    def mine() -> list[str]:
        local.append(_matched(index, req))
        return local[0].requested()

    agreement = req.agreement or KeysAgreement(DistContext.current(req.process_group), where)
    gathered = agreement.gather(mine)
    return local[0], set().union(*map(set, gathered))


def _check_something_matched(view: CheckpointView, split: SplitStateDict, matched: int, where: str) -> None:
    """A request of entries none of which is stored raises. An empty request (no entry at all) is
    fine, as for ``dcp.load``: torch's ``broadcast_from_rank0`` full-state loads pass ``{}`` on
    every rank but 0 (a Megatron-style one still gets the common state)."""
    stored = len(view.tensors) + sum(o.sharded_object for o in view.objects.values())
    if matched or not stored or not split.sharded:
        return
    sample = sorted({_requested_key(sh) for sh in split.sharded.values()})[:5]
    close = sorted(view.tensors)[:5]
    raise LoadMismatchError(
        f"load of {where}: none of the {len(split.sharded)} requested entries is in the checkpoint "
        f"(requested e.g. {sample}; stored e.g. {close}). Nothing was loaded. Check the keys "
        "(a prefix such as 'model.'?) or map them with key_mapping=[...]"
    )


def run_load(index: CheckpointIndex, req: LoadRequest) -> Any:
    """Steps 1-6 above; returns the state dict, or ``(state_dict, missing, unexpected)`` for the
    ``return_*`` strict modes."""
    mode = parse_strict(req.strict)
    where = str(req.checkpoint_dir)
    if mode.needs_global_keys:
        m, requested = _matched_everywhere(index, req, where)
    else:
        m, requested = _matched(index, req), set()
    view, split, common, unexpected, from_common = m.view, m.split, m.common, m.unexpected, m.from_common
    mismatch = Mismatch(set(), unexpected)
    if mode is StrictHandling.ASSUME_OK_UNEXPECTED:
        if unexpected:
            _raise_unexpected(view, split, unexpected)
    else:
        if mode.needs_global_keys:
            mismatch.missing = m.missing(requested)
        report(mode, mismatch, where)
    _check_something_matched(view, split, m.matched, where)
    _check_destinations(split, unexpected)
    for path in [p for p, sh in split.sharded.items() if p in from_common or _requested_key(sh) in unexpected]:
        del split.sharded[path]

    loaded: dict[SdPath, Any] = {}
    _load_tensors(view, split, req, index, loaded)
    _load_pickled(view, split, req, index, loaded)
    for path, (sh, value) in from_common.items():
        loaded[path] = value if isinstance(sh, ByteItem) else _fill(sh, value)
    tree = _megatron_common(view, split, common, req, index) if split.dialect is Dialect.MEGATRON else {}
    result = assemble(split, req.sharded_state_dict, tree, loaded)
    if mode.returns_mismatch:
        missing = mismatch.missing if mode is StrictHandling.RETURN_ALL else set()
        return result, missing, mismatch.unexpected
    return result


def _raise_unexpected(view: CheckpointView, split: SplitStateDict, unexpected: set[str]) -> None:
    """The error for the first unexpected entry in request order."""
    sh = next(sh for sh in split.sharded.values() if _requested_key(sh) in unexpected)
    if isinstance(sh, ShardedObject):
        raise missing_key_error(sh.unique_key, sorted(view.objects), "ShardedObject")
    if isinstance(sh, ByteItem):
        values = sorted(k for k, o in view.objects.items() if not o.sharded_object)
        raise missing_key_error(sh.key, values, "value", "a tensor" if sh.key in view.tensors else None)
    stored = view.objects.get(sh.key)
    other = None if stored is None else "a ShardedObject" if stored.sharded_object else "a value"
    raise missing_key_error(sh.key, sorted(view.tensors), stored_as=other)


def _check_destinations(split: SplitStateDict, unexpected: set[str]) -> None:
    """Before anything is written: a tensor to load into whose elements share memory cannot hold
    the stored values (the last copy into a shared element wins; torch's ``copy_`` raises for an
    ``expand()`` only, naming no key, and only after the tensors before it were filled)."""
    for path, sh in split.sharded.items():
        if not isinstance(sh, ShardedTensor) or sh.data is None or sh.key in unexpected:
            continue
        if _overlaps_itself(tuple(sh.data.shape), sh.data.stride()):
            raise LoadMismatchError(
                f"tensor '{sh.key}' at '{path_str(path)}': the tensor to load into has elements that share "
                f"memory (shape {tuple(sh.data.shape)}, stride {sh.data.stride()}: made by expand(), "
                "as_strided() or the like), which cannot hold the stored values. Nothing was loaded. Pass a "
                "tensor that owns its memory (e.g. .clone() or torch.empty(...) of that shape)"
            )


def _overlaps_itself(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether two elements of a strided tensor are at one offset. Every layout views and slices
    make (permuted, stepped, channels-last) passes the first test: with its dimensions ordered by
    stride, each stride is past the span of the smaller ones. Only what fails it (an expanded
    dimension, an as_strided() layout) has its offsets counted."""
    dims = sorted((st, n) for n, st in zip(shape, stride, strict=True) if n > 1)
    if any(n == 0 for n in shape) or not dims:
        return False
    span = 1
    for st, n in dims:
        if st < span:
            break
        span += st * (n - 1)
    else:
        return False
    if dims[0][0] == 0:
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st).flatten()
    return int(offsets.unique().numel()) < offsets.numel()


def _fill(sh: ShardedTensor, value: torch.Tensor) -> torch.Tensor:
    if sh.data is None:
        return value.clone().to(sh.dtype)
    sh.data.detach().copy_(value)
    return sh.data


def _load_tensors(
    view: CheckpointView, split: SplitStateDict, req: LoadRequest, index: CheckpointIndex, loaded: dict[SdPath, Any]
) -> None:
    """Every requested tensor, read straight into its data where it is contiguous CPU memory of the
    stored dtype; into a buffer otherwise. Tensors to cast are read one at a time, each through a
    buffer of the stored dtype freed before the next, so a cast load needs at most one chunk of
    extra memory."""
    planner = Planner(view, allow_cast=req.allow_dtype_cast, dcp_style=split.dialect is Dialect.DCP)
    checks = _AllocationCheck(view, req.checkpoint_dir, req.source)
    pending: list[tuple[SdPath, torch.Tensor, torch.Tensor]] = []
    casts: list[tuple[SdPath, ShardedTensor, torch.dtype]] = []
    for path, sh in split.sharded.items():
        if not isinstance(sh, ShardedTensor):
            continue
        sh.validate_metadata_integrity()
        if sh.data is not None and sh.data.device.type == "meta":
            # copy_() into it does nothing: the load would return the request without its values.
            raise LoadMismatchError(
                f"tensor '{sh.key}' at '{path_str(path)}' is a meta tensor, which holds no values to load "
                "into: materialize it first (e.g. module.to_empty(device=...)), then load"
            )
        stored = planner.resolve(sh)
        if sh.data is None:
            checks.check(sh, stored.dtype)
        if stored.dtype != sh.dtype:
            casts.append((path, sh, stored.dtype))
            continue
        data = sh.init_data("cpu").detach()  # parameters that require grad are filled in place too
        # A conjugate or negative view's memory holds the conjugate or the negation of its values:
        # the stored bytes go through a buffer and copy_(), which applies the view's bit.
        direct = data.device.type == "cpu" and data.is_contiguous() and not data.is_conj() and not data.is_neg()
        buffer = data if direct else torch.empty(data.shape, dtype=sh.dtype)
        planner.add(sh, buffer)
        pending.append((path, data, buffer))
    run = functools.partial(
        execute, directory=req.checkpoint_dir, options=req.options, stats=req.stats, source=req.source
    )
    run(planner.plan, checksum=index.checksum)
    for path, data, buffer in pending:
        if buffer is not data:
            data.copy_(buffer)
        loaded[path] = split.sharded[path].data
    for path, sh, stored_dtype in casts:
        data = sh.init_data("cpu").detach()
        buffer = torch.empty(data.shape, dtype=stored_dtype)
        one = Planner(view, allow_cast=True)
        one.add(sh, buffer)
        run(one.plan, checksum=index.checksum)
        data.copy_(buffer)
        del buffer
        loaded[path] = sh.data


class _AllocationCheck:
    """Before a load allocates a tensor the checkpoint describes (a template without data, as
    :func:`ckptd.load_plain_tensors` and ``load_tensors_metadata`` give), check that the data files
    hold at least its bytes: a ``.metadata`` that declares more (a global shape of 2^40 x 256
    over one small chunk) is damage, reported before anything is allocated. The bytes held are
    those of the union of its items' ranges in each file: items that overlap (40,000 items at
    offsets 0, 1, 2, ... of one 258 KB file) hold their shared bytes once, not once each."""

    def __init__(self, view: CheckpointView, directory: str | os.PathLike, source: RangeSource | None) -> None:
        self.view = view
        self.directory = directory
        self.source = source  # a data file may be elsewhere than in ``directory`` (ckptd.storage.nodeview)
        self.sizes: dict[str, int] = {}
        # Across the request too: tensors whose items all point at the same bytes each pass the
        # check above, and would allocate that many times the data files' size.
        self.need_by_key: dict[str, int] = {}

    def check(self, sh: ShardedTensor, stored_dtype: torch.dtype) -> None:
        if sh.allow_shape_mismatch:
            return  # padded: more than stored is expected
        stored = self.view.tensors[sh.key]
        numel = (
            math.prod(sh.local_shape)
            if sh.flattened_range is None
            else sh.flattened_range.stop - sh.flattened_range.start
        )
        need = numel * stored_dtype.itemsize
        items = {src.item.key: src.item for src in stored.sources}
        spans: dict[str, list[tuple[int, int]]] = {}
        for item in items.values():
            start = max(item.file_offset, 0)
            end = min(item.file_offset + item.length, self._size(item.relative_path))
            if end > start:
                spans.setdefault(item.relative_path, []).append((start, end))
        held = sum(_union_nbytes(ranges) for ranges in spans.values())
        if need > held:
            raise CorruptCheckpointError(
                f"tensor '{sh.key}': .metadata of {self.directory} describes {stored_dtype} of shape "
                f"{stored.shape} (this request: {need} bytes), but its {len(items)} stored items hold "
                f"{held} bytes in the data files ({', '.join(sorted(spans)[:3]) or 'none'}"
                f"{', ...' if len(spans) > 3 else ''}; bytes that items share counted once); the "
                "metadata contradicts the data (damaged). Nothing was allocated. Load an earlier checkpoint."
            )
        self.need_by_key[sh.key] = max(need, self.need_by_key.get(sh.key, 0))
        needed, files = sum(self.need_by_key.values()), sum(self.sizes.values())
        if needed > files:
            raise CorruptCheckpointError(
                f"tensor '{sh.key}': the {len(self.need_by_key)} tensors of this request described by .metadata of "
                f"{self.directory} need {needed} bytes, but the {len(self.sizes)} data files they are stored in "
                f"hold {files}: items of different tensors share bytes, so the metadata contradicts the data "
                "(damaged). Load an earlier checkpoint."
            )

    def _size(self, relative_path: str) -> int:
        if relative_path not in self.sizes:
            with DataFiles(self.directory, self.source) as files:  # a missing file raises, naming it
                self.sizes[relative_path] = files.fileno_and_size(relative_path)[1]
        return self.sizes[relative_path]


def _union_nbytes(ranges: list[tuple[int, int]]) -> int:
    """The bytes in the union of byte ranges ``[start, end)``."""
    total, reach = 0, 0
    for start, end in sorted(ranges):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def _load_pickled(
    view: CheckpointView, split: SplitStateDict, req: LoadRequest, index: CheckpointIndex, loaded: dict[SdPath, Any]
) -> None:
    wanted = [(p, sh) for p, sh in split.sharded.items() if not isinstance(sh, ShardedTensor)]
    if not wanted:
        return
    with DataFiles(req.checkpoint_dir, req.source) as files:
        for path, sh in wanted:
            if isinstance(sh, ByteItem):
                loaded[path] = read_bytes_item(files, view.objects[sh.key], req.allow_unsafe_pickle, index.checksum)
                continue
            stored = view.objects[sh.unique_key]
            what = f"ShardedObject '{sh.unique_key}'"
            raw = read_object_item(files, stored, what, index.checksum)
            loaded[path] = load_object_bytes(raw, f"{what} in {stored.relative_path}", req.allow_unsafe_pickle)


def _megatron_common(
    view: CheckpointView, split: SplitStateDict, common: _Common, req: LoadRequest, index: CheckpointIndex
) -> Any:
    """The common state a Megatron-style result starts from: ``common.pt``, plus the requested
    plain values it lacks that the checkpoint stores as DCP bytes items (a torch DCP checkpoint
    has no ``common.pt``: only what is requested is decoded)."""
    if not req.with_common:
        return {}
    tree = common.tree()
    if tree is None:
        tree = {}
    wanted = []
    for path in split.plain:
        stored = view.objects.get(dcp_fqn(path))
        if stored is not None and not stored.sharded_object and get_path(tree, path, _ABSENT) is _ABSENT:
            wanted.append((path, stored))
    if wanted:
        with DataFiles(req.checkpoint_dir, req.source) as files:
            for path, stored in wanted:
                try:
                    value = read_bytes_item(files, stored, req.allow_unsafe_pickle, index.checksum)
                    set_path(tree, path, value, req.sharded_state_dict)
                except ValueError as exc:
                    raise LoadMismatchError(
                        f"the value at '{path_str(path)}' does not fit the common state: {exc}"
                    ) from exc
    return tree
