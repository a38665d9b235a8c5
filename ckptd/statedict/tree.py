"""Nested state dicts as trees: paths, leaves, and placing values back.

A state dict is a tree of dicts and lists; everything else is a leaf (tuples too, unless a caller
asks to look into them). A *path* is the tuple of keys and list indices from the root to a value,
with the keys as they are (a dict keyed by ints keeps its ints).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Path = tuple[Any, ...]

_MISSING = object()


def iter_leaves(x: Any, path: Path = (), *, into_tuples: bool = False) -> Iterator[tuple[Path, Any]]:
    """Yield ``(path, leaf)`` for every non-container value (dicts, lists, and with
    ``into_tuples`` also tuples, are containers)."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from iter_leaves(v, path + (k,), into_tuples=into_tuples)
    elif isinstance(x, list) or (into_tuples and isinstance(x, tuple)):
        for i, v in enumerate(x):
            yield from iter_leaves(v, path + (i,), into_tuples=into_tuples)
    else:
        yield path, x


def set_path(root: Any, path: Path, value: Any, like: Any = None) -> None:
    """Set ``root[p0][p1]...``, creating the missing containers on the way.

    A missing container is of the type of the one at the same path in ``like`` (the request a
    load fills: a dict keyed by ints stays a dict, as Megatron-Core's ``merge`` keeps it); where
    ``like`` has none, a list when the next part is an int, else a dict. Lists grow with ``None``
    up to the index being set (a caller relies on that only where every position is set).
    Raises ValueError when a part does not fit the container found (a str index into a list, a
    leaf where a container is needed).
    """
    node = root
    shape = like
    for i, p in enumerate(path):
        last = i == len(path) - 1
        shape = _child(shape, p)
        if isinstance(node, list):
            if type(p) is not int or p < 0:
                raise ValueError(f"'{path_str(path[:i])}' is a list, which has no entry {p!r} for '{path_str(path)}'")
            while len(node) <= p:
                node.append(None)
            if last:
                node[p] = value
            else:
                if node[p] is None:
                    node[p] = _container(shape, path[i + 1])
                node = node[p]
        elif not isinstance(node, dict):
            raise ValueError(
                f"'{path_str(path[:i])}' holds a {type(node).__name__}, not a container for '{path_str(path)}'"
            )
        elif last:
            node[p] = value
        else:
            child = node.get(p)
            if child is None:  # absent, or a placeholder older ckptd versions left in common.pt
                child = node[p] = _container(shape, path[i + 1])
            elif not isinstance(child, (dict, list)):
                raise ValueError(
                    f"'{path_str(path[: i + 1])}' holds a {type(child).__name__}, "
                    f"not a container for '{path_str(path)}'"
                )
            node = child


def _child(shape: Any, p: Any) -> Any:
    """``shape[p]`` when ``shape`` is a container that has it, else None."""
    if isinstance(shape, dict):
        return shape.get(p)
    if isinstance(shape, list) and type(p) is int and 0 <= p < len(shape):
        return shape[p]
    return None


def _container(shape: Any, next_part: Any) -> dict | list:
    if isinstance(shape, dict):
        return {}
    if isinstance(shape, list):
        return []
    return [] if type(next_part) is int else {}


def get_path(root: Any, path: Path, default: Any = _MISSING) -> Any:
    """``root[p0][p1]...``, or ``default`` where the path does not exist (KeyError without one)."""
    node = root
    for p in path:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            if default is _MISSING:
                raise KeyError(path_str(path)) from None
            return default
    return node


def path_str(path: Path) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def dcp_fqn(path: Path) -> str:
    """torch DCP's flattened key of a path: its parts joined by dots (``flatten_state_dict``)."""
    return ".".join(map(str, path))


def map_leaves(x: Any, fn: Any, path: Path = ()) -> Any:
    """A copy of the dict/list structure of ``x`` with ``fn(path, leaf)`` in place of each leaf."""
    if isinstance(x, dict):
        return {k: map_leaves(v, fn, path + (k,)) for k, v in x.items()}
    if isinstance(x, list):
        return [map_leaves(v, fn, path + (i,)) for i, v in enumerate(x)]
    return fn(path, x)
