"""``gc_paused`` for the Checkpointer (it lives in :mod:`ckptd.gcpause`, which the daemon uses too)."""

from __future__ import annotations

from ..gcpause import gc_paused

__all__ = ["gc_paused"]
