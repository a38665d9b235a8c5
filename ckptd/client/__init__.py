"""The training-side API of asynchronous saves: :class:`Checkpointer` and :class:`SaveHandle`."""

from .checkpointer import Checkpointer
from .handle import SaveHandle, SaveStatus

__all__ = ["Checkpointer", "SaveHandle", "SaveStatus"]
