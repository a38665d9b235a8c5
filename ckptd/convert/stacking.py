"""Layer stacks of a legacy checkpoint (``decoder.layers.<i>.``, a vision tower's, an MTP
block's), and layers written stacked (``stack_layers``): one tensor per key of a layer stack, the
layer number a leading axis, as Megatron-Core's default torch_dist naming has them.

Such a tensor exists only where every layer of the stack holds the key with one dtype and shape.
Models whose layers differ (MoE layers after dense first layers, a feed-forward width that varies
by layer) have no such tensor: :func:`check_uniform_layers` says so before anything is written,
where the written chunks would otherwise fail to make whole tensors only when the checkpoint is
finalized, with an error about replicas and global shapes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..errors import ShardingError

LAYER = re.compile(r"(?<=layers\.)(\d+)(?=\.)")
STACK = re.compile(r"^(.*?layers)\.(\d+)\.(.*)$")
MTP = re.compile(r"(^|\.)mtp\.layers$")


def stack_of(key: str) -> str | None:
    """The layer stack ``key`` is in: what precedes its layer number (``decoder.layers.``); None
    outside one."""
    m = LAYER.search(key)
    return None if m is None else key[: m.start()]


def count_layers(keys: Sequence[str]) -> dict[str, int]:
    """Layers per stack: a pipeline stage can hold several (a vision tower's and a language
    model's, a multi-token prediction block's ``mtp.layers``), each numbered on its own."""
    found: dict[str, set[int]] = {}
    for k in keys:
        if (m := LAYER.search(k)) is not None:
            found.setdefault(k[: m.start()], set()).add(int(m.group(1)))
    return {stack: max(layers) + 1 for stack, layers in found.items()}


def stacked(key: str) -> re.Match[str] | None:
    """``key`` as a layer of a stack written stacked: groups (stack, layer, name in the layer).
    None outside a stack, and for a multi-token prediction block's ``mtp.layers.<i>``, which
    Megatron-Core never stacks (they keep their numbers)."""
    m = STACK.match(key)
    return None if m is None or MTP.search(m.group(1)) else m


def _spans(layers: Iterable[int]) -> str:
    """``layers 0-2, 5``, ``layer 3``: layer numbers as runs."""
    nums = sorted(layers)
    out: list[str] = []
    run: list[int] = []
    for i in nums:
        if run and i != run[-1] + 1:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        run.append(i)
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ("layer " if len(nums) == 1 else "layers ") + ", ".join(out)


def check_uniform_layers(
    chunks: Iterable[tuple[Mapping[str, Any], Mapping[str, int]]], num_layers: Mapping[str, int], where: str
) -> None:
    """Raise ShardingError naming the first stacked key that a layer of its stack lacks or holds
    in another dtype or shape. ``chunks``: each model chunk of each pipeline stage (TP rank 0's,
    expert rank 0's: the others are checked against them as they are converted) with the global
    first layer of each of its stacks (``decoder.layers.``); ``num_layers``: each stack's layers
    over all stages; ``where``: the legacy checkpoint, for the message."""
    held: dict[str, dict[int, str]] = {}  # stacked key -> layer -> "dtype shape"
    stack_by_name: dict[str, str] = {}
    for chunk, first_layer in chunks:
        for key, value in chunk.items():
            m = stacked(key) if isinstance(value, torch.Tensor) else None
            if m is None:
                continue  # outside the stacked layers, or not a tensor
            stack, name = m.group(1), f"{m.group(1)}.{m.group(3)}"
            layer = int(m.group(2)) + first_layer.get(f"{stack}.", 0)
            held.setdefault(name, {})[layer] = f"{value.dtype} {tuple(value.shape)}"
            stack_by_name[name] = stack
    for name, by_layer in sorted(held.items()):
        stack = stack_by_name[name]
        total = num_layers.get(f"{stack}.", 0)
        lacking = [i for i in range(total) if i not in by_layer]
        kinds: dict[str, list[int]] = {}
        for layer, kind in sorted(by_layer.items()):
            kinds.setdefault(kind, []).append(layer)
        if not lacking and len(kinds) == 1:
            continue
        problems = []
        if lacking:
            problems.append(f"{_spans(lacking)} {'lacks' if len(lacking) == 1 else 'lack'} it")
        if len(kinds) > 1:
            problems.append(
                "its layers differ in dtype or shape: "
                + "; ".join(f"{kind} in {_spans(ls)}" for kind, ls in kinds.items())
            )
        raise ShardingError(
            f"{where}: '{name}' cannot be stacked over the {total} layers of '{stack}' (stack_layers, "
            f"--stack-layers): {' and '.join(problems)}. The layers differ (as MoE layers after dense first "
            "layers do, or feed-forward widths that vary by layer), so no one tensor with a leading "
            "layer axis holds it. Convert without --stack-layers: each layer keeps its own keys "
            f"('{stack}.<i>.{name[len(stack) + 1 :]}'; with --mcore-spec, as Megatron-Core's "
            "sharded_state_dict(metadata={'non_homogeneous_layers': True}) asks for them)"
        )
