"""A legacy tensor's tensor-parallel shards as chunks of its global tensor, as its :class:`SplitRule`
says (ckptd.convert.splitrules): each shard at its offset along the rule's axis, a gated linear
unit's ``[gate_r; up_r]`` shards as the halves of ``[gate; up]``, and a tensor no rule splits
written once, after checking that every TP rank holds the same. Nothing is copied: the chunks
are the shards, or views of them.
"""

from __future__ import annotations

import logging

import torch

from ..errors import ShardingError
from .splitrules import BUILT_IN_RULES, SplitRule

log = logging.getLogger("ckptd.convert")


def tp_chunks(
    key: str, shards: list[torch.Tensor], rule: SplitRule | None, fc1: tuple[bool | None] | None = None
) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """``(payload, global offsets)`` of each chunk of ``key`` that its TP ``shards`` (by TP rank)
    make, split as ``rule`` says (None: no rule names it); ShardingError unless the shards fit it.
    ``fc1``: for an MLP's fc1 ``key``, whether it is a gated linear unit's, as its width says
    (None: neither; :func:`.experts.mlp_glu`)."""
    t0 = shards[0]
    for r, t in enumerate(shards[1:], 1):
        if t.dtype != t0.dtype or t.shape != t0.shape:
            raise ShardingError(
                f"'{key}': TP rank {r} holds {t.dtype} {tuple(t.shape)} but rank 0 holds "
                f"{t0.dtype} {tuple(t0.shape)}; legacy TP shards must have equal shapes"
            )
    glu = None if fc1 is None else fc1[0]
    if fc1 is not None and glu is None and len(shards) > 1 and (rule is None or rule in BUILT_IN_RULES):
        raise ShardingError(
            f"'{key}' is an MLP's fc1 whose width is neither its fc2's ffn (an MLP's) nor twice it (a gated "
            "linear unit's [gate; up]), so how it is split over tensor-parallel ranks is unknown; give a "
            "split rule for it (--split 'REGEX=AXIS' or 'REGEX=glu:AXIS')"
        )
    if glu is not None and rule is not None and rule.axis is not None and rule.glu != glu:
        if rule not in BUILT_IN_RULES:
            raise ShardingError(
                f"'{key}' is {'' if glu else 'not '}a gated linear unit's [gate; up] (its width is "
                f"{'twice' if glu else 'that of'} its fc2's ffn), but the split rule '{rule.pattern}' says "
                f"{'it is not' if glu else 'it is'}; fix the rule"
            )
        log.info("'%s' is %sa gated linear unit's fc1, as its width says: split as such", key, "" if glu else "not ")
        rule = SplitRule(rule.pattern, rule.axis, glu=glu)
    n = len(shards)
    if n == 1 or rule is None or rule.axis is None:
        if n > 1 and not all(torch.equal(t0, t) for t in shards[1:]):
            raise ShardingError(
                f"'{key}' differs across tensor-parallel ranks, but "
                + ("its split rule says replicated" if rule else "no split rule matches it")
                + "; add a rule (SplitRule / --split 'REGEX=AXIS') saying along which axis it "
                "is split"
            )
        return [(t0, (0,) * t0.dim())]
    axis = rule.axis
    if not 0 <= axis < t0.dim():
        raise ShardingError(f"'{key}' has shape {tuple(t0.shape)}; split rule axis {axis} does not exist")
    local = t0.shape[axis]
    out = []
    if rule.glu:
        if local % 2:
            raise ShardingError(f"'{key}': a GLU shard needs an even extent on axis {axis}, got {local}")
        half = local // 2
        for r, t in enumerate(shards):
            for part, base in ((0, 0), (1, n * half)):
                piece = t.narrow(axis, part * half, half)
                offs = [0] * t0.dim()
                offs[axis] = base + r * half
                out.append((piece, tuple(offs)))
        return out
    for r, t in enumerate(shards):
        offs = [0] * t0.dim()
        offs[axis] = r * local
        out.append((t, tuple(offs)))
    return out


def global_shape(shards: list[torch.Tensor], rule: SplitRule | None) -> list[int]:
    """The global shape of a tensor of TP ``shards`` split as ``rule`` says (see :func:`tp_chunks`)."""
    gshape = list(shards[0].shape)
    if len(shards) > 1 and rule is not None and rule.axis is not None:
        gshape[rule.axis] *= len(shards)
    return gshape
