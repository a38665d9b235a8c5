"""Megatron-Core GPT names for a converted legacy checkpoint (``convert_legacy(mcore_spec=...)``).

A legacy (``torch.save``) checkpoint of a Megatron-Core ``GPTModel`` holds its ``state_dict()``:
module names. Its torch_dist checkpoint holds what ``GPTModel.sharded_state_dict()`` asks for,
which differs in three ways this module reproduces (megatron-core 0.16,
``models/gpt/gpt_layer_specs.py`` and ``transformer/transformer_layer.py``):

- each layer spec renames some keys (``TransformerLayerSubmodules.sharded_state_dict_keys_map``):
  ``get_gpt_layer_local_spec()`` stores its separate layernorms under the names the
  Transformer Engine spec's fused ``LayerNormLinear`` modules have, so that both specs read one
  checkpoint; the TE spec maps only its op-fuser MLP names (``mlp.0.weight``...);
- every ``_extra_state`` (None for local modules, a ``BytesIO`` of FP8 metadata for TE ones) is a
  ShardedObject ``<key>/shard_<layer>_<num_layers>`` (layers stacked) or
  ``<key>/shard_0_1``, replicated over TP (TP rank 0's is stored);
- ``output_layer._extra_state`` is dropped (``GPTModel.sharded_state_dict`` pops it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import ShardingError

SPECS = ("local", "te")
EXTRA_STATE = "_extra_state"
_LAYER_PREFIX = re.compile(r"^(.*?layers\.\d+\.)(.*)$")
_MTP_LAYER = re.compile(r"(^|\.)mtp\.layers\.\d+\.$")
_MTP_INNER = "transformer_layer."
_MLA = re.compile(r"\.self_attention\.linear_kv_down_proj\.")
_LOCAL_MAP = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)
_TE_MAP = (
    ("mlp.0.weight", "mlp.linear_fc1.layer_norm_weight"),
    ("mlp.0.bias", "mlp.linear_fc1.layer_norm_bias"),
    ("mlp.1.basic_ops.0.weight", "mlp.linear_fc1.weight"),
    ("mlp.1.basic_ops.1.bias", "mlp.linear_fc1.bias"),
    ("mlp.3.basic_ops.0.weight", "mlp.linear_fc2.weight"),
    ("mlp.3.basic_ops.1.bias", "mlp.linear_fc2.bias"),
)
#: Extra states GPTModel leaves out of its sharded state dict.
DROPPED_EXTRA_STATE = re.compile(r"(^|\.)output_layer\._extra_state$")


def check_spec(spec: str) -> str:
    if spec not in (*SPECS, "auto"):
        raise ShardingError(f"mcore_spec {spec!r} is not one of 'local', 'te', 'auto'")
    return spec


def detect_spec(keys: Iterable[str], where: str) -> str:
    """The layer spec that wrote a model state dict, from its keys: the local spec has separate
    ``input_layernorm`` modules, the TE spec fuses them into ``linear_qkv.layer_norm_weight``."""
    keys = list(keys)
    local = any(".input_layernorm." in k for k in keys)
    te = any(k.endswith(".linear_qkv.layer_norm_weight") for k in keys)
    if local != te:
        return "local" if local else "te"
    raise ShardingError(
        f"{where}: cannot tell which Megatron-Core layer spec wrote the checkpoint (its layers "
        f"have {'both' if local else 'neither'} 'input_layernorm.*' and "
        f"'linear_qkv.layer_norm_weight'); pass mcore_spec='local' or 'te' (--mcore-spec)"
    )


def check_convertible(keys: Iterable[str], where: str) -> None:
    """Refuse what this conversion does not name as Megatron-Core does, naming a key."""
    for k in keys:
        if k.startswith("language_model."):
            raise ShardingError(
                f"{where}: '{k}' is a pre-Megatron-Core (legacy GPT) name; Megatron-Core models name "
                "their state differently, and ckptd does not rename it. Convert without "
                "--mcore-spec (and map keys at load, ckptd.load(key_map=...)) or with Megatron-LM's "
                "tools/checkpoint converter"
            )
        if ".local_experts." in k or ".experts." in k:
            raise ShardingError(
                f"{where}: '{k}' is an MoE expert weight; --mcore-spec does not convert MoE models "
                "(Megatron-Core stores experts with an expert axis). Convert without --mcore-spec"
            )


def key_map(spec: str, keys: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """The spec's layer key map (``get_gpt_layer_local_spec(multi_latent_attention=True)`` has
    none)."""
    if spec == "te":
        return _TE_MAP
    return () if any(_MLA.search(k) for k in keys) else _LOCAL_MAP


def mcore_key(mapping: tuple[tuple[str, str], ...], key: str) -> str:
    """``key`` renamed as the layer's ``sharded_state_dict`` renames it (the first matching
    prefix of its name inside the layer)."""
    m = _LAYER_PREFIX.match(key)
    if not m:
        return key
    prefix, rest = m.groups()
    if _MTP_LAYER.search(prefix) and rest.startswith(_MTP_INNER):
        # A multi-token-prediction layer holds a transformer layer, whose own sharded_state_dict
        # renames its keys under that layer's prefix.
        prefix, rest = prefix + _MTP_INNER, rest[len(_MTP_INNER) :]
    for old, new in mapping:
        if rest.startswith(old):
            return prefix + new + rest[len(old) :]
    return key


def is_extra_state(key: str) -> bool:
    return key == EXTRA_STATE or key.endswith("." + EXTRA_STATE)
