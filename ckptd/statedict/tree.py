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


def set_path(root: Any, path: Path, value: Any) -> None:
    """Set ``root[p0][p1]...`` creating dicts (and lists, for int keys after a list) on the way.

    Lists grow with ``None`` up to the index being set; a caller only relies on that where every
    position of the list is set (see :func:`ckptd.statedict.split.check_lists_restorable`).
    """
    node = root
    for i, p in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            while len(node) <= p:
                node.append(None)
            if last:
                node[p] = value
            else:
                if node[p] is None:
                    node[p] = [] if isinstance(path[i + 1], int) else {}
                node = node[p]
        elif last:
            node[p] = value
        else:
            child = node.get(p)
            if child is None:  # absent, or a placeholder older ckptd versions left in common.pt
                child = node[p] = [] if isinstance(path[i + 1], int) else {}
            elif not isinstance(child, (dict, list)):
                raise ValueError(
                    f"'{path_str(path[: i + 1])}' holds a {type(child).__name__}, "
                    f"not a container for '{path_str(path)}'"
                )
            node = child


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
