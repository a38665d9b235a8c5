"""The reference state of the interop tests, and how each library shards it.

Every tensor has a *save* layout (how the two writing ranks split it) and a different *load*
layout (another axis, or other ranks), so every load reshards through chunk intersection.

=========== ======= ============ ============================== ===============================
key         dtype   global shape saved (world size 2)           loaded (world size 2)
=========== ======= ============ ============================== ===============================
dense.f32   float32 (6, 8)       rows split                     columns split
dense.bf16  bfloat16 (4, 10)     columns split                  rows split
stack.f16   float16 (2, 3, 4)    one layer each (prepend axis)  last axis split
ids.i64     int64   (10,)        halves                         halves, ranks swapped
mask.bool   bool    (4, 6)       replicated (replica_id=rank)   whole tensor on each rank
=========== ======= ============ ============================== ===============================

Plus ShardedObjects ``rng`` (one shard per rank) and ``cfg`` (replicated), and common state.
Float tensors hold -0.0, +-inf, NaN and subnormals, so "equal" below means equal bits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ckptd.format.dcp_metadata import read_index

WORLD = 2


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    f32 = torch.randn(6, 8, generator=g)
    f32[0, :4] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")])
    f32[5, 7] = 1e-42  # subnormal
    f16 = torch.randn(2, 3, 4, generator=g).to(torch.float16)
    f16[1, 2, 3] = float("nan")
    return {
        "dense.f32": f32,
        "dense.bf16": (torch.randn(4, 10, generator=g) * 1e3).to(torch.bfloat16),
        "stack.f16": f16,
        "ids.i64": torch.randint(-(2**62), 2**62, (10,), generator=g, dtype=torch.int64),
        "mask.bool": torch.rand(4, 6, generator=g) > 0.5,
    }


def rng_object(rank: int) -> dict[str, Any]:
    return {"rank": rank, "seed": 1234 + rank, "state": torch.arange(4, dtype=torch.uint8) + rank}


CFG_OBJECT = {"hidden": 8, "names": ["a", "b"], "ratio": 0.25}


def common_state() -> dict[str, Any]:
    return {"iteration": 42, "args": {"lr": 3e-4, "layers": [1, 2, 3]}}


def same_bits(a: Any, b: Any) -> bool:
    """Equal dtype, shape and bytes (NaN == NaN, -0.0 != 0.0)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def same_object(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return same_bits(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_object(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_object, a, b))
    return type(a) is type(b) and a == b


def assert_compact(path: Path, tensor_nbytes: int) -> None:
    """The size bound of a checkpoint: all its files together take at most 1.02 x the tensor
    bytes + 4 KiB per stored item (tensor chunks and objects; ``common.pt`` counts as one)."""
    index = read_index(path)
    items = sum(len(t.chunks) for t in index.tensors.values()) + len(index.objects) + 1
    nbytes = sum(p.stat().st_size for p in path.iterdir())
    assert nbytes <= 1.02 * tensor_nbytes + 4096 * items, (path, nbytes, tensor_nbytes, items)


def save_slices(rank: int) -> dict[str, tuple[slice, ...]]:
    """Each key's local chunk at save (``mask.bool`` is whole: every rank holds a replica)."""
    return {
        "dense.f32": (slice(3 * rank, 3 * rank + 3),),
        "dense.bf16": (slice(None), slice(5 * rank, 5 * rank + 5)),
        "stack.f16": (rank,),
        "ids.i64": (slice(5 * rank, 5 * rank + 5),),
        "mask.bool": (),
    }


def load_slices(rank: int) -> dict[str, tuple[slice, ...]]:
    """Each key's local chunk at load, world size 2: a different sharding than at save."""
    other = 1 - rank
    return {
        "dense.f32": (slice(None), slice(4 * rank, 4 * rank + 4)),
        "dense.bf16": (slice(2 * rank, 2 * rank + 2),),
        "stack.f16": (slice(None), slice(None), slice(2 * rank, 2 * rank + 2)),
        "ids.i64": (slice(5 * other, 5 * other + 5),),
        "mask.bool": (),
    }


def ckptd_save_state(rank: int, module: Any) -> dict[str, Any]:
    """The sharded state dict to save, built with ``module`` (``ckptd`` or
    ``megatron.core.dist_checkpointing``, whose mapping classes have the same signatures)."""
    ref = reference()
    ST, SO = module.ShardedTensor, module.ShardedObject  # noqa: N806 - classes, named like classes
    local = {k: ref[k][s].clone() for k, s in save_slices(rank).items()}
    return {
        "dense": {
            "f32": ST.from_rank_offsets("dense.f32", local["dense.f32"], (0, rank, WORLD)),
            "bf16": ST.from_rank_offsets("dense.bf16", local["dense.bf16"], (1, rank, WORLD)),
        },
        "stack": [ST.from_rank_offsets("stack.f16", local["stack.f16"], (0, rank, WORLD), prepend_axis_num=1)],
        "ids.i64": ST.from_rank_offsets("ids.i64", local["ids.i64"], (0, rank, WORLD)),
        "mask.bool": ST.from_rank_offsets("mask.bool", local["mask.bool"], replica_id=rank),
        "rng": SO("rng", rng_object(rank), (WORLD,), (rank,)),
        "cfg": SO("cfg", CFG_OBJECT, (1,), (0,), replica_id=rank),
        **common_state(),
    }


def ckptd_load_request(rank: int, module: Any) -> dict[str, Any]:
    """A load request at world size 2 with the :func:`load_slices` sharding (flat keys), naming
    the common values too (a checkpoint without ``common.pt`` returns only what is asked for)."""
    ref = reference()
    ST, SO = module.ShardedTensor, module.ShardedObject  # noqa: N806 - classes, named like classes
    other = 1 - rank
    empty = {k: torch.empty_like(ref[k][s]) for k, s in load_slices(rank).items()}
    return {
        "dense.f32": ST.from_rank_offsets("dense.f32", empty["dense.f32"], (1, rank, WORLD)),
        "dense.bf16": ST.from_rank_offsets("dense.bf16", empty["dense.bf16"], (0, rank, WORLD)),
        "stack.f16": ST.from_rank_offsets("stack.f16", empty["stack.f16"], (2, rank, WORLD)),
        "ids.i64": ST.from_rank_offsets("ids.i64", empty["ids.i64"], (0, other, WORLD)),
        "mask.bool": ST.from_rank_offsets("mask.bool", empty["mask.bool"], replica_id=rank),
        "rng": SO("rng", None, (WORLD,), (rank,)),
        "cfg": SO("cfg", None, (1,), (0,), replica_id=rank),
        **dict.fromkeys(common_state()),
    }


def check_loaded(rank: int, loaded: dict[str, Any], *, objects: bool = True, common: bool = True) -> list[str]:
    """Mismatches of a state dict loaded with :func:`ckptd_load_request` (empty list: all equal)."""
    ref = reference()
    bad = [f"rank {rank}: tensor {k}" for k, s in load_slices(rank).items() if not same_bits(loaded.get(k), ref[k][s])]
    if objects:
        if not same_object(rng_object(rank), loaded.get("rng")):
            bad.append(f"rank {rank}: object rng = {loaded.get('rng')!r}")
        if not same_object(CFG_OBJECT, loaded.get("cfg")):
            bad.append(f"rank {rank}: object cfg = {loaded.get('cfg')!r}")
    if common:
        for k, v in common_state().items():
            if not same_object(v, loaded.get(k)):
                bad.append(f"rank {rank}: common {k} = {loaded.get(k)!r}")
    return bad


def single_rank_request(module: Any) -> dict[str, Any]:
    """A world-size-1 load request that splits each tensor along another axis than at save, into
    several pieces (several requests of one key), plus every object shard."""
    ref = reference()
    ST, SO = module.ShardedTensor, module.ShardedObject  # noqa: N806 - classes, named like classes
    req: dict[str, Any] = {}
    for i in range(2):
        req[f"f32.cols{i}"] = ST.from_rank_offsets("dense.f32", torch.empty(6, 4), (1, i, 2))
    for i in range(4):
        req[f"bf16.row{i}"] = ST.from_rank_offsets("dense.bf16", torch.empty(1, 10, dtype=torch.bfloat16), (0, i, 4))
    for i in range(3):
        req[f"f16.mid{i}"] = ST.from_rank_offsets("stack.f16", torch.empty(2, 1, 4, dtype=torch.float16), (1, i, 3))
    req["ids.i64"] = ST.from_rank_offsets("ids.i64", torch.empty_like(ref["ids.i64"]))
    req["mask.bool"] = ST.from_rank_offsets("mask.bool", torch.empty_like(ref["mask.bool"]))
    for r in range(WORLD):
        req[f"rng{r}"] = SO("rng", None, (WORLD,), (r,))
    req["cfg"] = SO("cfg", None, (1,), (0,))
    req.update(dict.fromkeys(common_state()))
    return req


def check_single_rank(loaded: dict[str, Any], *, common: bool = True) -> list[str]:
    ref = reference()
    expect: dict[str, Any] = {f"f32.cols{i}": ref["dense.f32"][:, 4 * i : 4 * i + 4] for i in range(2)}
    expect.update({f"bf16.row{i}": ref["dense.bf16"][i : i + 1] for i in range(4)})
    expect.update({f"f16.mid{i}": ref["stack.f16"][:, i : i + 1] for i in range(3)})
    expect.update({k: ref[k] for k in ("ids.i64", "mask.bool")})
    expect.update({f"rng{r}": rng_object(r) for r in range(WORLD)}, cfg=CFG_OBJECT)
    if common:
        expect.update(common_state())
    return [f"{k} = {loaded.get(k)!r}" for k, v in expect.items() if not same_object(v, loaded.get(k))]
