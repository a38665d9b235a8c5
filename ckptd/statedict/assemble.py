"""Putting a load's values back together, per dialect (see :mod:`ckptd.statedict.split`)."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import LoadMismatchError
from ..mapping import ShardedObject, ShardedTensor
from .split import FACTORY_PART, Dialect, SplitStateDict
from .tree import Path, map_leaves, set_path

log = logging.getLogger(__name__)


def assemble(split: SplitStateDict, request: dict, common: Any, loaded: dict[Path, Any]) -> Any:
    """The result of a load.

    Megatron-style: the stored common state with the loaded entries, the merged factories and the
    unwrapped local objects put in at their paths (a new dict, as Megatron-Core returns).
    DCP-style: ``request`` itself, with every loaded value set at its path (tensors were filled in
    place, so they are the caller's own objects), as ``torch.distributed.checkpoint.load`` does.
    Containers the common state lacks are made like the request's (a dict keyed by ints stays a
    dict, as in Megatron-Core's result).
    """
    result = request if split.dialect is Dialect.DCP else (common if isinstance(common, dict) else {})
    try:
        for path, value in loaded.items():
            if FACTORY_PART not in path:
                set_path(result, path, value, request)
        for path, (factory, built) in split.factories.items():
            skipped: list[str] = []

            def fill(
                sub_path: Path, leaf: Any, _prefix: Path = path + (FACTORY_PART,), _skipped: list[str] = skipped
            ) -> Any:
                got = loaded.get(_prefix + sub_path, leaf)
                if got is leaf and isinstance(leaf, (ShardedTensor, ShardedObject)):
                    _skipped.append(getattr(leaf, "key", "?"))
                return got

            pieces = map_leaves(built, fill) if isinstance(built, (dict, list)) else fill((), built)
            if skipped:
                # A non-raising strict mode skipped pieces the checkpoint lacks: merging would hand
                # merge_fn the unfilled templates in their place (a TypeError naming nothing, or,
                # from a tolerant merge_fn, a template object in the result). Left out as a whole.
                log.warning(
                    "the factory '%s' was not loaded: the checkpoint lacks its piece(s) %s",
                    factory.key,
                    sorted(set(skipped))[:8],
                )
                continue
            set_path(result, path, factory.merge_fn(pieces), request)
        for path, value in split.local.items():
            set_path(result, path, value, request)
    except ValueError as exc:
        raise LoadMismatchError(
            f"the loaded entries do not fit the checkpoint's common state: {exc}. The request's "
            "structure differs from the one saved; request the saved structure"
        ) from exc
    return result
