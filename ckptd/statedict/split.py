"""The one door every state dict goes through, for save and load: what is stored where.

A state dict is read in one of two dialects, decided by what it holds:

- **Megatron-style** (it holds a ShardedTensor, ShardedObject, ShardedTensorFactory or
  LocalNonPersistentObject, ckptd's or Megatron-Core's): sharded entries are items of the data
  files; every other value (plain tensors too) is *common state*, saved once by rank 0 into
  ``common.pt`` exactly as Megatron-Core stores it (subtrees whose entries were all sharded are
  left out); a load starts from that common state and puts the loaded entries back into it.
- **DCP-style** (tensors, DTensors and plain values only: what ``model.state_dict()``, FSDP2 and
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` produce): every leaf, as torch DCP's
  ``flatten_state_dict`` walks the dict, is an item under its dotted key, as ``dcp.save`` stores
  it: a DTensor as the chunks each rank holds, a plain tensor as one whole tensor, any other value
  as a bytes item (``torch.save(value)``). Plain tensors and values may be held by any set of
  ranks; each is stored once, by one of its holders, as DCP does (:mod:`ckptd.statedict.holdings`
  decides which). A load fills the given dict in place, as ``dcp.load`` does.

DTensors are stored under their flattened key in both dialects. A value that holds tensor data
ckptd cannot place raises ShardingError naming its key (:mod:`ckptd.statedict.kinds`); so does a
list whose entries could not be put back in place after a load (see :func:`split_state_dict`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ShardingError
from ..mapping import ByteItem, ShardedObject, ShardedTensor, ShardedTensorFactory
from .dtensor import dtensor_pieces
from .kinds import Kind, adopt, classify, unplaceable_error
from .tree import Path, dcp_fqn, path_str

FACTORY_PART = "__factory__"


class Dialect(enum.Enum):
    MEGATRON = "megatron"
    DCP = "dcp"


Sharded = ShardedTensor | ShardedObject | ByteItem


@dataclass
class SplitStateDict:
    """A state dict taken apart by role (see the module docstring).

    ``sharded``: by leaf path, what is stored as items (factory and DTensor pieces under
    ``path + ("__factory__",) + sub_path``); ``factories``: by path, each factory (DTensors get an
    internal one) and what it built, so that a load can merge the pieces; ``common``: the common
    state tree (Megatron-style; ``{}`` for DCP-style); ``local``: unwrapped
    LocalNonPersistentObjects; ``plain``: the common leaves of a Megatron-style *request*, by path
    (filled from a DCP bytes item when ``common.pt`` lacks them); ``dcp_paths``: DCP-style only,
    each item key's path as DCP's ``planner_data`` records it; ``dcp_plain``: DCP-style only, the
    plain tensors (as whole ShardedTensors, main replicas) and values by key: whole items this
    rank holds, which other ranks may hold too (the writer of each is decided across ranks, see
    :mod:`ckptd.statedict.holdings`).
    """

    dialect: Dialect
    sharded: dict[Path, Sharded] = field(default_factory=dict)
    factories: dict[Path, tuple[ShardedTensorFactory, Any]] = field(default_factory=dict)
    common: Any = field(default_factory=dict)
    local: dict[Path, Any] = field(default_factory=dict)
    plain: dict[Path, Any] = field(default_factory=dict)
    dcp_paths: dict[str, Path] = field(default_factory=dict)
    dcp_plain: dict[str, ShardedTensor | ByteItem] = field(default_factory=dict)
    # By piece path: the DTensor a piece is a view of the local tensor of (whose version counter,
    # not the piece's, counts writes through the DTensor: ckptd.staging.lazy).
    dtensors: dict[Path, Any] = field(default_factory=dict)


def split_state_dict(state_dict: Any) -> SplitStateDict:
    """Take a state dict apart (see the module docstring); nothing is copied.

    Raises ShardingError, naming the key, for a value holding tensor data that ckptd cannot place,
    a sharded entry inside a tuple or another object, a factory that builds something other than
    sharded entries, two leaves with the same DCP key, and a list whose entries are partly sharded
    and partly common (or local): Megatron-Core's format stores the two parts as separate,
    compacted lists, so the positions could not be restored.
    """
    if not isinstance(state_dict, dict):
        raise ShardingError(f"a state dict must be a dict, got {type(state_dict).__name__}")
    if _megatron_style(state_dict):
        return _split_megatron(state_dict)
    return _split_dcp(state_dict)


def _megatron_style(state_dict: dict) -> bool:
    """Whether a leaf is one of Megatron-Core's kinds. A value ckptd cannot place, or a sharded
    entry inside a tuple, raises ShardingError naming its key. One pass without building paths
    (run at every save over hundreds of leaves); the paths are walked only to name a bad one."""
    megatron = False
    stack: list[Any] = [state_dict]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        else:
            kind = classify(x)
            if kind is Kind.UNPLACEABLE or (isinstance(x, tuple) and not _tuple_ok(x)):
                _raise_for_bad_leaf(state_dict)
            megatron = megatron or kind.megatron_style
    return megatron


def _tuple_ok(t: tuple) -> bool:
    for v in t:
        if isinstance(v, tuple):
            if not _tuple_ok(v):
                return False
            continue
        kind = classify(v)
        if kind is Kind.UNPLACEABLE or kind.megatron_style or kind is Kind.DTENSOR:
            return False
    return True


def _raise_for_bad_leaf(state_dict: dict) -> None:
    for path, leaf, kind in _leaves(state_dict):  # _check_tuple raises for a bad tuple
        if kind is Kind.UNPLACEABLE:
            raise unplaceable_error(leaf, _where(path))
    raise ShardingError("a value of the state dict cannot be placed (internal: no leaf found to name)")


def _where(path: Path) -> str:
    return f"the value at '{path_str(path)}'"


def _leaves(x: Any, path: Path = ()) -> Iterator[tuple[Path, Any, Kind]]:
    """Every leaf with its kind; tuples are leaves but may not hold sharded entries or DTensors."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, path + (i,))
    else:
        kind = classify(x)
        if isinstance(x, tuple):
            _check_tuple(x, path)
        yield path, x, kind


def _check_tuple(t: tuple, path: Path) -> None:
    for i, v in enumerate(t):
        sub = path + (i,)
        if isinstance(v, tuple):
            _check_tuple(v, sub)
            continue
        kind = classify(v)
        if kind is Kind.UNPLACEABLE:
            raise unplaceable_error(v, _where(sub))
        if kind.megatron_style or kind is Kind.DTENSOR:
            raise ShardingError(
                f"a {type(v).__name__} at '{path_str(sub)}' sits inside a tuple, where ckptd does "
                "not look for sharded entries; put it in a dict or a list"
            )


# --- Megatron-style ---------------------------------------------------------------------------

_SHARDED, _LOCAL, _COMMON = "sharded", "local", "common"


def _split_megatron(state_dict: dict) -> SplitStateDict:
    out = SplitStateDict(Dialect.MEGATRON)
    common = _megatron_walk(state_dict, (), out)
    out.common = {} if common is _NONE else common
    return out


def _megatron_walk(x: Any, path: Path, out: SplitStateDict) -> Any:
    """Register the sharded and local leaves of ``x``; return its common part, or ``_NONE``.

    The common part follows Megatron-Core's ``extract_matching_values``: a dict keeps its common
    entries and its (possibly empty) containers that were empty to begin with; a list keeps its
    common entries compacted. Lists must be uniform (every entry has the same roles), so that the
    compaction keeps every position.
    """
    if isinstance(x, dict):
        kept = {}
        for k, v in x.items():
            part = _megatron_walk(v, path + (k,), out)
            if part is not _NONE:
                kept[k] = part
        return kept if kept or not x else _NONE
    if isinstance(x, list):
        _check_uniform_list(x, path)
        parts = [_megatron_walk(v, path + (i,), out) for i, v in enumerate(x)]
        kept_list = [p for p in parts if p is not _NONE]
        return kept_list if kept_list or not x else _NONE
    kind = classify(x)
    if kind in (Kind.TENSOR, Kind.VALUE):
        out.plain[path] = x
        return x
    if kind is Kind.LOCAL:
        out.local[path] = adopt(x, kind, _adopt_built).unwrap()
    elif kind is Kind.FACTORY:
        factory = adopt(x, kind, _adopt_built)
        _add_factory(out, path, factory, factory.build())
    elif kind is Kind.DTENSOR:
        _add_dtensor(out, path, dcp_fqn(path), x)
    else:
        out.sharded[path] = adopt(x, kind, _adopt_built)
    return _NONE


class _NoneType:
    def __repr__(self) -> str:
        return "<no common part>"


_NONE = _NoneType()


def _roles(x: Any) -> frozenset[str]:
    if isinstance(x, dict):
        return frozenset().union(*map(_roles, x.values())) if x else frozenset({_COMMON})
    if isinstance(x, list):
        return frozenset().union(*map(_roles, x)) if x else frozenset({_COMMON})
    kind = classify(x)
    if kind is Kind.LOCAL:
        return frozenset({_LOCAL})
    if kind in (Kind.TENSOR, Kind.VALUE):
        return frozenset({_COMMON})
    return frozenset({_SHARDED})


def _check_uniform_list(x: list, path: Path) -> None:
    if len(x) < 2:
        return
    roles = [_roles(v) for v in x]
    if any(r != roles[0] for r in roles):
        detail = ", ".join(f"[{i}]: {'+'.join(sorted(r))}" for i, r in enumerate(roles))
        raise ShardingError(
            f"the list at '{path_str(path)}' mixes sharded, common and local entries ({detail}). "
            "Megatron-Core's format stores each part as its own compacted list, so the entries "
            "could not be put back at their positions; use a dict for such entries (or give "
            "every entry of the list the same kinds of values)"
        )


def _adopt_built(built: Any) -> Any:
    """A factory's build output with Megatron-Core's objects adopted (nested dicts/lists kept)."""
    if isinstance(built, dict):
        return {k: _adopt_built(v) for k, v in built.items()}
    if isinstance(built, list):
        return [_adopt_built(v) for v in built]
    kind = classify(built)
    if kind in (Kind.SHARDED_TENSOR, Kind.SHARDED_OBJECT):
        return adopt(built, kind, _adopt_built)
    return built


def _add_factory(out: SplitStateDict, path: Path, factory: ShardedTensorFactory, built: Any) -> None:
    out.factories[path] = (factory, built)
    leaves = _leaves(built) if isinstance(built, (dict, list)) else iter([((), built, classify(built))])
    for sub_path, sub, kind in leaves:
        if kind not in (Kind.SHARDED_TENSOR, Kind.SHARDED_OBJECT):
            raise ShardingError(
                f"the ShardedTensorFactory '{factory.key}' at '{path_str(path)}' built a "
                f"{type(sub).__name__} at '{path_str(sub_path)}'; a factory must build only "
                "ShardedTensors and ShardedObjects (in dicts or lists)"
            )
        out.sharded[path + (FACTORY_PART,) + sub_path] = sub


def _add_dtensor(out: SplitStateDict, path: Path, key: str, dt: Any) -> None:
    pieces = dtensor_pieces(key, dt, _where(path))
    factory = ShardedTensorFactory(key, dt, build_fn=lambda *_: pieces, merge_fn=lambda _pieces: dt)
    out.factories[path] = (factory, pieces)
    for i, piece in enumerate(pieces):
        out.sharded[path + (FACTORY_PART, i)] = piece
        out.dtensors[path + (FACTORY_PART, i)] = dt


# --- DCP-style --------------------------------------------------------------------------------


def split_dcp_v2_3(state_dict: dict) -> SplitStateDict:
    """A DCP-style request taken apart as torch <= 2.3's ``flatten_state_dict`` flattened it (its
    ``traverse_state_dict_v_2_3``): a dict or list holding no tensor, at any depth, is one leaf
    (one bytes item), not walked. ``dcp.load`` reads a checkpoint of that torch so (see
    :mod:`ckptd.loading.loader` for when); tensors have the same keys both ways."""
    return _split_dcp(state_dict, v2_3=True)


def _split_dcp(state_dict: dict, v2_3: bool = False) -> SplitStateDict:
    out = SplitStateDict(Dialect.DCP, common={})
    for path, dcp_path, leaf in _dcp_leaves(state_dict, v2_3=v2_3):
        key = dcp_fqn(dcp_path)
        if key in out.dcp_paths:
            raise ShardingError(
                f"two values of the state dict flatten to the key '{key}' "
                f"('{path_str(out.dcp_paths[key])}' and '{path_str(path)}'), as torch DCP "
                "flattens nested dicts; rename one of them"
            )
        out.dcp_paths[key] = dcp_path
        kind = classify(leaf)
        if kind is Kind.DTENSOR:
            _add_dtensor(out, path, key, leaf)
        else:
            item = ShardedTensor.whole(key, leaf) if kind is Kind.TENSOR else ByteItem(key, leaf)
            out.sharded[path] = out.dcp_plain[key] = item
    return out


def _dcp_leaves(x: dict, path: Path = (), dcp_path: Path = (), v2_3: bool = False) -> Iterator[tuple[Path, Path, Any]]:
    """Leaves as torch DCP's ``traverse_state_dict`` visits them: dicts are walked (keys as
    ``str``), a list only if it holds a tensor, a dict or such a list; tuples are leaves. With
    ``v2_3``, as torch <= 2.3's did: a dict or list holding no tensor at any depth is a leaf."""
    for k, v in x.items():
        yield from _dcp_visit(v, path + (k,), dcp_path + (str(k),), v2_3)


def _dcp_visit(v: Any, path: Path, dcp_path: Path, v2_3: bool) -> Iterator[tuple[Path, Path, Any]]:
    if v2_3 and isinstance(v, (dict, list)) and _v2_3_terminal(v):
        yield path, dcp_path, v
    elif isinstance(v, dict):
        yield from _dcp_leaves(v, path, dcp_path, v2_3)
    elif isinstance(v, list) and (v2_3 or not _dcp_terminal(v)):
        for i, e in enumerate(v):
            yield from _dcp_visit(e, path + (i,), dcp_path + (i,), v2_3)
    else:
        yield path, dcp_path, v


def _v2_3_terminal(v: dict | list) -> bool:
    """torch <= 2.3's ``_is_terminal``: no tensor and no container holding one, at any depth (an
    empty dict or list is terminal too)."""
    entries = v.values() if isinstance(v, dict) else v
    return not any(
        isinstance(e, torch.Tensor) or (isinstance(e, (dict, list)) and not _v2_3_terminal(e)) for e in entries
    )


def dcp_walk(state_dict: dict) -> tuple[list[Any], list[Any]]:
    """The leaves of a DCP-style state dict in :func:`_dcp_leaves` order, without their paths
    (~0.3 us a leaf), and the structure walked, in the same order: per dict one tuple of its keys
    and their types, per walked list its length, per leaf its type. Equal structures give equal
    lists (a prefix code: a list walked has a length of at least 1, a leaf's entry is a type)."""
    leaves: list[Any] = []
    shape: list[Any] = []
    _walk_dict(state_dict, leaves, shape)
    return leaves, shape


def _walk_dict(x: dict, leaves: list[Any], shape: list[Any]) -> None:
    pairs = list(x.items())  # as _dcp_leaves walks it
    keys = tuple(k for k, _ in pairs)
    shape.append((keys, tuple(map(type, keys))))  # 1 and True are equal keys, but not the same DCP key
    for _, v in pairs:
        _walk_value(v, leaves, shape)


def _walk_value(v: Any, leaves: list[Any], shape: list[Any]) -> None:
    if isinstance(v, dict):
        _walk_dict(v, leaves, shape)
    elif isinstance(v, list) and not _dcp_terminal(v):
        shape.append(len(v))
        for e in v:
            _walk_value(e, leaves, shape)
    else:
        shape.append(type(v))
        leaves.append(v)


def _dcp_terminal(v: list) -> bool:
    return not any(isinstance(e, (dict, torch.Tensor)) or (isinstance(e, list) and not _dcp_terminal(e)) for e in v)
