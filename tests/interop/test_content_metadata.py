"""Megatron-Core's ``content_metadata`` (issue 26 item 9): ``save(..., content_metadata=...)`` and
``load_content_metadata`` in ckptd (sync save, Checkpointer.save), read both ways with
Megatron-Core 0.16's own ``dist_checkpointing``.

Megatron-Core imports allow-list classes for the whole process, so everything runs in a spawned
rank (tools/harness/ranks.py)."""

from __future__ import annotations

import fractions
import os

import pytest
import torch

import ckptd
from tests.megatron_rank import megatron_save_on_cpu
from tools.harness.ranks import run_ranks

META = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True, "version": 2}


def _both_ways(rank: int, world: int, root: str) -> list[str]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as MShardedTensor

    bad: list[str] = []
    w = torch.arange(12.0).reshape(3, 4)
    # Megatron-LM keeps its data-parallel group in the dict; neither library saves it.
    with_group = {**META, "dp_cp_group": dist.group.WORLD}

    # ckptd writes (synchronous), Megatron-Core and ckptd read.
    a = os.path.join(root, "ckptd_sync")
    ckptd.save({"w": ckptd.ShardedTensor.from_rank_offsets("w", w), "iteration": 3}, a, content_metadata=with_group)
    if mdc.load_content_metadata(a) != META:
        bad.append(f"megatron reads ckptd's: {mdc.load_content_metadata(a)!r}")
    if ckptd.load_content_metadata(a) != META:
        bad.append(f"ckptd reads ckptd's: {ckptd.load_content_metadata(a)!r}")
    loaded = ckptd.load({"w": ckptd.ShardedTensor.from_rank_offsets("w", torch.empty(3, 4))}, a)
    if ckptd.load_content_metadata(preloaded_state_dict=loaded) != META or loaded["iteration"] != 3:
        bad.append(f"ckptd's preloaded state dict: {loaded.get('content_metadata')!r}")

    # A Checkpointer save.
    with ckptd.Checkpointer(os.path.join(root, "async")) as ckpt:
        sd = {"w": ckptd.ShardedTensor.from_rank_offsets("w", w), "iteration": 4}
        ckpt.save(sd, step=4, content_metadata=with_group).wait(timeout_s=60)
        b = str(ckpt.checkpoint_dir())
    if mdc.load_content_metadata(b) != META or ckptd.load_content_metadata(b) != META:
        bad.append(f"Checkpointer's: {mdc.load_content_metadata(b)!r}, {ckptd.load_content_metadata(b)!r}")

    # Megatron-Core writes, ckptd reads.
    megatron_save_on_cpu()
    c = os.path.join(root, "megatron")
    os.makedirs(c)
    mdc.save({"w": MShardedTensor.from_rank_offsets("w", w), "iteration": 5}, c, content_metadata=dict(with_group))
    if ckptd.load_content_metadata(c) != META:
        bad.append(f"ckptd reads megatron's: {ckptd.load_content_metadata(c)!r}")
    # A DCP-style state dict (plain tensors, no ShardedTensor): the metadata is flattened like the
    # rest (as DCP does), and load_content_metadata found none.
    d = os.path.join(root, "dcp_style")
    # (a value load_content_metadata must not decode: weights-only refuses a Fraction)
    ckptd.save({"w": w, "iteration": 6, "ratio": fractions.Fraction(1, 3)}, d, content_metadata=META)
    if ckptd.load_content_metadata(d) != META:
        bad.append(f"ckptd reads a DCP-style save's: {ckptd.load_content_metadata(d)!r}")
    with ckptd.Checkpointer(os.path.join(root, "async_dcp")) as ckpt:
        for step in (1, 2):  # the second save's plan is the first's, reused (ckptd.format.repeat)
            ckpt.save({"w": w, "iteration": step}, step=step, content_metadata={**META, "n": step}).wait(60)
        if ckptd.load_content_metadata(str(ckpt.checkpoint_dir())) != {**META, "n": 2}:
            bad.append(
                f"a Checkpointer's DCP-style save's: {ckptd.load_content_metadata(str(ckpt.checkpoint_dir()))!r}"
            )
    none = os.path.join(root, "none")
    ckptd.save({"w": ckptd.ShardedTensor.from_rank_offsets("w", w)}, none)
    if ckptd.load_content_metadata(none) is not None or mdc.load_content_metadata(none) is not None:
        bad.append("a checkpoint saved without content metadata has some")
    return bad


@pytest.mark.timeout(200)
def test_content_metadata_round_trips_with_megatron_core(tmp_path, runtime_dir):
    env = {"CKPTD_RUNTIME_DIR": str(runtime_dir), "CKPTD_IDLE_EXIT_S": "1"}
    assert run_ranks(_both_ways, 1, str(tmp_path), timeout_s=180, daemon=False, env=env) == [[]]
