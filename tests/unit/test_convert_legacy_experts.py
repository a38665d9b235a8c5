"""Legacy trees with expert parallelism -> torch_dist: the layout is read (never guessed), every
expert rank's experts are written (grouped-GEMM ones as Megatron-Core stores them), a per-expert-rank
tensor ckptd does not know is refused, and a failed conversion leaves the output as it was.

The trees are built from known global tensors (see tests/unit/test_convert_legacy.py);
tests/integration/test_convert_moe_megatron.py checks the grouped layouts against a real
Megatron-Core save.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.convert import convert_legacy, discover
from ckptd.errors import ShardingError, UnsafePickleError
from tests.unit.test_convert_legacy import NE, H, L, reference, write_legacy_tree

F = 6  # expert ffn width (fc1: [gate; up], 2F rows)


def _args(tp: int, ep: int, **extra: object) -> argparse.Namespace:
    return argparse.Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, expert_model_parallel_size=ep, **extra
    )


def _experts() -> dict[str, torch.Tensor]:
    """Global per-expert weights, ``decoder.layers.<i>.mlp.experts.experts.linear_fc<n>.weight``
    as Megatron-Core stores them: (experts, 2F, H) and (experts, H, F)."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for i in range(L):
        out[f"decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight"] = torch.randn(NE, 2 * F, H, generator=g)
        out[f"decoder.layers.{i}.mlp.experts.experts.linear_fc2.weight"] = torch.randn(NE, H, F, generator=g)
    return out


def _fc1_shard(w: torch.Tensor, tp: int, t: int) -> torch.Tensor:
    """TP rank ``t``'s rows of a SwiGLU fc1 (2F, H): ``[gate_t; up_t]``."""
    gate, up = w.chunk(2, 0)
    return torch.cat([gate.chunk(tp, 0)[t], up.chunk(tp, 0)[t]])


def write_grouped_tree(root: Path, experts: dict[str, torch.Tensor], tp: int, ep: int, te: bool) -> Path:
    """Each (TP, EP) rank's experts as TEGroupedMLP (``linear_fc1.weight<i>``, one per local
    expert) or GroupedMLP (``weight1`` (H, local x fc1 rows) over memory (local, H, fc1 rows),
    ``weight2`` (local x F, H) over (local, F, H)) names and lays them out; a replicated router."""
    it = root / "iter_0000100"
    per_ep = NE // ep
    router = torch.randn(NE, H, generator=torch.Generator().manual_seed(5))
    for t in range(tp):
        for e in range(ep):
            model: dict[str, object] = {}
            for i in range(L):
                p = f"decoder.layers.{i}.mlp."
                model[p + "router.weight"] = router[:]
                fc1 = [_fc1_shard(experts[p + "experts.experts.linear_fc1.weight"][x], tp, t) for x in range(NE)]
                fc2 = [experts[p + "experts.experts.linear_fc2.weight"][x].chunk(tp, 1)[t] for x in range(NE)]
                mine = range(e * per_ep, (e + 1) * per_ep)
                if te:
                    for local, x in enumerate(mine):
                        model[p + f"experts.linear_fc1.weight{local}"] = fc1[x].clone()
                        model[p + f"experts.linear_fc2.weight{local}"] = fc2[x].clone()
                    model[p + "experts.linear_fc1._extra_state"] = None
                else:
                    model[p + "experts.weight1"] = torch.stack([fc1[x].t() for x in mine]).reshape(H, -1).clone()
                    model[p + "experts.weight2"] = torch.stack([fc2[x].t() for x in mine]).reshape(-1, H).clone()
            name = f"mp_rank_{t:02d}" + (f"_{e:03d}" if ep > 1 else "")
            (it / name).mkdir(parents=True)
            sd = {"args": _args(tp, ep, num_experts=NE, swiglu=True), "iteration": 100, "model": model}
            torch.save(sd, it / name / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("100")
    return it


def test_ep_tree_whose_files_need_unsafe_pickles_is_read_as_tp_x_ep(tmp_path):
    """numpy RNG states in the rank files: discovery read the args weights-only, failed, and took
    the expert ranks for pipeline stages (layers renumbered, experts of rank 1 lost, exit 0)."""
    ref = reference(experts=True)
    it = write_legacy_tree(tmp_path / "legacy", ref, tp=1, pp=1, ep=2, numpy_rng=True)
    with pytest.raises(UnsafePickleError, match="allow_unsafe_pickle"):
        discover(it)
    tree = discover(it, allow_unsafe_pickle=True)
    assert (tree.tp_size, tree.pp_size, tree.ep_size) == (1, 1, 2)
    convert_legacy(it, tmp_path / "dist", allow_unsafe_pickle=True, fsync=False)
    plain = ckptd.load_plain_tensors(tmp_path / "dist")
    assert sorted(plain) == sorted(ref) and all(torch.equal(plain[k], ref[k]) for k in ref)


def test_two_number_rank_dirs_without_telling_args_are_refused(tmp_path):
    ref = reference(experts=True)
    it = write_legacy_tree(tmp_path / "legacy", ref, tp=1, pp=1, ep=2, numpy_rng=False)
    for name, args in (("none", None), ("no sizes", argparse.Namespace(lr=1.0)), ("pp=1, ep=1", _args(1, 1))):
        for d in it.iterdir():
            sd = torch.load(d / "model_optim_rng.pt", weights_only=False)
            sd["args"] = args
            torch.save(sd, d / "model_optim_rng.pt")
        with pytest.raises(ShardingError, match=r"mp_rank_00_000/model_optim_rng.pt.*--expert-parallel"):
            discover(it)
        assert discover(it, expert_parallel=True).ep_size == 2, name
        assert discover(it, expert_parallel=False).pp_size == 2, name
    convert_legacy(it, tmp_path / "dist", expert_parallel=True, fsync=False)
    assert torch.equal(
        ckptd.load_plain_tensors(tmp_path / "dist")["decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight"],
        ref["decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight"],
    )


@pytest.mark.parametrize("te", [True, False], ids=["TEGroupedMLP", "GroupedMLP"])
@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 2), (2, 1)])
def test_grouped_experts_are_written_whole_as_megatron_core_stores_them(tmp_path, te, tp, ep):
    experts = _experts()
    write_grouped_tree(tmp_path / "legacy", experts, tp, ep, te)
    report = convert_legacy(tmp_path / "legacy", tmp_path / "dist", fsync=False)
    plain = ckptd.load_plain_tensors(tmp_path / "dist")
    for k, v in experts.items():
        assert torch.equal(plain[k], v), k
    assert report.tensors == len(plain) == len(experts) + L  # and the routers
    assert not any(".experts.weight" in k or "linear_fc1.weight0" in k for k in plain)
    # Stacked over the layers, as Megatron-Core's default sharded_state_dict names them.
    convert_legacy(tmp_path / "legacy", tmp_path / "stacked", stack_layers=True, fsync=False)
    stacked = ckptd.load_plain_tensors(tmp_path / "stacked")["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert torch.equal(
        stacked, torch.stack([experts[f"decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight"] for i in range(L)])
    )


def _edit(path: Path, edit) -> None:
    sd = torch.load(path, weights_only=False)
    edit(sd["model"])
    torch.save(sd, path)


def test_per_expert_rank_tensors_ckptd_does_not_know_are_refused(tmp_path):
    """A key an expert rank holds for itself but ckptd does not convert was skipped (EP rank 0's
    written as if replicated): now an error naming the key and the files."""
    it = write_grouped_tree(tmp_path / "a", _experts(), tp=1, ep=2, te=True)
    rank1 = it / "mp_rank_00_001" / "model_optim_rng.pt"
    _edit(rank1, lambda m: m.__setitem__("decoder.layers.1.mlp.router.weight", torch.zeros(NE, H)))
    with pytest.raises(
        ShardingError, match=r"router\.weight' in .*mp_rank_00_001.*differs.*mp_rank_00_000.*Megatron-LM"
    ):
        convert_legacy(it, tmp_path / "out-a", fsync=False)
    assert not (tmp_path / "out-a").exists()  # what the failed run created is removed

    it = write_grouped_tree(tmp_path / "b", _experts(), tp=1, ep=2, te=True)
    for e in range(2):
        path = it / f"mp_rank_00_{e:03d}" / "model_optim_rng.pt"
        _edit(path, lambda m, e=e: m.__setitem__("decoder.layers.0.mlp.experts.scale", torch.full((2,), float(e))))
    with pytest.raises(ShardingError, match=r"'decoder\.layers\.0\.mlp\.experts\.scale' .*experts module.*Megatron-LM"):
        convert_legacy(it, tmp_path / "out-b", fsync=False)


def test_grouped_mlp_needs_num_experts_and_a_glu_setting_its_shapes_agree_with(tmp_path):
    it = write_grouped_tree(tmp_path / "a", _experts(), tp=2, ep=2, te=False)
    # At TP=2 a wrong GLU setting would interleave gate and up rows without a word.
    with pytest.raises(ShardingError, match=r"experts\.weight1' is 12 wide for an ffn of 6.*pass --glu"):
        convert_legacy(it, tmp_path / "o1", glu=False, fsync=False)
    for d in it.iterdir():
        sd = torch.load(d / "model_optim_rng.pt", weights_only=False)
        sd["args"] = _args(2, 2, swiglu=True)  # no num_experts: weight1 holds how many experts?
        torch.save(sd, d / "model_optim_rng.pt")
    with pytest.raises(ShardingError, match=r"experts\.weight1' in .*num_experts=None.*Megatron-LM"):
        convert_legacy(it, tmp_path / "o2", fsync=False)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_failed_conversion_removes_only_what_it_created(tmp_path):
    """The second pipeline stage fails (a replicated tensor differs across TP ranks) once the first
    stage's data file is written: that file was left behind, a data file without markers."""
    it = write_legacy_tree(tmp_path / "legacy", reference(experts=False), tp=2, pp=2, ep=1, numpy_rng=False)
    _edit(
        it / "mp_rank_01_001" / "model_optim_rng.pt",
        lambda m: m.__setitem__("decoder.final_layernorm.weight", torch.zeros(H)),
    )
    dst = tmp_path / "mine"
    dst.mkdir()
    (dst / "notes.txt").write_text("kept")
    with pytest.raises(ShardingError, match="final_layernorm.weight' differs across tensor-parallel ranks"):
        convert_legacy(it, dst, fsync=False)
    assert sorted(p.name for p in dst.iterdir()) == ["notes.txt"]
    with pytest.raises(ShardingError):
        convert_legacy(it, tmp_path / "new" / "deeper", fsync=False)
    assert not (tmp_path / "new").exists()
