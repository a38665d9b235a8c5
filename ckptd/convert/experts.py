"""MoE expert weights in a legacy tree: which keys an expert-parallel (EP) rank holds for its own
experts, and how the grouped-GEMM ones become what Megatron-Core stores for them.

A legacy rank file holds its module's ``state_dict()``; Megatron-Core (0.16,
``transformer/moe/experts.py``, ``extensions/transformer_engine.py``) knows three expert modules:

- ``SequentialMLP``: ``...mlp.experts.local_experts.<i>.linear_fc{1,2}.*``, one MLP per local
  expert; legacy.py keeps these names, ``<i>`` renumbered to the global expert.
- ``TEGroupedMLP``: ``...mlp.experts.linear_fc{1,2}.{weight,bias}<i>``, Transformer Engine's
  GroupedLinear parameters, one per local expert, each shaped as a SequentialMLP expert's linear.
- ``GroupedMLP`` (the legacy grouped GEMM): ``...mlp.experts.weight1``, 2-D (hidden, local experts
  x fc1 width), and ``weight2`` (local experts x ffn, hidden). Their memory is
  (local experts, hidden, fc1 width) and (local experts, ffn, hidden): the forward views them so.

The grouped modules' own names cannot be reassembled into global tensors: GroupedMLP's TP and EP
shards are not rectangular blocks of the EP=1 parameter, and one name per local expert says nothing
of the global one. They are written as Megatron-Core's ``sharded_state_dict()`` stores all three
modules (interchangeably: a torch_dist checkpoint loads into any of them, at any EP):
``...mlp.experts.experts.linear_fc1.weight`` of global shape (experts, fc1 width, hidden),
``linear_fc2.weight`` (experts, hidden, ffn), biases (experts, width); local expert ``i`` of EP
rank ``r`` is expert ``r * local + i``; each expert is split over TP as a SequentialMLP expert's
linear is (fc1 on axis 0, ``[gate; up]`` halves with GLU, fc2 on axis 1, fc2's bias replicated),
which legacy.py's split rules do once the expert is named ``...linear_fc<n>.<param>``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import ShardingError

_TE_GROUPED = re.compile(r"^(.*(?:^|\.)experts\.)linear_fc([12])\.(weight|bias)(\d+)$")
_GROUPED_MLP = re.compile(r"^(.*(?:^|\.)experts\.)weight([12])$")
#: Inside an MoE layer's experts module (``shared_experts.`` is a name of its own: not matched).
_EXPERT_SCOPE = re.compile(r"(?:^|\.)experts\.")
KNOWN = (
    "SequentialMLP's experts.local_experts.<i>.*, TEGroupedMLP's experts.linear_fc1|2.weight<i>|bias<i>, "
    "GroupedMLP's experts.weight1|2"
)
MEGATRON_CONVERT = (
    "Convert it with Megatron-LM instead: run its training script on the legacy checkpoint with "
    "--ckpt-format torch --ckpt-convert-format torch_dist --ckpt-convert-save NEW_DIR"
)


@dataclass(frozen=True)
class GroupedKey:
    """A grouped-GEMM expert parameter: ``local`` is TEGroupedMLP's gemm (local expert) index,
    None for GroupedMLP's tensor of all local experts."""

    prefix: str  # up to and including the experts module's "experts."
    fc: int  # 1 or 2
    param: str  # "weight" or "bias"
    local: int | None

    @property
    def target(self) -> str:
        """Megatron-Core's name for the expert-stacked tensor (before the layers are renumbered)."""
        return f"{self.prefix}experts.linear_fc{self.fc}.{self.param}"


def grouped_key(key: str) -> GroupedKey | None:
    if m := _TE_GROUPED.match(key):
        return GroupedKey(m.group(1), int(m.group(2)), m.group(3), int(m.group(4)))
    if m := _GROUPED_MLP.match(key):
        return GroupedKey(m.group(1), int(m.group(2)), "weight", None)
    return None


def in_experts(key: str) -> bool:
    """Whether ``key`` belongs to an MoE layer's experts module (whose tensors differ per EP rank)."""
    return _EXPERT_SCOPE.search(key) is not None


def te_local_experts(keys: Iterable[str]) -> int:
    """How many local experts TEGroupedMLP's ``linear_fc<n>.<param><i>`` name (0: none)."""
    found = {g.local for k in keys if (g := grouped_key(k)) is not None and g.local is not None}
    return max(found) + 1 if found else 0


def per_expert(g: GroupedKey, t: torch.Tensor, num_local: int, where: str) -> list[torch.Tensor]:
    """One TP rank's tensor of ``g`` as its local experts' tensors, each shaped as a SequentialMLP
    expert's (fc1: (width, hidden), fc2: (hidden, ffn)); views, nothing is copied."""
    if g.local is not None:
        return [t]
    if t.dim() != 2 or num_local < 1 or t.shape[1 if g.fc == 1 else 0] % num_local:
        raise ShardingError(
            f"{where}: GroupedMLP's '{g.prefix}weight{g.fc}' has shape {tuple(t.shape)}, which does not "
            f"hold {num_local} local experts (args.num_experts / expert-parallel size)"
        )
    if g.fc == 1:  # (hidden, local * width), memory (local, hidden, width)
        hidden, width = t.shape[0], t.shape[1] // num_local
        return list(t.reshape(num_local, hidden, width).transpose(1, 2))
    ffn, hidden = t.shape[0] // num_local, t.shape[1]  # (local * ffn, hidden), memory (local, ffn, hidden)
    return list(t.reshape(num_local, ffn, hidden).transpose(1, 2))


def check_glu(chunk: dict[str, object], glu: bool, where: str) -> None:
    """With TP > 1, a wrong GLU setting silently interleaves gate and up rows: each fc1 of a grouped
    module must be twice (GLU) or once its fc2's ffn width."""
    for key, value in chunk.items():
        g = grouped_key(key)
        if g is None or g.fc != 1 or g.param != "weight" or not isinstance(value, torch.Tensor) or value.dim() != 2:
            continue  # (per_expert refuses a GroupedMLP weight that is not 2-D)
        if g.local is None:
            fc2, fc1_width, axis = f"{g.prefix}weight2", value.shape[1], 0
        else:
            fc2, fc1_width, axis = f"{g.prefix}linear_fc2.weight{g.local}", value.shape[0], 1
        other = chunk.get(fc2)
        if not isinstance(other, torch.Tensor) or other.dim() != 2:
            raise ShardingError(f"{where}: '{key}' has no matching 2-D '{fc2}'; the experts module is incomplete")
        if fc1_width != (2 if glu else 1) * other.shape[axis]:
            raise ShardingError(
                f"{where}: '{key}' is {fc1_width} wide for an ffn of {other.shape[axis]} ('{fc2}'), "
                f"which is {'not ' if glu else ''}a gated linear unit's [gate; up] though the conversion "
                f"{'assumes' if glu else 'does not assume'} one; pass {'--no-glu' if glu else '--glu'} "
                f"(glu={not glu})"
            )


_DENSE_FC1 = re.compile(r"\.(linear_fc1|dense_h_to_4h)\.(weight|bias)$")
_FC2_OF = {"linear_fc1": "linear_fc2", "dense_h_to_4h": "dense_4h_to_h"}


def mlp_glu(chunk: dict[str, object]) -> dict[str, bool | None]:
    """``{fc1 key: whether it is a gated linear unit's [gate; up]}`` for each MLP's fc1 (weight or
    bias; not a grouped module's, see :func:`check_glu`) whose fc2 weight is in ``chunk``: its
    width (rows) is twice its fc2's ffn width (columns) for GLU, as wide otherwise, per TP rank
    (None: neither). Decided per MLP: one model can hold both (a SwiGLU language model's and a
    GELU vision tower's ``linear_fc1``), and args that do not say ``swiglu`` split a GLU wrong
    otherwise."""
    out: dict[str, bool | None] = {}
    for key, value in chunk.items():
        m = _DENSE_FC1.search(key)
        if m is None or grouped_key(key) is not None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        fc2 = f"{key[: m.start()]}.{_FC2_OF[m.group(1)]}.weight"
        other = chunk.get(fc2)
        if not isinstance(other, torch.Tensor) or other.dim() != 2 or other.shape[1] == 0:
            continue
        width, ffn = value.shape[0], other.shape[1]
        out[key] = None if width not in (ffn, 2 * ffn) else width == 2 * ffn
    return out
