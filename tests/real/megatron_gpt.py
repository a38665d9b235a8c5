"""A real Megatron-Core GPTModel on CPU (gloo), its optimizer state as Megatron-Core builds it,
and helpers to compare loaded state dicts. Imported only inside spawned ranks (megatron-core is a
test dependency, and importing it changes torch's unpickling allow-list for the process).

The model builds on CPU with ``use_cpu_initialization=True`` and the local layer spec (no
Transformer Engine); its forward needs CUDA (RNG tracker), so instead of training, parameters
are perturbed and AdamW takes a step on seeded gradients, which fills its state.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.interop.reference import same_bits


def build_gpt(tp: int) -> Any:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32
    )


def adamw(model: Any) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # state to load into, as Megatron's init_state_fn makes it
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return opt


def train_a_little(model: Any, opt: torch.optim.Optimizer, seed: int) -> None:
    """Perturb every parameter and take one AdamW step on seeded gradients (no forward on CPU)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
            p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def sharded_state(model: Any, opt: torch.optim.Optimizer, iteration: int) -> dict:
    """Megatron-LM's checkpoint dict: model, optimizer state (Megatron-Core's
    optim_state_to_sharding_state over a torch optimizer, as its non-distributed optimizers
    build it) and common values."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_sd = model.sharded_state_dict()
    optim_sd = opt.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, list(model.parameters()))
    optim_state_to_sharding_state(optim_sd, id_map, exclude_keys=("step",))
    return {
        "model": model_sd,
        "optimizer": optim_sd,
        "iteration": iteration,
        "opt_step": 1,
        "args": {"num_layers": 2, "hidden_size": 64},
    }


def flat(x: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(x, dict):
        out: dict[str, Any] = {}
        for k, v in x.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out
    if isinstance(x, list):
        out = {}
        for i, v in enumerate(x):
            out.update(flat(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: x}


def differences(a: dict, b: dict, where: str) -> list[str]:
    """Keys whose values differ (tensors: dtype, shape and bits) between two loaded dicts."""
    fa, fb = flat(a), flat(b)
    bad = [f"{where}: keys only in one: {sorted(set(fa) ^ set(fb))[:5]}"] if set(fa) != set(fb) else []
    for k in sorted(set(fa) & set(fb)):
        va, vb = fa[k], fb[k]
        same = same_bits(va, vb) if isinstance(va, torch.Tensor) else va == vb
        if not same:
            bad.append(f"{where}: {k}")
    return bad
