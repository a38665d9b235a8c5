"""MoE legacy checkpoints of a real Megatron-Core GPTModel, converted by ``ckptd convert to-dist``
and checked against Megatron-Core's own torch_dist save of the same model.

The ranks build an MoE GPT on CPU (gloo) at TP=1 or 2 x EP=2 with SwiGLU experts, perturb its
parameters (expert weights differently on every TP and EP rank, the rest alike on every EP rank,
as Megatron keeps them), write each rank's legacy ``mp_rank_TT_EEE/model_optim_rng.pt`` (its
``state_dict()``) and save the model with ``dist_checkpointing.save``. Then:

- GroupedMLP (``moe_use_legacy_grouped_gemm``: ``experts.weight1``/``weight2``, all local experts
  of a layer in one transposed buffer): the converted experts equal the save's
  ``mlp.experts.experts.linear_fc{1,2}.weight`` bit for bit, and load into a GroupedMLP model at
  TP=1 x EP=1 through Megatron-Core's own ``dist_checkpointing.load`` (its factory merge);
- TEGroupedMLP (``experts.linear_fc1.weight<i>``; Transformer Engine is not installed here): a
  SequentialMLP model's legacy files with its experts under TEGroupedMLP's names (each local
  expert's linear holds what TE's GroupedLinear ``weight<i>`` holds), against the SequentialMLP
  save, which Megatron-Core documents as interchangeable with TEGroupedMLP's.

Without the fix the converter dropped every expert rank's grouped weights but rank 0's (TP=1),
or refused them as TP-split tensors no rule names (TP=2).
"""

from __future__ import annotations

import argparse
import os
import re
import zlib
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.convert import convert_legacy
from tools.harness.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
EXPERTS, LAYERS = 4, 2


def _build(tp: int, ep: int, grouped: bool):  # -> GPTModel (megatron-core is imported in ranks only)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe import grouped_gemm_util
    from megatron.core.transformer.transformer_config import TransformerConfig

    # GroupedMLP asserts the grouped_gemm kernels at construction; building and saving it needs none.
    grouped_gemm_util.grouped_gemm = object()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=16,
        num_attention_heads=4,
        use_cpu_initialization=True,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=8,
        moe_grouped_gemm=grouped,
        moe_token_dispatcher_type="allgather",  # the alltoall dispatcher makes CUDA streams
        gated_linear_unit=True,
        add_bias_linear=False,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=grouped, moe_use_legacy_grouped_gemm=grouped)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=32, max_sequence_length=8)


def _te_names(state: dict) -> dict:
    """SequentialMLP's ``experts.local_experts.<i>.linear_fc<n>.weight`` as TEGroupedMLP names them."""
    out = {}
    for k, v in state.items():
        m = re.match(r"^(.*\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$", k)
        if m:
            out[f"{m.group(1)}{m.group(3)}.{m.group(4)}{m.group(2)}"] = v
        elif not (".local_experts." in k and k.endswith("_extra_state")):
            out[k] = v
    return out


def _write(rank: int, world: int, root: str, grouped: bool) -> list[str]:
    tp_size = world // 2
    import torch.distributed as dist
    from megatron.core import dist_checkpointing as mdc
    from megatron.core import parallel_state as ps

    from tests.megatron_rank import megatron_save_on_cpu

    model = _build(tp=tp_size, ep=2, grouped=grouped)
    tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            seed = zlib.crc32(name.encode())
            if ".experts." in name:
                seed += 1000 * tp + 100_000 * ep
            elif getattr(p, "tensor_model_parallel", False):
                seed += 1000 * tp
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    state = model.state_dict()
    if not grouped:
        state = _te_names(state)
    rank_dir = Path(root, "legacy", "iter_0000005", f"mp_rank_{tp:02d}_{ep:03d}")
    rank_dir.mkdir(parents=True)
    args = argparse.Namespace(
        num_layers=LAYERS,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=2,
        num_experts=EXPERTS,
        swiglu=True,
    )
    torch.save(
        {"model": state, "args": args, "iteration": 5, "checkpoint_version": 3.0}, rank_dir / "model_optim_rng.pt"
    )
    megatron_save_on_cpu()
    if rank == 0:
        Path(root, "legacy", "latest_checkpointed_iteration.txt").write_text("5")
        os.makedirs(os.path.join(root, "mcore"))
    dist.barrier()
    mdc.save(model.sharded_state_dict(), os.path.join(root, "mcore"))
    dist.barrier()
    return sorted(state)


def _load_experts(rank: int, world: int, root: str) -> list[str]:
    """Megatron-Core's own load of the grouped experts at TP=1 x EP=1, from its save and from the
    conversion: the same tensors."""
    from megatron.core import dist_checkpointing as mdc

    model = _build(tp=1, ep=1, grouped=True)

    def experts_from(directory: str) -> dict:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        request = {k: v for k, v in model.sharded_state_dict().items() if ".experts.weight" in k}
        assert len(request) == 2 * LAYERS, sorted(request)
        return mdc.load(request, directory)

    reference = experts_from(os.path.join(root, "mcore"))
    converted = experts_from(os.path.join(root, "stacked"))
    bad = [k for k in reference if not torch.equal(reference[k], converted[k])]
    if any(float(t.abs().sum()) == 0 for t in reference.values()):
        bad.append("an expert tensor of the reference is all zeros")
    return bad


def _compare(reference: dict[str, torch.Tensor], converted: dict[str, torch.Tensor], stacked: bool) -> None:
    """Every converted tensor Megatron-Core's save names (per layer: its stacked tensor's slice)
    equals it; the experts and the router are among them."""
    compared = set()
    for key, value in converted.items():
        m = None if stacked else re.match(r"^decoder\.layers\.(\d+)\.(.*)$", key)
        ref_key = f"decoder.layers.{m.group(2)}" if m else key
        if ref_key not in reference:
            continue
        ref = reference[ref_key][int(m.group(1))] if m else reference[ref_key]
        assert ref.shape == value.shape and torch.equal(ref, value), key
        compared.add(ref_key)
    for name in ("experts.experts.linear_fc1.weight", "experts.experts.linear_fc2.weight", "router.weight"):
        assert f"decoder.layers.mlp.{name}" in compared, (name, sorted(converted))


@pytest.mark.timeout(450)
@pytest.mark.parametrize("tp", [1, 2], ids=["TP1xEP2", "TP2xEP2"])
@pytest.mark.parametrize("grouped", [True, False], ids=["GroupedMLP", "TEGroupedMLP-names"])
def test_grouped_experts_match_megatron_core_torch_dist(tmp_path: Path, grouped: bool, tp: int):
    names = run_ranks(_write, 2 * tp, str(tmp_path), grouped, timeout_s=240, daemon=False)
    assert any(".experts.weight1" in k if grouped else ".experts.linear_fc1.weight1" in k for k in names[0])
    reference = ckptd.load_plain_tensors(tmp_path / "mcore")
    assert reference["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (LAYERS, EXPERTS, 16, 16)
    for stacked in (True, False):
        out = tmp_path / ("stacked" if stacked else "per-layer")
        convert_legacy(tmp_path / "legacy", out, stack_layers=stacked, fsync=False)
        _compare(reference, ckptd.load_plain_tensors(out), stacked)
    if grouped:
        assert run_ranks(_load_experts, 1, str(tmp_path), timeout_s=180, daemon=False) == [[]]
