"""Megatron-Core's ``content_metadata``: a dict describing what a checkpoint holds (Megatron-LM
records its distributed-optimizer format and similar flags in it, to choose how to load).

Megatron-Core 0.16 (``dist_checkpointing.save(..., content_metadata=...)``) stores it as the entry
``content_metadata`` of the state dict, so it lands in the common state (``common.pt``) next to
``iteration`` and ``args``; ``load_content_metadata(dir)`` reads it back from there. ckptd stores
it the same way (:func:`with_content_metadata`), so each library reads the other's; the caller's
dict is not changed (Megatron-Core adds the entry to it).
"""

from __future__ import annotations

from typing import Any

CONTENT_METADATA_KEY = "content_metadata"

# Megatron-Core drops these before saving (``_clean_metadata_for_serialization``): process groups
# that Megatron-LM keeps in the dict but that cannot be pickled.
_UNSAVED_KEYS = ("dp_cp_group",)


def with_content_metadata(state_dict: dict[str, Any], content_metadata: dict | None) -> dict[str, Any]:
    """``state_dict`` with ``content_metadata`` as its ``content_metadata`` entry (a new dict; the
    same dict when there is none)."""
    if content_metadata is None:
        return state_dict
    clean = {k: v for k, v in content_metadata.items() if k not in _UNSAVED_KEYS}
    return {**state_dict, CONTENT_METADATA_KEY: clean}
