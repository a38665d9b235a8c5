"""Serializing pickled state (``common.pt`` and ShardedObject items) compactly and with clear errors.

Both are ``torch.save`` streams, and ``torch.save`` writes the *whole storage* of every tensor it
meets: a common state holding ``embedding[:10]`` would write the entire embedding. Tensors inside
dicts, lists and tuples are therefore replaced by tensors whose storage holds exactly their
elements (zero-copy for contiguous CPU views) before pickling. Tensors inside other objects are
pickled as they are.
"""

from __future__ import annotations

import io
import pickle
import types
from typing import Any

import torch

from ..errors import ShardingError
from ..statedict.kinds import Kind, classify, unplaceable_error
from ..statedict.tree import iter_leaves, path_str


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor whose storage holds exactly its elements, in row-major order.

    ``torch.save`` serializes a tensor's whole storage: saving a slice of a larger buffer would
    write the entire buffer. Contiguous views get a zero-copy storage slice; others are copied. A
    conjugate or negative view is materialized: the storage slice would drop its bit (and with it
    the values), and readers of raw bytes (ckptd's loader, other tools) see the values as stored.
    """
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        return t.contiguous()
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if storage.nbytes() == nbytes and t.storage_offset() == 0:
        return t
    start = t.storage_offset() * t.element_size()
    sliced = storage[start : start + nbytes]
    return torch.empty(0, dtype=t.dtype).set_(sliced, 0, t.shape, t.stride())


def _compact_tensor(t: torch.Tensor) -> torch.Tensor:
    if t.layout != torch.strided or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return t  # sparse / subclass tensors serialize their own way
    if t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0:
        return t  # already exact (this also keeps tensors that share one storage aliased)
    with torch.no_grad():
        if t.device.type == "cpu":
            out = exact_storage(t.detach())
        else:
            out = t.detach().clone(memory_format=torch.contiguous_format)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad)


def compact_tensors(obj: Any) -> Any:
    """``obj`` with every tensor in nested dicts/lists/tuples made storage-exact (see module doc)."""
    if isinstance(obj, torch.Tensor):
        return _compact_tensor(obj)
    if type(obj) is dict:
        return {k: compact_tensors(v) for k, v in obj.items()}
    if type(obj) is list:
        return [compact_tensors(v) for v in obj]
    if type(obj) is tuple:
        return tuple(compact_tensors(v) for v in obj)
    return obj


def _torch_save(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _Refused(Exception):
    """Raised inside the pickler for a value that must not be pickled (carries the message)."""


class _CheckingPickler(pickle.Pickler):
    """The pickler ``torch.save`` uses here: refuses sharded entries and tensor data it would store
    wrongly, wherever they sit (dicts, tuples, attributes of objects).

    A DTensor or a ShardedTensor pickled into ``common.pt`` would keep rank 0's piece only; a
    tensor subclass ckptd does not know may pickle a wrapper rather than its values.
    """

    what = ""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in _PLAIN_TYPES:
            return NotImplemented
        kind = classify(obj)
        if kind is Kind.UNPLACEABLE:
            raise _Refused(str(unplaceable_error(obj, f"{self.what}: a value")))
        if kind is not Kind.VALUE and kind is not Kind.TENSOR:
            raise _Refused(
                f"{self.what}: a {type(obj).__name__} sits inside a tuple or an object, where "
                "ckptd does not look for sharded entries; put it in a dict or a list"
            )
        return NotImplemented


_PLAIN_TYPES = frozenset(
    {
        torch.Tensor,
        torch.nn.Parameter,
        dict,
        list,
        tuple,
        str,
        bytes,
        int,
        float,
        bool,
        type(None),
        torch.Size,
        torch.dtype,
        torch.device,
    }
)


def _checking_module(what: str) -> Any:
    """A ``pickle_module`` for ``torch.save`` whose Pickler is :class:`_CheckingPickler`."""
    pickler = type("_Pickler", (_CheckingPickler,), {"what": what})
    return types.SimpleNamespace(Pickler=pickler, __name__="pickle")


def serialize_pickled(obj: Any, what: str, *, in_list: bool = False) -> bytes:
    """``torch.save(obj)`` (``torch.save([obj])`` with ``in_list``) of a compacted ``obj``; a
    ShardingError naming the culprit if it fails.

    ``what`` names the state in messages ("common state", "ShardedObject 'k/shard_0_2'").
    Sharded entries, DTensors and unknown tensor subclasses are refused wherever they sit.
    """
    compact = compact_tensors(obj)
    buf = io.BytesIO()
    try:
        torch.save([compact] if in_list else compact, buf, pickle_module=_checking_module(what))
        return buf.getvalue()
    except _Refused as exc:
        raise ShardingError(str(exc)) from None
    except Exception as exc:
        culprit = "<unknown>"
        for path, leaf in iter_leaves(compact, into_tuples=True):
            try:
                _torch_save(leaf)
            except Exception:  # noqa: BLE001 - only locating the failing leaf
                culprit = path_str(path)
                break
        raise ShardingError(
            f"{what} cannot be pickled: the value at '{culprit}' ({exc!r}). Checkpointed state "
            "must be picklable by torch.save; drop the value or wrap it in "
            "LocalNonPersistentObject if it should not be saved"
        ) from exc
