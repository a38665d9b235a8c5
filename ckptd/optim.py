"""Optimizer state as a sharded state dict keyed by parameter names, and back.

A ``torch.optim`` state dict identifies parameters by position (ids in ``param_groups``), which
only means something for one model layout. These helpers key every per-parameter state entry by
the parameter's checkpoint key and shard it exactly like the parameter, so an optimizer saved at
one parallel layout (TP/PP/DP, N-D or flattened distributed-optimizer shards) resumes at another.

Order of calls (every rank):

- save: ``shardings = param_shardings(optimizer, model_sharded_sd)`` (or build them yourself,
  e.g. flattened ones for a distributed optimizer), then put
  ``sharded_optimizer_state(optimizer, shardings)`` into the sharded state dict passed to save;
- load: ``template = optimizer_load_template(optimizer, shardings, ckpt_dir)``, pass it (inside
  your request) to ``ckptd.load``, then ``restore_optimizer_state(optimizer, loaded, shardings)``.

Layout of the stored entries (Megatron-Core's naming): tensor state ``s`` of the parameter with
checkpoint key ``k`` is ``<prefix>.state.<s>.<k>``, sharded like the parameter; 0-d tensors
(Adam's ``step``) are replicated scalars; Python values are ShardedObjects. Scalars are written
once, by the rank holding the parameter's first element in its main replica. Parameter-group
hyper-parameters (without the ids) are common state. A tied parameter is one optimizer
parameter, so it gets one sharding (the first model key wrapping it) and is stored once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from .errors import LoadMismatchError, ShardingError
from .mapping import ShardedObject, ShardedTensor, is_main_replica
from .statedict.tree import iter_leaves

OptimizerLike = Any  # torch.optim.Optimizer or its state_dict()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _ident(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))


def param_shardings(optimizer: torch.optim.Optimizer, model_sharded_state_dict: Any) -> list[ShardedTensor]:
    """The model ShardedTensor wrapping each optimizer parameter, in optimizer (state-dict) order.

    The model's sharded state dict must wrap the parameters themselves (or views sharing their
    memory, e.g. ``state_dict(keep_vars=True)``). Tied parameters: the first key wins.
    """
    by_tensor: dict[tuple, ShardedTensor] = {}
    for _, leaf in iter_leaves(model_sharded_state_dict):
        if isinstance(leaf, ShardedTensor) and leaf.data is not None:
            by_tensor.setdefault(_ident(leaf.data), leaf)
    out = []
    for i, p in enumerate(_params(optimizer)):
        sh = by_tensor.get(_ident(p))
        if sh is None:
            raise ShardingError(
                f"optimizer parameter #{i} ({p.dtype}, shape {tuple(p.shape)}) is not wrapped by any "
                "ShardedTensor of the model's sharded state dict; build that dict over the "
                "parameters themselves (keep_vars=True) or pass the shardings explicitly"
            )
        out.append(sh)
    _check_unique(out)
    return out


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
    """``{"state": {param_key: {name: sharded entry}}, "param_groups": [hyper-parameters]}``.

    ``shardings[i]`` describes optimizer parameter ``i`` (state-dict order); the optimizer's
    tensors are referenced, not copied.
    """
    sd = optimizer.state_dict() if hasattr(optimizer, "state_dict") else optimizer
    ids = _ordered_ids(sd)
    if len(ids) != len(shardings):
        raise ShardingError(f"the optimizer has {len(ids)} parameters but {len(shardings)} shardings were given")
    _check_unique(shardings)
    state: dict[str, dict[str, Any]] = {}
    for pid, sh in zip(ids, shardings):
        entries = sd["state"].get(pid, {})
        state[sh.key] = {
            name: _shard_value(_state_key(prefix, name, sh), name, value, sh) for name, value in entries.items()
        }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def _stored_state_names(checkpoint_dir: Any, prefix: str) -> dict[str, dict[str, Any]]:
    """``{param_key: {state name: stored ShardedTensor | ShardedObject}}`` from the metadata."""
    from .api import load_sharded_metadata

    head = f"{prefix}.state."
    out: dict[str, dict[str, Any]] = {}
    for entry in load_sharded_metadata(checkpoint_dir).values():
        if not entry.key.startswith(head):
            continue
        name, _, param_key = entry.key[len(head) :].partition(".")
        if param_key:
            out.setdefault(param_key, {})[name] = entry
    return out


def optimizer_load_template(
    optimizer: torch.optim.Optimizer,
    shardings: Sequence[ShardedTensor],
    checkpoint_dir: Any,
    *,
    prefix: str = "optimizer",
) -> dict[str, Any]:
    """The load request for the optimizer state stored in ``checkpoint_dir`` at this layout.

    Entries come from the checkpoint's metadata (so a fresh optimizer without state can resume);
    existing state tensors of matching shape and dtype are loaded in place.
    """
    params = _params(optimizer)
    if len(params) != len(shardings):
        raise ShardingError(f"the optimizer has {len(params)} parameters but {len(shardings)} shardings were given")
    stored = _stored_state_names(checkpoint_dir, prefix)
    state: dict[str, dict[str, Any]] = {}
    for p, sh in zip(params, shardings):
        have = optimizer.state.get(p, {})
        entries: dict[str, Any] = {}
        for name, meta in stored.get(sh.key, {}).items():
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
        state[sh.key] = entries
    return {"state": state}


def restore_optimizer_state(
    optimizer: torch.optim.Optimizer,
    loaded: dict[str, Any],
    shardings: Sequence[ShardedTensor],
    *,
    restore_hyperparams: bool = True,
) -> None:
    """Load ``loaded`` (the optimizer part of ``ckptd.load``'s result) into ``optimizer``.

    Parameter ids come from the live optimizer; hyper-parameters from the checkpoint's
    ``param_groups`` when ``restore_hyperparams`` and the group count matches.
    """
    live = optimizer.state_dict()
    ids = _ordered_ids(live)
    if len(ids) != len(shardings):
        raise ShardingError(f"the optimizer has {len(ids)} parameters but {len(shardings)} shardings were given")
    stored_state = loaded.get("state", {})
    new_state = {}
    for pid, sh in zip(ids, shardings):
        entry = stored_state.get(sh.key)
        if entry:
            new_state[pid] = dict(entry)
    groups = live["param_groups"]
    saved_groups = loaded.get("param_groups")
    if restore_hyperparams and saved_groups is not None:
        if len(saved_groups) != len(groups):
            raise LoadMismatchError(
                f"the checkpoint has {len(saved_groups)} optimizer parameter groups but the "
                f"optimizer has {len(groups)}; pass restore_hyperparams=False to keep the live ones"
            )
        groups = [{**saved, "params": g["params"]} for saved, g in zip(saved_groups, groups)]
    optimizer.load_state_dict({"state": new_state, "param_groups": groups})


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
