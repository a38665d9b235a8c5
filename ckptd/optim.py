"""Optimizer state as a sharded state dict keyed by parameter names, and back.

A ``torch.optim`` state dict identifies parameters by position (ids in ``param_groups``), which
only means something for one model layout. These helpers key every per-parameter state entry by
the parameter's checkpoint key and shard it exactly like the parameter, so an optimizer saved at
one parallel layout (TP/PP/DP, N-D or flattened distributed-optimizer shards) resumes at another.

Order of calls (every rank):

- save: ``shardings = param_shardings(optimizer, model_sharded_sd)`` (or build them yourself,
  e.g. flattened ones for a distributed optimizer; not for a parameter a ShardedTensorFactory
  wraps, whose state only the factory shards right: see :func:`_factory_error`), then put
  ``sharded_optimizer_state(optimizer, shardings)`` into the sharded state dict passed to save;
- load: ``template = optimizer_load_template(optimizer, shardings, ckpt_dir)``, pass it (inside
  your request) to ``ckptd.load``, then ``restore_optimizer_state(optimizer, loaded, shardings)``.

Layout of the stored entries (Megatron-Core's naming): tensor state ``s`` of the parameter with
checkpoint key ``k`` is ``<prefix>.state.<s>.<k>``, sharded like the parameter; 0-d tensors
(Adam's ``step``) are replicated scalars; Python values are ShardedObjects. Scalars are written
once, by the rank holding the parameter's first element in its main replica. Each parameter
key's group hyper-parameters are ``<prefix>.group.<k>``, a ShardedObject written once like a
scalar: a group resumes with those of its parameters, on every rank and at any grouping order
(checkpoints of earlier ckptd have a ``param_groups`` list instead, rank 0's common state,
restored by position). A tied parameter is one optimizer parameter, so it gets one sharding
(the first model key wrapping it) and is stored once.

Several optimizer parameters of one rank may be shards of one key at different offsets
(Megatron-Core's local experts: one key, a prepended expert axis). Each stores its state as the
shard of the key at its own offset, so the state resumes at any other split of the key (one
parameter holding every expert, other expert-parallel sizes). A key has one stored value per
scalar entry (``step``), as Megatron-Core keeps one step for all parameters: the shards a rank
holds must agree on it, else ``sharded_optimizer_state`` raises rather than store one shard's
step for all of them.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from .dist import DistContext
from .errors import LoadMismatchError, ShardingError
from .mapping import ShardedObject, ShardedTensor, is_main_replica
from .statedict.kinds import Kind, adopt, classify
from .statedict.tree import iter_leaves, path_str

OptimizerLike = Any  # torch.optim.Optimizer or its state_dict()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _ident(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))


def param_shardings(optimizer: torch.optim.Optimizer, model_sharded_state_dict: Any) -> list[ShardedTensor]:
    """The model ShardedTensor wrapping each optimizer parameter, in optimizer (state-dict) order.

    The model's sharded state dict must wrap the parameters themselves (or views sharing their
    memory, e.g. ``state_dict(keep_vars=True)``), in ckptd's or Megatron-Core's ShardedTensors
    (returned as ckptd's). Tied parameters: the first key wins. A parameter only a
    ShardedTensorFactory wraps is refused (see :func:`_factory_error`).
    """
    by_tensor: dict[tuple, ShardedTensor] = {}
    by_factory: dict[tuple, tuple[str, Any]] = {}
    for path, leaf in iter_leaves(model_sharded_state_dict):
        kind = classify(leaf)
        if kind is Kind.SHARDED_TENSOR and leaf.data is not None:
            by_tensor.setdefault(_ident(leaf.data), adopt(leaf, kind, lambda tree: tree))
        elif kind is Kind.FACTORY and isinstance(leaf.data, torch.Tensor):
            by_factory.setdefault(_ident(leaf.data), (path_str(path), leaf))
    out = []
    for i, p in enumerate(_params(optimizer)):
        sh = by_tensor.get(_ident(p))
        if sh is None and _ident(p) in by_factory:
            raise _factory_error(i, p, *by_factory[_ident(p)])
        if sh is None:
            raise ShardingError(
                f"optimizer parameter #{i} ({p.dtype}, shape {tuple(p.shape)}) is not wrapped by any "
                "ShardedTensor of the model's sharded state dict; build that dict over the "
                "parameters themselves (keep_vars=True) or pass the shardings explicitly"
            )
        out.append(sh)
    _check_unique(out)
    return out


def _factory_error(index: int, param: torch.Tensor, path: str, factory: Any) -> ShardingError:
    """A parameter a ShardedTensorFactory wraps: its shard is the pieces the factory builds (a
    gated linear unit's fc1 at TP > 1 holds ``[gate_r; up_r]``, rows of two halves of the global
    tensor), which no one ShardedTensor describes, and so no one sharding of its state does."""
    return ShardingError(
        f"optimizer parameter #{index} ({param.dtype}, shape {tuple(param.shape)}) is wrapped by the "
        f"ShardedTensorFactory '{factory.key}' at '{path}' of the model's sharded state dict, and by no "
        "ShardedTensor: its shard is stored as the pieces the factory builds (e.g. a gated linear unit's fc1 "
        "at tensor-parallel size > 1 holds [gate_r; up_r], rows of both halves of the global tensor), which "
        "no single sharding describes. A sharding made by hand (its rows at this rank's offset) would store "
        "its optimizer state in this rank's row order, which loads back only at the same tensor-parallel "
        "size. Build the state of such parameters through their factory instead (Megatron-Core's optimizer "
        "sharded_state_dict(model_sharded_state_dict) does; see the README, 'Optimizer state')"
    )


def _check_unique(shardings: Sequence[ShardedTensor]) -> None:
    seen: dict[tuple[str, tuple[int, ...], Any], int] = {}
    for i, sh in enumerate(shardings):
        ident = (
            sh.key,
            sh.global_offset,
            None if sh.flattened_range is None else (sh.flattened_range.start, sh.flattened_range.stop),
        )
        if ident in seen:
            raise ShardingError(
                f"optimizer parameters #{seen[ident]} and #{i} both map to the shard of '{sh.key}' "
                f"at {sh.global_offset}; each optimizer parameter needs its own sharding"
            )
        seen[ident] = i


def _where(sh: ShardedTensor) -> str:
    """The shard of its key a sharding is, in words: its offset (and flattened range)."""
    out = f"offset {sh.global_offset}"
    if sh.flattened_range is not None:
        out += f", flattened range [{sh.flattened_range.start}:{sh.flattened_range.stop}]"
    return out


def _state_labels(shardings: Sequence[ShardedTensor]) -> list[str]:
    """The key of each optimizer parameter's entry in the ``state`` dict, in optimizer order.

    The parameter's checkpoint key, unless this rank holds several shards of that key (local
    experts): those are ``<key>@<offset>`` (plus ``[start:stop]`` for flattened shards), so each
    shard keeps its own entry. The stored keys do not depend on it (they are the ShardedTensors'
    keys), so checkpoints saved by one such layout load at any other.
    """
    counts = Counter(sh.key for sh in shardings)
    labels = []
    for sh in shardings:
        label = sh.key
        if counts[sh.key] > 1:
            label += "@(" + ",".join(str(o) for o in sh.global_offset) + ")"
            if sh.flattened_range is not None:
                label += f"[{sh.flattened_range.start}:{sh.flattened_range.stop}]"
        labels.append(label)
    if len(set(labels)) != len(labels):
        dup = next(label for label, n in Counter(labels).items() if n > 1)
        raise ShardingError(
            f"two optimizer parameters would share the state entry '{dup}' on rank {DistContext.current().rank}: a "
            "parameter key contains '@(' like the names ckptd gives the shards of a key held "
            "several times; rename that key"
        )
    return labels


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.detach().cpu(), b.detach().cpu())
        )
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # element-wise == (an array, tensors in a list): compare bytes
        return pickle.dumps(a) == pickle.dumps(b)


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return repr(value.item())
    return repr(value)


def _check_shared_keys(shardings: Sequence[ShardedTensor], entries: Sequence[dict[str, Any]]) -> None:
    """Shards of one key on this rank must have the same state names and scalar values.

    A key's tensor state is one global tensor sharded like the parameter, and its scalars
    (``step``) are one stored value: a shard without an entry would leave a hole, and a shard
    whose step differs would resume with another shard's step.
    """
    first: dict[str, int] = {}
    for i, sh in enumerate(shardings):
        j = first.setdefault(sh.key, i)
        if j == i:
            continue
        a, b = entries[j], entries[i]
        where = (
            f"parameter #{j} ({_where(shardings[j])}) and parameter #{i} ({_where(sh)}), shards of "
            f"'{sh.key}' that rank {DistContext.current().rank} holds"
        )
        if set(a) != set(b):
            raise ShardingError(
                f"{where}, have different optimizer state: {sorted(a)} and {sorted(b)}. The state "
                f"of '{sh.key}' is stored as one tensor per entry, sharded like the parameter, so "
                "every shard needs every entry: save after an optimizer step that updated all of "
                "them, or give the shards keys of their own"
            )
        for name, value in a.items():
            scalar = not isinstance(value, torch.Tensor) or value.dim() == 0
            if scalar and not _same_value(value, b[name]):
                raise ShardingError(
                    f"{where}, have different optimizer '{name}': {_show(value)} and "
                    f"{_show(b[name])}. ckptd stores one '{name}' per parameter key (as Megatron-Core "
                    "keeps one step for all parameters), so a resumed shard would get another shard's "
                    f"value: step every shard of '{sh.key}' together (e.g. a zero gradient for an "
                    "expert that got no tokens, not None), or give the shards keys of their own"
                )


def _local_shape(sh: ShardedTensor) -> tuple[int, ...]:
    if sh.flattened_range is not None:
        return (sh.flattened_range.stop - sh.flattened_range.start,)
    return sh.local_shape


def _scalar_replica(sh: ShardedTensor) -> int:
    """0 on exactly one rank: the main replica holding the parameter's first element."""
    first = all(o == 0 for o in sh.global_offset)
    if sh.flattened_range is not None:
        fr = sh.flattened_range
        first = first and fr.start == 0 and fr.stop > 0
    return 0 if first and is_main_replica(sh.replica_id) else 1


def _state_key(prefix: str, name: str, sh: ShardedTensor) -> str:
    return f"{prefix}.state.{name}.{sh.key}"


def _shard_value(key: str, name: str, value: Any, sh: ShardedTensor) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dim() == 0:
            return ShardedTensor(key, value, value.dtype, (), (), (), (), _scalar_replica(sh))
        if tuple(value.shape) != _local_shape(sh):
            raise ShardingError(
                f"optimizer state '{name}' of '{sh.key}' has shape {tuple(value.shape)}, neither a "
                f"scalar nor the parameter shard's shape {_local_shape(sh)}; ckptd cannot shard it "
                "like the parameter (store it in a ShardedObject of your own)"
            )
        return replace(sh, key=key, data=value, dtype=value.dtype)
    return ShardedObject(key, value, (1,), (0,), _scalar_replica(sh))


def _ordered_ids(state_dict: dict) -> list[Any]:
    return [pid for g in state_dict["param_groups"] for pid in g["params"]]


def sharded_optimizer_state(
    optimizer: OptimizerLike, shardings: Sequence[ShardedTensor], *, prefix: str = "optimizer"
) -> dict[str, Any]:
    """``{"state": {param_key: {name: sharded entry}}, "groups": {param_key: hyper-parameters}}``.

    ``shardings[i]`` describes optimizer parameter ``i`` (state-dict order); the optimizer's
    tensors are referenced, not copied. Where this rank holds several shards of one key, their
    entries are ``<key>@<offset>`` (each stored as the shard of the key at that offset).
    """
    sd = optimizer.state_dict() if hasattr(optimizer, "state_dict") else optimizer
    ids = _ordered_ids(sd)
    if len(ids) != len(shardings):
        raise ShardingError(f"the optimizer has {len(ids)} parameters but {len(shardings)} shardings were given")
    _check_unique(shardings)
    labels = _state_labels(shardings)
    per_param = [sd["state"].get(pid, {}) for pid in ids]
    _check_shared_keys(shardings, per_param)
    state: dict[str, dict[str, Any]] = {}
    for label, sh, entries in zip(labels, shardings, per_param):
        # Scalars of a key held several times: one entry per shard, the same stored value; only
        # the shard at the key's first element is the main replica (it writes the value once).
        state[label] = {
            name: _shard_value(_state_key(prefix, name, sh), name, value, sh) for name, value in entries.items()
        }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    # Each parameter key's group hyper-parameters, stored once per key like a scalar: a group's
    # list (``param_groups``, rank 0's common state) gave every rank rank 0's groups (pipeline
    # stages have their own), matched by position only.
    group_of = {pid: i for i, g in enumerate(sd["param_groups"]) for pid in g["params"]}
    hyper = [_hyperparams(groups[group_of[pid]]) for pid in ids]
    _check_shared_groups(shardings, hyper)
    by_key = {
        label: ShardedObject(_group_key(prefix, sh), h, (1,), (0,), _scalar_replica(sh))
        for label, sh, h in zip(labels, shardings, hyper)
    }
    # (No ``param_groups`` list: restored by position, it is what gave every rank rank 0's groups.)
    return {"state": state, "groups": by_key}


def _check_shared_groups(shardings: Sequence[ShardedTensor], hyper: Sequence[dict[str, Any]]) -> None:
    """Shards of one key on this rank must be in groups of the same hyper-parameters: the key
    stores one set, and a resumed shard would get another's."""
    first: dict[str, int] = {}
    for i, sh in enumerate(shardings):
        j = first.setdefault(sh.key, i)
        if j != i and not _same_hyper(hyper[j], hyper[i]):
            raise ShardingError(
                f"parameters #{j} and #{i}, shards of '{sh.key}' that rank {DistContext.current().rank} holds, are "
                f"in optimizer groups of different hyper-parameters ({_show(hyper[j])} and {_show(hyper[i])}): "
                "the key stores one set. Put its shards in one group, or give them keys of their own"
            )


def _same_hyper(a: Any, b: Any) -> bool:
    """Hyper-parameters equal as values: a list and a tuple of the same values (a config's
    ``betas`` and torch's default), NaN and NaN, tensors by their elements."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_hyper(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_hyper(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if (
            not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
            or a.shape != b.shape
            or a.dtype != b.dtype
        ):
            return False
        x, y = a.detach().cpu(), b.detach().cpu()
        return torch.equal(x, y) or bool(x.is_floating_point() and torch.all((x == y) | (x.isnan() & y.isnan())))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return _same_value(a, b)


def _group_key(prefix: str, sh: ShardedTensor) -> str:
    return f"{prefix}.group.{sh.key}"


def _hyperparams(group: dict[str, Any]) -> dict[str, Any]:
    """A group's hyper-parameters, without what names its parameters (ids, ``param_names``)."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _stored_state_names(checkpoint_dir: Any, prefix: str) -> dict[str, dict[str, Any]]:
    """``{param_key: {state name: stored ShardedTensor | ShardedObject}}`` from the metadata."""
    from .api import load_sharded_metadata

    head = f"{prefix}.state."
    out: dict[str, dict[str, Any]] = {}
    for entry in load_sharded_metadata(checkpoint_dir).values():
        if entry.key.startswith(f"{prefix}.group.") and isinstance(entry, ShardedObject):
            out.setdefault(entry.key[len(f"{prefix}.group.") :], {})[_GROUP] = entry
        if not entry.key.startswith(head):
            continue
        name, _, param_key = entry.key[len(head) :].partition(".")
        if param_key:
            out.setdefault(param_key, {})[name] = entry
    return out


# The name under which _stored_state_names lists a key's group hyper-parameters (no state name
# has a slash: they are attribute-like, and the stored key's segments are dotted).
_GROUP = "/group"


def optimizer_load_template(
    optimizer: torch.optim.Optimizer,
    shardings: Sequence[ShardedTensor],
    checkpoint_dir: Any,
    *,
    prefix: str = "optimizer",
    allow_missing: bool = False,
) -> dict[str, Any]:
    """The load request for the optimizer state stored in ``checkpoint_dir`` at this layout.

    Entries come from the checkpoint's metadata (so a fresh optimizer without state can resume);
    existing state tensors of matching shape and dtype are loaded in place. Each parameter gets
    entries of its own (shards of one key too: the key's shard at its offset, a scalar each).
    LoadMismatchError when a parameter's key is not in the checkpoint's optimizer at all (a key
    renamed, a tied parameter keyed by its other name, no optimizer saved under ``prefix``): it
    would resume without its state. ``allow_missing``: such parameters start without state (new
    parameters of a fine-tuning); a template of no entry at all (every key new) is left out of
    ``ckptd.load``'s result, as any empty part of a request: pass ``loaded.get(key, {})`` on.
    """
    params = _params(optimizer)
    if len(params) != len(shardings):
        raise ShardingError(f"the optimizer has {len(params)} parameters but {len(shardings)} shardings were given")
    _check_unique(shardings)
    labels = _state_labels(shardings)
    stored = _stored_state_names(checkpoint_dir, prefix)
    if not allow_missing:
        _check_all_saved(shardings, stored, prefix, checkpoint_dir)
    state: dict[str, dict[str, Any]] = {}
    groups: dict[str, ShardedObject] = {}
    for p, sh, label in zip(params, shardings, labels):
        have = optimizer.state.get(p, {})
        entries: dict[str, Any] = {}
        for name, meta in stored.get(sh.key, {}).items():
            if name == _GROUP:
                groups[label] = ShardedObject(_group_key(prefix, sh), None, (1,), (0,), 1)
                continue
            key = _state_key(prefix, name, sh)
            if isinstance(meta, ShardedObject):
                entries[name] = ShardedObject(key, None, (1,), (0,), 1)
            elif meta.global_shape == ():
                entries[name] = ShardedTensor(key, torch.empty((), dtype=meta.dtype), meta.dtype, (), (), (), (), 1)
            else:
                cur = have.get(name)
                ok = (
                    isinstance(cur, torch.Tensor)
                    and cur.dtype == meta.dtype
                    and tuple(cur.shape) == _local_shape(sh)
                    and cur.device.type == "cpu"
                    and cur.is_contiguous()
                )
                data = cur if ok else torch.empty(_local_shape(sh), dtype=meta.dtype)
                entries[name] = replace(sh, key=key, data=data, dtype=meta.dtype)
        state[label] = entries
    return {"state": state, "groups": groups} if groups else {"state": state}


def restore_optimizer_state(
    optimizer: torch.optim.Optimizer,
    loaded: dict[str, Any],
    shardings: Sequence[ShardedTensor],
    *,
    restore_hyperparams: bool = True,
) -> None:
    """Load ``loaded`` (the optimizer part of ``ckptd.load``'s result) into ``optimizer``.

    LoadMismatchError for a non-empty ``loaded`` with none of that part's keys (``state``,
    ``groups``, ``param_groups``): the whole load result, which would wipe every parameter's state.

    Parameter ids come from the live optimizer. Hyper-parameters (``restore_hyperparams``): each
    group gets those its parameters' keys were saved with (checkpoints of ckptd before: the saved
    ``param_groups`` by position, rank 0's); LoadMismatchError when the parameters of one live
    group were saved in groups of different hyper-parameters.
    """
    _check_optimizer_part(loaded)
    live = optimizer.state_dict()
    ids = _ordered_ids(live)
    if len(ids) != len(shardings):
        raise ShardingError(f"the optimizer has {len(ids)} parameters but {len(shardings)} shardings were given")
    _check_unique(shardings)
    labels = _state_labels(shardings)
    stored_state = loaded.get("state", {})
    saved_by_key = loaded.get("groups")
    new_state = {}
    for pid, label in zip(ids, labels):
        entry = stored_state.get(label)
        if entry:
            new_state[pid] = dict(entry)
    groups = live["param_groups"]
    saved_groups = loaded.get("param_groups")
    if restore_hyperparams and saved_by_key:
        label_of = dict(zip(ids, labels))
        groups = [
            _restored_group(i, g, [saved_by_key.get(label_of[pid]) for pid in g["params"]])
            for i, g in enumerate(groups)
        ]
    elif restore_hyperparams and saved_groups is not None:
        if len(saved_groups) != len(groups):
            raise LoadMismatchError(
                f"the checkpoint has {len(saved_groups)} optimizer parameter groups but the "
                f"optimizer has {len(groups)}; pass restore_hyperparams=False to keep the live ones"
            )
        groups = [{**saved, "params": g["params"]} for saved, g in zip(saved_groups, groups)]
    optimizer.load_state_dict({"state": new_state, "param_groups": groups})


# What restore_optimizer_state reads of its ``loaded``: the per-parameter state, the per-key group
# hyper-parameters, and the group list of checkpoints of earlier ckptd.
_OPTIMIZER_PARTS = ("state", "groups", "param_groups")


def _check_optimizer_part(loaded: Any) -> None:
    """Refuse a ``loaded`` that is not the optimizer's part of a load result (the whole result,
    ``{"model": ..., "optimizer": ...}``): read as one, it holds no parameter's state, and the
    restore would wipe every parameter's. ``{}`` stays valid: a template of only new keys is left
    out of the result (``loaded.get(key, {})``)."""
    if not isinstance(loaded, Mapping):
        raise LoadMismatchError(
            f"restore_optimizer_state got a {type(loaded).__name__}, not a dict: pass the optimizer's part of "
            'ckptd.load\'s result (loaded["optimizer"], or loaded.get("optimizer", {}))'
        )
    if loaded and not any(part in loaded for part in _OPTIMIZER_PARTS):
        keys = sorted(repr(k) for k in loaded)
        named = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        raise LoadMismatchError(
            f"restore_optimizer_state got a dict with the keys {named} and none of an optimizer's part of a "
            f"load result ({', '.join(repr(p) for p in _OPTIMIZER_PARTS)}): restoring it would drop every "
            "parameter's state (moments, step). Pass the optimizer's part of ckptd.load's result "
            '(loaded["optimizer"], or loaded.get("optimizer", {}) where every key is new), not the whole result'
        )


def _holds_param_groups(checkpoint_dir: Any) -> bool:
    """Whether the checkpoint's common state names an optimizer's ``param_groups`` (an earlier
    ckptd's optimizer state): looked for among the strings of ``common.pt``'s pickle, which is
    never run (it may hold objects a weights-only load refuses, a Megatron-LM ``args``), and among
    the keys of its values. True when the checkpoint cannot be read (nothing is refused on a
    guess: the load says what is wrong)."""
    import io
    import pickletools
    import zipfile

    from .errors import CkptdError
    from .format.archive import decode_problem
    from .format.layout import COMMON_PT, COMMON_PT_MAX_NBYTES
    from .format.safefs import read_regular
    from .opening import opened

    try:
        with opened(checkpoint_dir) as ckpt:
            if any("param_groups" in fqn for fqn in ckpt.index().objects):
                return True
            try:
                raw = read_regular(ckpt.directory, COMMON_PT, "common state", COMMON_PT_MAX_NBYTES)
            except FileNotFoundError:
                return False
        if decode_problem(io.BytesIO(raw)) is not None:
            return True  # not a well-formed archive (a compressed record would inflate unbounded)
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            (pkl,) = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            ops = pickletools.genops(zf.read(pkl))
            return any(isinstance(arg, str) and arg == "param_groups" for _, arg, _ in ops)
    except (CkptdError, OSError, ValueError, zipfile.BadZipFile):
        return True


def _check_all_saved(
    shardings: Sequence[ShardedTensor], stored: dict[str, dict[str, Any]], prefix: str, checkpoint_dir: Any
) -> None:
    """Raise LoadMismatchError naming the parameters whose keys the checkpoint's optimizer did not
    hold: they would resume without state. Known from the per-key groups (every saved parameter
    has one, with or without state); nothing is told of a checkpoint without them (an earlier
    ckptd's)."""
    if stored and not any(_GROUP in entries for entries in stored.values()):
        return  # an earlier ckptd's: "held without state" and "not held" look alike there
    if not stored and _holds_param_groups(checkpoint_dir):
        return  # an earlier ckptd's optimizer without any state (SGD, or saved before a step)
    missing = sorted({sh.key for sh in shardings if _GROUP not in stored.get(sh.key, {})})
    if missing:
        named = ", ".join(f"'{k}'" for k in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise LoadMismatchError(
            f"the checkpoint holds no optimizer state of {named} under '{prefix}': their keys are not the saved "
            "optimizer's (renamed, a tied parameter keyed by another of its names, another prefix, or no "
            "optimizer saved), so they would resume without state. Load under the keys saved, or pass "
            "allow_missing=True for parameters that start fresh"
        )


def _restored_group(index: int, live: dict[str, Any], saved: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Live group ``index`` with the hyper-parameters its parameters' keys were saved with."""
    known = [s for s in saved if s is not None]
    if not known:
        return live  # parameters the checkpoint knows nothing of keep theirs
    first = known[0]
    for other in known[1:]:
        if not _same_hyper(first, other):
            raise LoadMismatchError(
                f"the parameters of optimizer group {index} were saved in groups of different hyper-parameters "
                f"({_show(first)} and {_show(other)}); group them as saved, or pass restore_hyperparams=False "
                "to keep the live ones"
            )
    return {**live, **first, "params": live["params"]}


def state_names(optimizer: torch.optim.Optimizer) -> Iterable[str]:
    """Names of the per-parameter state entries currently held (e.g. exp_avg, exp_avg_sq, step)."""
    names: set[str] = set()
    for s in optimizer.state.values():
        names.update(s)
    return sorted(names)


__all__ = [
    "param_shardings",
    "sharded_optimizer_state",
    "optimizer_load_template",
    "restore_optimizer_state",
    "state_names",
]
