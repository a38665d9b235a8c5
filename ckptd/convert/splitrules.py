"""How a legacy tree's tensors are split over tensor-parallel ranks: :class:`SplitRule` (regex ->
axis), the built-in rules for Megatron-Core's and Megatron-LM's names, and the GLU rule."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ShardingError


@dataclass(frozen=True)
class SplitRule:
    """Tensors whose key matches ``pattern`` (``re.search``) are split on ``axis`` over TP ranks.

    ``axis=None``: replicated (checked identical). ``glu=True``: each rank's shard is
    ``[gate_r; up_r]`` along ``axis`` (SwiGLU ``linear_fc1``); the global tensor is
    ``[gate; up]``.
    """

    pattern: str
    axis: int | None
    glu: bool = False

    @classmethod
    def parse(cls, text: str) -> SplitRule:
        """``REGEX=AXIS``, ``REGEX=replicated`` or ``REGEX=glu:AXIS`` (command-line form)."""
        pattern, sep, spec = text.rpartition("=")
        if not sep or not pattern:
            raise ShardingError(f"split rule {text!r} is not REGEX=AXIS|replicated|glu:AXIS")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ShardingError(f"split rule {text!r}: {pattern!r} is not a regular expression ({exc})") from None
        try:
            if spec == "replicated":
                return cls(pattern, None)
            if spec.startswith("glu:"):
                return cls(pattern, int(spec[4:]), glu=True)
            return cls(pattern, int(spec))
        except ValueError:
            raise ShardingError(f"split rule {text!r}: axis {spec!r} is not an integer") from None


#: Megatron-Core GPT names first, then legacy (``language_model.*``) names.
DEFAULT_RULES: tuple[SplitRule, ...] = (
    SplitRule(r"(^|\.)word_embeddings\.weight$", 0),
    SplitRule(r"(^|\.)output_layer\.weight$", 0),
    SplitRule(r"\.linear_qkv\.(weight|bias)$", 0),
    SplitRule(r"\.linear_q\.(weight|bias)$", 0),
    SplitRule(r"\.linear_kv\.(weight|bias)$", 0),
    SplitRule(r"\.linear_fc1\.(weight|bias)$", 0),
    SplitRule(r"\.linear_proj\.weight$", 1),
    SplitRule(r"\.linear_fc2\.weight$", 1),
    SplitRule(r"\.query_key_value\.(weight|bias)$", 0),
    SplitRule(r"\.dense_h_to_4h\.(weight|bias)$", 0),
    SplitRule(r"\.self_attention\.dense\.weight$", 1),
    SplitRule(r"\.dense_4h_to_h\.weight$", 1),
)
#: With ``glu`` (args ``swiglu``/``gated_linear_unit``). Grouped experts are named
#: ``...experts.experts.linear_fc1.weight`` by then (.experts). Megatron-LM's own name of the same
#: tensor, ``...mlp.dense_h_to_4h``, holds ``[gate_r; up_r]`` too. An MLP's fc1 is split as its
#: width says, whichever of these rules matches it (:func:`.experts.mlp_glu`).
GLU_RULE = SplitRule(r"\.(linear_fc1|dense_h_to_4h)\.(weight|bias)$", 0, glu=True)
BUILT_IN_RULES = frozenset((*DEFAULT_RULES, GLU_RULE))

__all__ = ["BUILT_IN_RULES", "DEFAULT_RULES", "GLU_RULE", "SplitRule"]
