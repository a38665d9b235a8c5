"""The training-side API of asynchronous saves: :class:`Checkpointer` and :class:`SaveHandle`.

Imported on first use (PEP 562), so that ``ckptd.client.admin`` (``ckptd status``, ``ckptd daemon
stop``) does not import torch with the Checkpointer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .handle import SaveHandle, SaveStatus

_LAZY = {"Checkpointer": ".checkpointer", "SaveHandle": ".handle", "SaveStatus": ".handle"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptd.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = ["Checkpointer", "SaveHandle", "SaveStatus"]
