"""The form of a ShardedObject shard's key, ``<key>/shard_<offsets>_<shape>`` (Megatron-Core's
``ShardedObject.unique_key``), without torch: the daemon checks a commit's objects by it."""

from __future__ import annotations

from collections.abc import Iterable


def object_key_parts(fqn: str) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """``(key, offsets, global shape)`` when ``fqn`` has the form of a ShardedObject's unique key
    (``<key>/shard_<offsets>_<shape>``; Megatron-Core's backward-compatible keys may lack the last
    dimension of the shape), else None. A top-level bytes item under such a key is read back as a
    ShardedObject shard."""
    key, sep, shard = fqn.rpartition("/")
    parts = shard.split("_")
    if not sep or not key or len(parts) != 3 or parts[0] != "shard":
        return None
    try:
        offsets = tuple(int(p) for p in parts[1].split(".")) if parts[1] else ()
        shape = tuple(int(p) for p in parts[2].split(".")) if parts[2] else ()
    except ValueError:
        return None
    return (key, offsets, shape) if len(offsets) in (len(shape), len(shape) + 1) else None


def looks_like_object_key(fqn: str) -> bool:
    return object_key_parts(fqn) is not None


def completed_object_keys(keys: Iterable[str]) -> dict[str, str]:
    """``{stored key: the key a load asks for}`` of the ShardedObject shards among ``keys`` that an
    older Megatron-Core stored under a key whose shape lacks its last dimension
    (``<key>/shard_<o0>.<o1>_<s0>``). Megatron-Core reads such a shape's last dimension as -1; here
    it is the largest last offset among the object's shards plus one (its shards of every offset
    along it are stored), so a load of the object at its whole shape finds them. A completed key
    that is stored already is left out (it stays the stored object's)."""
    keys = list(keys)
    legacy: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]] = {}
    last: dict[tuple[str, tuple[int, ...]], int] = {}
    for fqn in keys:
        parts = object_key_parts(fqn)
        if parts is not None and len(parts[1]) == len(parts[2]) + 1:
            key, offsets, shape = parts
            legacy[fqn] = parts
            last[(key, shape)] = max(last.get((key, shape), 0), offsets[-1] + 1)
    taken = set(keys) if legacy else set()
    out: dict[str, str] = {}
    for fqn, (key, offsets, shape) in legacy.items():
        full = f"{key}/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, (*shape, last[(key, shape)])))}"
        if full not in taken:
            out[fqn] = full
    return out
