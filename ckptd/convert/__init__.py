"""Checkpoint conversion: Megatron legacy trees to torch_dist, torch_dist to one state-dict file."""

from .consolidate import consolidate
from .legacy import ConversionReport, convert_legacy, discover
from .splitrules import DEFAULT_RULES, SplitRule

__all__ = ["convert_legacy", "consolidate", "discover", "SplitRule", "DEFAULT_RULES", "ConversionReport"]
