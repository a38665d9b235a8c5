"""torch DCP's ``Stateful`` objects at the top of a state dict, handled as ``dcp.save``/``dcp.load`` do.

A ``Stateful`` (``torch.distributed.checkpoint.stateful.Stateful``: anything with
``state_dict()`` and ``load_state_dict()``, e.g. TorchTitan's ModelWrapper, OptimizersContainer,
TrainState and dataloader, or a plain ``nn.Module`` or optimizer) that is a value of the top-level
dict is saved as what its ``state_dict()`` returns when the save is called (an asynchronous save
snapshots that returned dict). A load calls ``state_dict()`` to get the dict to fill, loads into
it, then calls ``load_state_dict()`` with the loaded dict on the live object. As in DCP, only
top-level values count; the checkpoint holds nothing that names the object's class, so DCP loads
it into its own Stateful objects and ckptd loads DCP's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful


def stateful_keys(state_dict: Any) -> list[Any]:
    """Top-level keys whose values are Stateful objects."""
    if not isinstance(state_dict, dict):
        return []
    return [k for k, v in state_dict.items() if isinstance(v, Stateful)]


def expand_stateful(state_dict: Any) -> Any:
    """``state_dict`` with each top-level Stateful replaced by its ``state_dict()`` (a shallow
    copy; ``state_dict`` itself when it holds none)."""
    keys = stateful_keys(state_dict)
    if not keys:
        return state_dict
    return {k: v.state_dict() if k in keys else v for k, v in state_dict.items()}


def load_stateful(state_dict: Any, load: Callable[[Any], Any]) -> Any:
    """``load(request)`` where ``request`` has each top-level Stateful's ``state_dict()`` in its
    place; then each Stateful's ``load_state_dict()`` is called with what was loaded for it.

    The result is ``load``'s with the Stateful objects back at their keys; when ``load`` filled
    the request in place (DCP-style), the caller's dict is filled likewise (its other top-level
    values replaced by the loaded ones, as ``dcp.load`` does) and returned. A ``load`` that
    returns ``(state_dict, missing, unexpected)`` gets the same treatment of its first element.
    """
    keys = stateful_keys(state_dict)
    if not keys:
        return load(state_dict)
    request = expand_stateful(state_dict)
    out = load(request)
    result = out[0] if isinstance(out, tuple) else out
    for k in keys:
        state_dict[k].load_state_dict(result[k])
    if result is request:
        for k, v in request.items():
            if k not in keys:
                state_dict[k] = v
        result = state_dict
    else:
        for k in keys:
            result[k] = state_dict[k]
    return (result, *out[1:]) if isinstance(out, tuple) else result
