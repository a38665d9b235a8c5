"""Walking nested sharded state dicts: apply factories, split sharded / common / local entries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .mapping import LocalNonPersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory

Path = tuple[Any, ...]

_DROP = object()


def _map(x: Any, fn: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """Rebuild nested dicts/lists with ``fn`` applied to leaves.

    A leaf mapped to _DROP is removed from dicts and replaced by None in lists.
    """
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            r = _map(v, fn, path + (k,))
            if r is not _DROP:
                out[k] = r
        return out
    if isinstance(x, list):
        # Keep list positions stable: a removed entry leaves None so later indices still match.
        return [
            None if (r := _map(v, fn, path + (i,))) is _DROP else r for i, v in enumerate(x)
        ]
    return fn(path, x)


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
    """Set ``root[p0][p1]...`` creating dicts on the way (lists must exist)."""
    node = root
    for i, p in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            # Sharded entries were removed from lists when splitting; put them back in place.
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
            node = node.setdefault(p, [] if isinstance(path[i + 1], int) else {})


def path_str(path: Path) -> str:
    return ".".join(str(p) for p in path) or "<root>"


@dataclass
class SplitStateDict:
    """A sharded state dict taken apart by role.

    ``sharded`` maps each leaf path to its ShardedTensor/ShardedObject; ``common`` is the nested
    structure of plain values; ``local`` holds unwrapped LocalNonPersistentObjects by path;
    ``factories`` remembers factories (by path) so that load can merge their pieces.
    """

    sharded: dict[Path, ShardedTensor | ShardedObject] = field(default_factory=dict)
    common: Any = field(default_factory=dict)
    local: dict[Path, Any] = field(default_factory=dict)
    factories: dict[Path, tuple[ShardedTensorFactory, Any]] = field(default_factory=dict)


def split_state_dict(sharded_state_dict: Any) -> SplitStateDict:
    """Apply factories and separate sharded, common and local-non-persistent entries."""
    out = SplitStateDict()

    def visit(path: Path, leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensorFactory):
            built = leaf.build()
            out.factories[path] = (leaf, built)
            for sub_path, sub in iter_leaves(built):
                full = path + ("__factory__",) + sub_path
                if isinstance(sub, (ShardedTensor, ShardedObject)):
                    out.sharded[full] = sub
            return _DROP
        if isinstance(leaf, (ShardedTensor, ShardedObject)):
            out.sharded[path] = leaf
            return _DROP
        if isinstance(leaf, LocalNonPersistentObject):
            out.local[path] = leaf.unwrap()
            return _DROP
        return leaf

    out.common = _map(sharded_state_dict, visit)
    return out


def assemble(split: SplitStateDict, common: Any, loaded: dict[Path, Any]) -> Any:
    """Build the loaded state dict: the stored common state, plus sharded and local values.

    Factory pieces (paths containing ``__factory__``) are merged with the factory's merge_fn.
    """
    result = common if isinstance(common, dict) else {}
    for path, value in loaded.items():
        if "__factory__" not in path:
            set_path(result, path, value)
    for path, (factory, built) in split.factories.items():
        def fill(sub_path: Path, leaf: Any, _prefix: Path = path) -> Any:
            return loaded.get(_prefix + ("__factory__",) + sub_path, leaf)

        pieces = _map(built, fill)
        set_path(result, path, factory.merge_fn(pieces))
    for path, value in split.local.items():
        set_path(result, path, value)
    return result
