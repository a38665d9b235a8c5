"""What each value of a user's state dict is, and Megatron-Core's objects in ckptd's vocabulary.

Training code hands ckptd the objects its framework produces. This module recognises them,
without importing any framework:

- ckptd's own :mod:`ckptd.mapping` classes;
- Megatron-Core's ``ShardedTensor``, ``ShardedObject``, ``ShardedTensorFactory`` and
  ``LocalNonpersistentObject`` (``megatron.core.dist_checkpointing.mapping``), recognised by the
  module and name of their class and converted field by field (the tensor is shared, so a load
  fills the caller's tensor in place, as Megatron-Core does);
- ``DTensor`` (FSDP2, TorchTitan, ``get_state_dict``), plain ``torch.Tensor`` and ``Parameter``;
- values that hold tensor data ckptd cannot place (a tensor subclass it does not know, a
  tensor-like object, a sharded object of an unknown library): :func:`classify` says so, and the
  callers raise a ShardingError naming the key rather than pickle rank 0's copy of it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ShardingError
from ..mapping import LocalNonPersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without torch.distributed
    DTensor = None  # type: ignore[assignment, misc]

_MCORE_MODULE = "megatron.core.dist_checkpointing"
_SHARDED_NAMES = frozenset(
    {
        "ShardedTensor",
        "ShardedObject",
        "ShardedTensorFactory",
        "LocalNonpersistentObject",
        "LocalNonPersistentObject",
        "ShardedBase",
        "ShardedStateDict",
    }
)


class Kind(enum.Enum):
    SHARDED_TENSOR = "ShardedTensor"
    SHARDED_OBJECT = "ShardedObject"
    FACTORY = "ShardedTensorFactory"
    LOCAL = "LocalNonPersistentObject"
    DTENSOR = "DTensor"
    TENSOR = "Tensor"
    UNPLACEABLE = "unplaceable"
    VALUE = "value"

    @property
    def megatron_style(self) -> bool:
        """Whether values of this kind make a state dict Megatron-style (see ckptd.statedict.split)."""
        # Identity, not a set of members: an Enum's __hash__ is Python code, and this is asked of
        # every leaf of every save (hundreds per save).
        return self is Kind.SHARDED_TENSOR or self is Kind.SHARDED_OBJECT or self is Kind.FACTORY or self is Kind.LOCAL


_OWN: dict[type, Kind] = {
    ShardedTensor: Kind.SHARDED_TENSOR,
    ShardedObject: Kind.SHARDED_OBJECT,
    ShardedTensorFactory: Kind.FACTORY,
    LocalNonPersistentObject: Kind.LOCAL,
}
_MCORE_KINDS = {
    "ShardedTensor": Kind.SHARDED_TENSOR,
    "ShardedObject": Kind.SHARDED_OBJECT,
    "ShardedTensorFactory": Kind.FACTORY,
    "LocalNonpersistentObject": Kind.LOCAL,
}


def is_plain_tensor(x: Any) -> bool:
    """A tensor whose bytes are its values: ``torch.Tensor`` or ``Parameter`` (not a subclass)."""
    return type(x) is torch.Tensor or type(x) is torch.nn.Parameter


# Leaves whose kind their exact type says (the common ones first: a state dict is mostly these).
_BY_TYPE: dict[type, Kind] = {
    torch.Tensor: Kind.TENSOR,
    torch.nn.Parameter: Kind.TENSOR,
    **dict.fromkeys((int, float, bool, str, bytes, type(None)), Kind.VALUE),
    **_OWN,
}


def classify(x: Any) -> Kind:
    """The kind of one leaf of a state dict (dicts and lists are not leaves)."""
    kind = _BY_TYPE.get(type(x))
    if kind is not None:
        return kind
    if isinstance(x, torch.Tensor):
        if is_plain_tensor(x):
            return Kind.TENSOR
        if DTensor is not None and isinstance(x, DTensor):
            return Kind.DTENSOR
        return Kind.UNPLACEABLE
    for cls in type(x).__mro__:
        if cls.__name__ in _SHARDED_NAMES:
            if cls.__module__.startswith(_MCORE_MODULE) and cls.__name__ in _MCORE_KINDS:
                return _MCORE_KINDS[cls.__name__]
            if cls in _OWN:  # a subclass of one of ckptd's classes
                return _OWN[cls]
            return Kind.UNPLACEABLE
    if hasattr(type(x), "__torch_function__"):
        return Kind.UNPLACEABLE  # tensor-like (torch.overrides.is_tensor_like)
    return Kind.VALUE


def unplaceable_error(x: Any, where: str) -> ShardingError:
    """The error for a value :func:`classify` called UNPLACEABLE, found at ``where``."""
    cls = type(x)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(x, torch.Tensor):
        what = (
            "a torch.Tensor subclass ckptd cannot place (only torch.Tensor, Parameter and "
            "DTensor are stored as tensors)"
        )
        fix = (
            "Convert it to a plain tensor or a DTensor before saving, or wrap it in a "
            "ShardedTensor with plain tensor data"
        )
    elif any(c.__name__ in _SHARDED_NAMES for c in cls.__mro__):
        what = "a sharded object of a library ckptd does not know"
        fix = (
            "Use ckptd's or Megatron-Core's ShardedTensor / ShardedObject classes "
            "(megatron.core.dist_checkpointing.mapping)"
        )
    else:
        what = "a tensor-like object (it defines __torch_function__)"
        fix = "Convert it to a torch.Tensor or DTensor before saving"
    return ShardingError(
        f"{where} is of type {name}, {what}; saving it as common state would keep "
        f"only rank 0's copy and lose the other ranks' data. {fix}"
    )


def adopt(x: Any, kind: Kind, adopt_tree: Callable[[Any], Any]) -> Any:
    """ckptd's equivalent of a Megatron-Core object (ckptd's own objects are returned as they are).

    ``adopt_tree`` converts the sharded state dict a Megatron-Core factory builds.
    """
    if type(x) in _OWN:
        return x
    if kind is Kind.SHARDED_TENSOR:
        fr = getattr(x, "flattened_range", None)
        frag = x.axis_fragmentations
        return ShardedTensor(
            x.key,
            x.data,
            x.dtype,
            tuple(x.local_shape),
            tuple(x.global_shape),
            tuple(x.global_offset),
            None if frag is None else tuple(frag),
            x.replica_id,
            getattr(x, "prepend_axis_num", 0),
            getattr(x, "allow_shape_mismatch", False),
            fr,
        )
    if kind is Kind.SHARDED_OBJECT:
        return ShardedObject(x.key, x.data, tuple(x.global_shape), tuple(x.global_offset), x.replica_id)
    if kind is Kind.FACTORY:
        return ShardedTensorFactory(
            x.key,
            x.data,
            build_fn=lambda *_args, _f=x: adopt_tree(_f.build()),
            merge_fn=x.merge_fn,
            replica_id=x.replica_id,
            flattened_range=getattr(x, "flattened_range", None),
        )
    if kind is Kind.LOCAL:
        return LocalNonPersistentObject(x.unwrap())
    raise ValueError(f"not a Megatron-Core object: {type(x).__name__}")
