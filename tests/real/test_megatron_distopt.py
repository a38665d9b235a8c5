"""Megatron-Core's distributed optimizer (``dp_reshardable``, DP=2 on CPU, gloo) resumes through
ckptd as through Megatron-Core: its state dict keys a dict by ints, strs and dtype tuples
(``param_state = {0: {...}, "per_bucket_numel": ...}``), and ranks other than DP rank 0 hold its
ShardedObjects as replicas. Saved by a Checkpointer and by Megatron-Core's own save, each loaded
by ``ckpt.load``/``ckptd.load`` and by Megatron-Core, then handed to the optimizer's
``load_state_dict``: the restored state must equal what Megatron-Core restores from its own
checkpoint, and the state that was saved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tools.harness.ranks import run_ranks

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def _resume(rank: int, world: int, root: str) -> list[str]:
    import torch.distributed as dist

    from tests.real.megatron_distopt import cpu_shims

    cpu_shims()  # before Megatron-Core builds anything
    from megatron.core import dist_checkpointing as mdc

    import ckptd
    from tests.real.megatron_distopt import build, fill, snapshot, state

    ddp, chained, optimizer = build(seed=1)
    saved = snapshot(optimizer)
    with ckptd.Checkpointer(os.path.join(root, "ckptd")) as ckpt:
        ckpt.save(state(ddp, chained), step=5).wait(timeout_s=120)
        mcore_dir = os.path.join(root, "mcore")
        if rank == 0:
            os.makedirs(mcore_dir)
        dist.barrier()
        mdc.save(state(ddp, chained), mcore_dir)
        dist.barrier()

        def resume(load) -> tuple[list[torch.Tensor], dict]:
            fill(optimizer, None)  # zeros: a load that read nothing would leave them
            loaded = load(state(ddp, chained, loading=True))
            with torch.no_grad():  # fp32 main parameters are views of the model's (a CPU run)
                chained.load_state_dict(loaded["optimizer"])
            return snapshot(optimizer), loaded

        reference, _ = resume(lambda sd: mdc.load(sd, mcore_dir))
        problems = []
        for name, load in (
            ("ckpt.load of the Checkpointer's", lambda sd: ckpt.load(sd)),
            ("ckptd.load of Megatron-Core's", lambda sd: ckptd.load(sd, mcore_dir)),
            ("Megatron-Core's load of the Checkpointer's", lambda sd: mdc.load(sd, str(ckpt.checkpoint_dir()))),
        ):
            got, loaded = resume(load)
            param_state = loaded["optimizer"]["param_state"]
            if not isinstance(param_state, dict) or 0 not in param_state or "per_bucket_numel" not in param_state:
                problems.append(f"{name}: param_state came back as {type(param_state).__name__}")
            if len(got) != len(reference) or not all(torch.equal(a, b) for a, b in zip(got, reference)):
                problems.append(f"{name}: the optimizer state differs from Megatron-Core's own resume")
    if len(saved) != len(reference) or not all(torch.equal(a, b) for a, b in zip(saved, reference)):
        problems.append("Megatron-Core's own resume did not restore the saved state")
    return problems


@pytest.mark.timeout(600)
def test_distributed_optimizer_resumes_through_ckptd_as_through_megatron_core(tmp_path: Path, runtime_dir):
    env = {"CKPTD_RUNTIME_DIR": str(runtime_dir), "CKPTD_IDLE_EXIT_S": "2"}
    results = run_ranks(_resume, 2, str(tmp_path), timeout_s=560, daemon=False, env=env)
    assert results == [[], []]
