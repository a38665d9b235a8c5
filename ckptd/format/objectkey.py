"""The form of a ShardedObject shard's key, ``<key>/shard_<offsets>_<shape>`` (Megatron-Core's
``ShardedObject.unique_key``), without torch: the daemon checks a commit's objects by it."""

from __future__ import annotations


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
