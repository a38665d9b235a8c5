"""The sharded state-dict vocabulary (Megatron-Core compatible).

A *sharded state dict* is a nested dict/list whose leaves are:

- :class:`ShardedTensor`: a local piece of a global tensor (offsets in elements);
- :class:`ShardedObject`: a local piece of a global array of picklable objects;
- :class:`ShardedTensorFactory`: a deferred transformation producing sharded entries at save
  and merging them back at load;
- :class:`LocalNonPersistentObject`: returned as-is by ``load``, never saved;
- any other value: *common* state, saved once (by rank 0) into ``common.pt``.

``ShardedTensor.key`` (not the dict key) names the tensor in the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .errors import ShardingError

ReplicaId = int | tuple[int, ...]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """A shard is written only by its main replica: ``0`` or a tuple of zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


@dataclass
class ShardedTensor:
    """A local tensor that is a chunk of a global tensor.

    ``global_offset`` has one entry per global axis; the first ``prepend_axis_num`` global axes
    are not present in ``data`` (as if ``data`` were unsqueezed). With ``flattened_range`` set,
    ``data`` is a 1-D slice of the flattened local chunk of shape ``local_shape`` (the layout of
    a ZeRO / distributed-optimizer shard).
    """

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.local_shape = tuple(int(s) for s in self.local_shape)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        self.validate_metadata_integrity()

    def _fail(self, what: str) -> None:
        raise ShardingError(f"ShardedTensor '{self.key}': {what}")

    def validate_metadata_integrity(self) -> None:
        """Check the invariants between data, shapes and offsets; raise ShardingError if broken."""
        if self.data is not None:
            if not isinstance(self.data, torch.Tensor):
                self._fail(
                    f"data must be a torch.Tensor, got {type(self.data).__name__}; "
                    "wrap non-tensor values in ShardedObject or leave them as common state"
                )
            if self.data.dtype != self.dtype:
                self._fail(f"data dtype {self.data.dtype} differs from declared dtype {self.dtype}")
            if self.flattened_range is None and tuple(self.data.shape) != self.local_shape:
                self._fail(f"data shape {tuple(self.data.shape)} differs from local_shape {self.local_shape}")
        if len(self.global_shape) != len(self.global_offset):
            self._fail(
                f"global_offset {self.global_offset} and global_shape {self.global_shape} have different lengths"
            )
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            self._fail(
                f"local_shape {self.local_shape} plus prepend_axis_num={self.prepend_axis_num} "
                f"does not match the {len(self.global_shape)} axes of global_shape"
            )
        for axis, (off, loc, glob) in enumerate(zip(self.global_offset, self.chunk_shape(), self.global_shape)):
            if off < 0 or loc < 0 or (off + loc > glob and not self.allow_shape_mismatch):
                self._fail(
                    f"chunk [{off}, {off + loc}) on axis {axis} lies outside the global shape {self.global_shape}"
                )
        if self.flattened_range is not None:
            fr = self.flattened_range
            numel = math.prod(self.local_shape)
            if fr.step not in (None, 1) or not 0 <= fr.start <= fr.stop <= numel:
                self._fail(
                    f"flattened_range {fr} must be a unit-step slice within [0, {numel}] "
                    f"(the element count of local_shape {self.local_shape})"
                )
            if self.data is not None and tuple(self.data.shape) != (fr.stop - fr.start,):
                self._fail(
                    f"data shape {tuple(self.data.shape)} must be ({fr.stop - fr.start},) for flattened_range {fr}"
                )
            if self.axis_fragmentations is None:
                self._fail("flattened_range needs a regular grid (axis_fragmentations)")

    def chunk_shape(self) -> tuple[int, ...]:
        """Shape of the local chunk in global coordinates (prepended axes have size 1)."""
        return (1,) * self.prepend_axis_num + self.local_shape

    def without_data(self) -> ShardedTensor:
        return replace(self, data=None)

    def init_data(self, device: str | torch.device = "cpu", init_fn: Callable = torch.empty) -> torch.Tensor:
        """Allocate ``data`` (for load templates built from metadata) unless it is there; ``data``."""
        if self.data is not None:
            return self.data
        shape = (
            (self.flattened_range.stop - self.flattened_range.start,)
            if self.flattened_range is not None
            else self.local_shape
        )
        self.data = init_fn(shape, dtype=self.dtype, device=device)
        return self.data

    @classmethod
    def whole(cls, key: str, data: torch.Tensor) -> ShardedTensor:
        """A plain tensor as one whole, unsharded chunk: ``from_rank_offsets(key, data)``, built
        without re-checking what holds by construction (a DCP-style state dict has hundreds of
        them per save, and the checks were most of the time ``save()`` spent taking it apart)."""
        shape = tuple(data.shape)  # torch.Size holds ints
        st = cls.__new__(cls)
        st.__dict__ = {  # one dict, not eleven assignments: ~0.5 us of each plain tensor's save
            "key": key,
            "data": data,
            "dtype": data.dtype,
            "local_shape": shape,
            "global_shape": shape,
            "global_offset": (0,) * len(shape),
            "axis_fragmentations": (1,) * len(shape),
            "replica_id": 0,
            "prepend_axis_num": 0,
            "allow_shape_mismatch": False,
            "flattened_range": None,
        }
        return st

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Build from ``(axis, axis_rank_offset, axis_fragmentations)`` triples.

        Each triple says: split the global tensor into ``axis_fragmentations`` equal parts along
        ``axis`` (a global axis, counting prepended ones); ``data`` is part ``axis_rank_offset``.
        """
        if not isinstance(data, torch.Tensor):
            raise ShardingError(
                f"ShardedTensor '{key}': data must be a torch.Tensor, got {type(data).__name__}; "
                "wrap non-tensor values in ShardedObject or leave them as common state"
            )
        ndim = data.ndim + prepend_axis_num
        global_offset = [0] * ndim
        global_shape = [1] * prepend_axis_num + list(data.shape)
        fragments = [1] * ndim
        seen: set[int] = set()
        for axis, axis_rank_offset, axis_fragm in rank_offsets:
            if not 0 <= axis < ndim or axis in seen or axis_fragm < 1 or not 0 <= axis_rank_offset < axis_fragm:
                raise ShardingError(
                    f"ShardedTensor '{key}': invalid rank offsets {rank_offsets} for a "
                    f"{ndim}-D global tensor; each is (axis, rank_offset < fragments, fragments)"
                )
            seen.add(axis)
            local = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = axis_fragm * local
            global_offset[axis] = axis_rank_offset * local
            fragments[axis] = axis_fragm
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(fragments),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: tuple[int, ...],
        *rank_offsets: tuple[int, int, int],
        flattened_range: slice,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Like :meth:`from_rank_offsets` for a 1-D slice of the flattened local chunk.

        ``non_flat_local_shape`` is the shape of the whole local chunk; ``data`` holds its
        elements ``flattened_range`` (row-major order), as a distributed optimizer shards it.
        """
        if not isinstance(data, torch.Tensor) or data.ndim != 1:
            raise ShardingError(
                f"ShardedTensor '{key}': flat data must be a 1-D torch.Tensor, got "
                f"{type(data).__name__} with shape {getattr(data, 'shape', None)}"
            )
        template = cls.from_rank_offsets(
            key,
            torch.empty(non_flat_local_shape, dtype=data.dtype, device="meta"),
            *rank_offsets,
            replica_id=replica_id,
            prepend_axis_num=prepend_axis_num,
            **init_kwargs,
        )
        return replace(template, data=data, flattened_range=flattened_range)


@dataclass
class ShardedObject:
    """A local piece of a global array of objects with shape ``global_shape``.

    Stored as a byte item under :attr:`unique_key` (``<key>/shard_<offsets>_<shape>``).
    """

    key: str
    data: Any
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if len(self.global_shape) != len(self.global_offset) or any(
            not 0 <= o < s for o, s in zip(self.global_offset, self.global_shape)
        ):
            raise ShardingError(
                f"ShardedObject '{self.key}': offset {self.global_offset} is not inside "
                f"global_shape {self.global_shape}"
            )

    @property
    def unique_key(self) -> str:
        offsets = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offsets}_{shape}"

    def without_data(self) -> ShardedObject:
        return replace(self, data=None)

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """Inverse of :attr:`unique_key` (data is None)."""
        try:
            key, shard = unique_key.rsplit("/", 1)
            tag, offsets, shape = shard.split("_")
            if tag != "shard":
                raise ValueError(tag)
            return cls(
                key,
                None,
                tuple(int(s) for s in shape.split(".")) if shape else (),  # a 0-d object: shard__
                tuple(int(s) for s in offsets.split(".")) if offsets else (),
                replica_id,
            )
        except ValueError as exc:
            raise ShardingError(
                f"'{unique_key}' is not a ShardedObject key of the form <key>/shard_<offsets>_<shape>"
            ) from exc


@dataclass
class ShardedTensorFactory:
    """Defers a transformation of ``data`` until save/load.

    ``build_fn(key, data, replica_id, flattened_range)`` returns a sharded (sub) state dict that is
    saved in place of the factory. At load the same build produces load templates, which are
    loaded and then combined by ``merge_fn(loaded_sub_state_dict)`` into the value returned.
    """

    key: str
    data: torch.Tensor
    build_fn: Callable[[str, torch.Tensor, ReplicaId, slice | None], Any]
    merge_fn: Callable[[Any], Any]
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> Any:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)


@dataclass
class LocalNonPersistentObject:
    """A value that ``load`` returns unchanged and ``save`` ignores."""

    obj: Any

    def unwrap(self) -> Any:
        return self.obj


ShardedBase = ShardedTensor | ShardedObject


@dataclass
class ByteItem:
    """A non-tensor value stored as an item of its own under ``key``: torch DCP's bytes item.

    Its bytes are ``torch.save(data)``, stored once, by one of the ranks holding it (the lowest,
    see :mod:`ckptd.statedict.holdings`). State dicts without Megatron-style
    sharded entries (DTensor / plain-tensor state dicts, as FSDP2 and torch DCP use) store their
    non-tensor values this way, under their flattened keys, so that ``torch.distributed.checkpoint``
    loads them (see :mod:`ckptd.statedict.split`).
    """

    key: str
    data: Any
