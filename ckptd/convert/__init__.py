"""Checkpoint conversion: Megatron legacy trees to torch_dist, torch_dist to one state-dict file."""

from .consolidate import consolidate
from .legacy import DEFAULT_RULES, ConversionReport, SplitRule, convert_legacy, discover

__all__ = ["convert_legacy", "consolidate", "discover", "SplitRule", "DEFAULT_RULES", "ConversionReport"]
