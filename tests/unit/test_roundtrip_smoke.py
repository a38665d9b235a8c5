import torch

import ckptd
from tools.harness.ranks import run_ranks


def _save_two_ranks(rank: int, world: int, root: str) -> None:
    x = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    sd = {"w": ckptd.ShardedTensor.from_rank_offsets("w", x[rank * 2 : rank * 2 + 2].clone(), (0, rank, world))}
    ckptd.save(sd, root)


def test_single_process_roundtrip(tmp_path):
    x = torch.randn(4, 6)
    ckptd.save({"x": ckptd.ShardedTensor.from_rank_offsets("x", x), "step": 3}, tmp_path / "c")
    out = ckptd.load({"x": ckptd.ShardedTensor.from_rank_offsets("x", torch.empty(4, 6))}, tmp_path / "c")
    assert torch.equal(out["x"], x) and out["step"] == 3


def test_two_ranks_then_one(tmp_path):
    run_ranks(_save_two_ranks, 2, str(tmp_path / "c"), timeout_s=120)
    out = ckptd.load_plain_tensors(tmp_path / "c")
    assert torch.equal(out["w"], torch.arange(16, dtype=torch.float32).reshape(4, 4))
