"""Megatron-Core's DistributedOptimizer on CPU (gloo), for its ``dp_reshardable`` sharded state.

Megatron-Core 0.16's distributed optimizer expects CUDA: it allocates a few tensors with
``device='cuda'`` and checks ``param.type()`` for ``torch.cuda.*Tensor``. :func:`cpu_shims` makes
it run on CPU in a spawned rank (never in the test runner): those allocations go to the CPU and
``Tensor.type()`` reports the CUDA names. Nothing of the state layout changes: the sharded state
dict is Megatron-Core's own, ``{"param_state": {0: {(dtype, dtype): [[{"param": ShardedTensor,
...}]]}, "per_bucket_numel": ShardedObject, ...}, ...}`` with int, str and tuple dict keys.
Imported only inside spawned ranks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tests.megatron_rank import megatron_save_on_cpu

SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def cpu_shims() -> None:
    def on_cpu(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return wrapped

    for name in ("tensor", "zeros", "empty", "ones", "full", "zeros_like", "empty_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    tensor_type = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = tensor_type(self, *args, **kwargs)
        return out.replace("torch.", "torch.cuda.", 1) if not args and not kwargs and isinstance(out, str) else out

    torch.Tensor.type = cuda_type  # type: ignore[method-assign]
    megatron_save_on_cpu()
    torch.cuda.is_available = lambda: False


def build(seed: int) -> tuple[Any, Any, Any]:
    """``(ddp model, chained optimizer, its DistributedOptimizer)``: a 2-layer GPT, data-parallel
    over every rank, with Adam state filled from ``seed`` and the rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32
    )
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=4000), model
    )
    chained = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, bf16=False, fp16=False), [ddp]
    )
    optimizer = chained.chained_optimizers[0]
    fill(optimizer, torch.Generator().manual_seed(seed * 100 + dist.get_rank()))
    return ddp, chained, optimizer


def fill(optimizer: Any, gen: torch.Generator | None) -> None:
    """Allocate the optimizer's state as Megatron-Core does before a load, then fill its main
    parameters and moments from ``gen`` (zeros without one)."""
    optimizer._init_optimizer_states_with_dummy_values()
    with torch.no_grad():
        for param, state in optimizer.optimizer.state.items():
            for name, t in [("param", param), *state.items()]:
                if name != "step":
                    t.copy_(torch.randn(t.shape, generator=gen) if gen is not None else torch.zeros(t.shape))


def state(ddp: Any, chained: Any, *, loading: bool = False) -> dict:
    """Megatron-LM's checkpoint dict with the ``dp_reshardable`` optimizer state."""
    model_sd = ddp.sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": chained.sharded_state_dict(model_sd, is_loading=loading, metadata=SHARDING),
        "iteration": 5,
    }


def snapshot(optimizer: Any) -> list[torch.Tensor]:
    """Every main parameter and Adam moment of the rank, in order. Not Adam's ``step``: every
    allocation of the state before a load takes a dummy optimizer step, and the dp_reshardable
    format keeps ``step`` out of the checkpoint (a LocalNonpersistentObject)."""
    out = []
    for param, state_ in optimizer.optimizer.state.items():
        out.append(param.detach().clone())
        out += [state_[k].clone() for k in sorted(state_) if k != "step"]
    return out
