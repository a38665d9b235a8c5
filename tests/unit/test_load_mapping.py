"""Key mapping (rename / fuse / split), allow_shape_mismatch and strict handling at load."""

from __future__ import annotations

import logging

import pytest
import torch

import ckptd
from ckptd import ShardedObject, ShardedTensor
from ckptd.errors import LoadMismatchError
from ckptd.loading.keymap import Fuse, Rename, Split, rules_from_config
from ckptd.loading.strict import StrictHandling

H, NQ, NG, D = 4, 4, 2, 3  # hidden, query heads, KV groups, head dim


def _tp(key: str, full: torch.Tensor, axis: int, tp: int, rank: int) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, full.chunk(tp, axis)[rank].clone(), (axis, rank, tp))


@pytest.fixture(scope="module")
def separate(tmp_path_factory):
    """A checkpoint with separate q/k/v and gate/up for two layers, saved at TP=2 (one process)."""
    g = torch.Generator().manual_seed(3)
    ref = {}
    for i in range(2):
        ref[f"layers.{i}.q"] = torch.randn(NQ * D, H, generator=g)
        ref[f"layers.{i}.k"] = torch.randn(NG * D, H, generator=g)
        ref[f"layers.{i}.v"] = torch.randn(NG * D, H, generator=g)
        ref[f"layers.{i}.gate"] = torch.randn(8, H, generator=g)
        ref[f"layers.{i}.up"] = torch.randn(8, H, generator=g)
    ref["model.embed"] = torch.randn(10, H, generator=g)
    sd = {f"{k}/{r}": _tp(k, v, 0, 2, r) for k, v in ref.items() for r in range(2)}
    sd["obj"] = ShardedObject("model.meta", {"vocab": 10}, (1,), (0,))
    d = tmp_path_factory.mktemp("sep") / "c"
    ckptd.save(sd, d, fsync=False)
    return d, ref


def _gqa_fused(q, k, v):
    """Megatron's GQA linear_qkv layout: per KV group, its queries then its key then its value."""
    per = NQ // NG
    blocks = []
    for gi in range(NG):
        blocks += [q[gi * per * D : (gi + 1) * per * D], k[gi * D : (gi + 1) * D], v[gi * D : (gi + 1) * D]]
    return torch.cat(blocks)


def test_fuse_and_split_reshard(separate, tmp_path):
    d, ref = separate
    rules = [
        Rename("model.*", "*"),
        Fuse("layers.*.qkv", ["layers.*.q", "layers.*.k", "layers.*.v"], axis=0, groups=NG),
        Fuse("layers.*.fc1", ["layers.*.gate", "layers.*.up"], axis=0),
    ]
    fused = {i: _gqa_fused(ref[f"layers.{i}.q"], ref[f"layers.{i}.k"], ref[f"layers.{i}.v"]) for i in range(2)}
    fc1 = {i: torch.cat([ref[f"layers.{i}.gate"], ref[f"layers.{i}.up"]]) for i in range(2)}
    for tp in (1, 3):  # a different TP than saved, uneven splits of the fused tensors
        for rank in range(tp):
            req = {}
            for i in range(2):
                for name, full in ((f"layers.{i}.qkv", fused[i]), (f"layers.{i}.fc1", fc1[i])):
                    n = full.shape[0]
                    lo, hi = rank * n // tp, (rank + 1) * n // tp
                    req[name] = ShardedTensor(
                        name, torch.zeros(hi - lo, H), torch.float32, (hi - lo, H), tuple(full.shape), (lo, 0), (tp, 1)
                    )
            req["embed"] = ShardedTensor.from_rank_offsets("embed", torch.zeros(10, H))
            req["meta"] = ShardedObject("meta", None, (1,), (0,))
            out = ckptd.load(req, d, key_mapping=rules)
            for i in range(2):
                n = fused[i].shape[0]
                assert torch.equal(out[f"layers.{i}.qkv"], fused[i][rank * n // tp : (rank + 1) * n // tp])
                n = fc1[i].shape[0]
                assert torch.equal(out[f"layers.{i}.fc1"], fc1[i][rank * n // tp : (rank + 1) * n // tp])
            assert torch.equal(out["embed"], ref["model.embed"]) and out["meta"] == {"vocab": 10}

    # Save the fused form, load the separate form back (split, with GQA sizes), flattened too.
    fused_dir = tmp_path / "fused"
    ckptd.save(
        {f"{i}": ShardedTensor.from_rank_offsets(f"blk.{i}.qkv", fused[i]) for i in range(2)}, fused_dir, fsync=False
    )
    split_rules = rules_from_config(
        [
            {
                "split": "blk.*.qkv",
                "targets": ["blk.*.q", "blk.*.k", "blk.*.v"],
                "axis": 0,
                "sizes": [NQ * D, NG * D, NG * D],
                "groups": NG,
            },
        ]
    )
    req = {
        "k": ShardedTensor.from_rank_offsets("blk.1.k", torch.zeros(NG * D // 2, H), (0, 1, 2)),
        "q": ShardedTensor.from_rank_offsets_flat(
            "blk.0.q", torch.zeros(17), (NQ * D, H), flattened_range=slice(5, 22)
        ),
        "v": ShardedTensor.from_rank_offsets("blk.0.v", torch.zeros(NG * D, H)),
    }
    out = ckptd.load(req, fused_dir, key_mapping=split_rules)
    assert torch.equal(out["k"], ref["layers.1.k"][NG * D // 2 :])
    assert torch.equal(out["q"], ref["layers.0.q"].reshape(-1)[5:22])
    assert torch.equal(out["v"], ref["layers.0.v"])


def test_key_mapping_errors(separate):
    d, _ = separate
    req = {"x": ShardedTensor.from_rank_offsets("layers.0.qkv", torch.zeros(24, H))}
    cases = [
        (
            [Fuse("layers.*.qkv", ["layers.*.q", "layers.*.kk", "layers.*.v"])],
            r"\['layers.0.kk'\] are not in the checkpoint.*does not cover",
        ),
        ([Fuse("layers.*.qkv", ["layers.*.q", "model.embed"])], "different numbers of"),
        ([Fuse("x.*", ["layers.*.q", "layers.*.k"], axis=1)], "cannot fuse.*along axis 1"),
        ([Fuse("x.*", ["layers.*.q", "layers.*.k"], groups=5)], "not divisible into 5 groups"),
        ([Fuse("x.*", ["layers.*.q", "layers.*.q"])], "names a source twice"),  # was a bare KeyError
        ([Split("layers.*.q", ["a.*", "b.*"], sizes=[5, 5])], "cover 10 of the 12 entries.*must cover"),
        ([Split("layers.*.q", ["a.*", "b.*"], axis=2)], "axis 2 does not exist"),
        ([Rename("nothing.*", "x.*")], "matched no key"),
        ([Rename("layers.0.q", "layers.0.k")], "already exists"),
    ]
    for rules, pattern in cases:
        with pytest.raises(LoadMismatchError, match=pattern):
            ckptd.load(req, d, key_mapping=rules)
    with pytest.raises(LoadMismatchError, match=r"'layers.0.qkv' is not in the checkpoint.*key_mapping"):
        ckptd.load(req, d)  # no rule produces the requested key
    with pytest.raises(LoadMismatchError, match="malformed"):
        rules_from_config([{"fuse": "x"}])


def test_allow_shape_mismatch_pads_and_truncates(tmp_path):
    vocab = torch.randn(10, 4)
    ckptd.save({f"e{r}": _tp("embed", vocab, 0, 2, r) for r in range(2)}, tmp_path / "c", fsync=False)
    with pytest.raises(LoadMismatchError, match=r"global shape \(10, 4\).*\(12, 4\).*allow_shape_mismatch"):
        ckptd.load({"e": ShardedTensor.from_rank_offsets("embed", torch.zeros(12, 4))}, tmp_path / "c")
    for new_vocab, tp in ((12, 2), (12, 4), (8, 2), (16, 1)):  # padded (resized vocab) and truncated
        want = torch.zeros(new_vocab, 4)
        want[: min(10, new_vocab)] = vocab[: min(10, new_vocab)]
        for rank in range(tp):
            data = torch.full((new_vocab // tp, 4), 9.0)
            sh = ShardedTensor.from_rank_offsets("embed", data, (0, rank, tp), allow_shape_mismatch=True)
            out = ckptd.load({"e": sh}, tmp_path / "c")
            assert torch.equal(out["e"], want.chunk(tp, 0)[rank]), (new_vocab, tp, rank)
    flat = ShardedTensor.from_rank_offsets_flat(
        "embed", torch.full((10,), 9.0), (12, 4), flattened_range=slice(36, 46), allow_shape_mismatch=True
    )
    want = torch.zeros(12, 4)
    want[:10] = vocab
    assert torch.equal(ckptd.load({"f": flat}, tmp_path / "c")["f"], want.reshape(-1)[36:46])


def test_strict_modes(separate, caplog):
    d, ref = separate
    req = {
        "q": ShardedTensor.from_rank_offsets("layers.0.q", torch.zeros(NQ * D, H)),
        "ghost": ShardedTensor.from_rank_offsets("layers.0.ghost", torch.zeros(2, 2)),
        "gobj": ShardedObject("ghost.obj", None, (1,), (0,)),
        "plain": 5,
    }
    # Default (assume_ok_unexpected): the unexpected key raises, with a hint.
    with pytest.raises(LoadMismatchError, match="'layers.0.ghost' is not in the checkpoint"):
        ckptd.load(req, d)
    for mode in ("raise_unexpected", StrictHandling.RAISE_ALL):
        with pytest.raises(LoadMismatchError, match=r"unexpected.*layers\.0\.ghost"):
            ckptd.load(req, d, strict=mode)
    out, missing, unexpected = ckptd.load(req, d, strict="return_all")
    assert unexpected == {"layers.0.ghost", "ghost.obj/shard_0_1"}
    assert "layers.0.k" in missing and "model.meta/shard_0_1" in missing and "layers.0.q" not in missing
    assert torch.equal(out["q"], ref["layers.0.q"]) and "ghost" not in out and "gobj" not in out
    out, missing, unexpected = ckptd.load(req, d, strict=StrictHandling.RETURN_UNEXPECTED)
    assert missing == set() and unexpected == {"layers.0.ghost", "ghost.obj/shard_0_1"}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        out = ckptd.load(req, d, strict="log_all")
    assert "ghost" not in out and any("missing" in r.message and "layers.1.v" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        out = ckptd.load(req, d, strict="ignore_all")
    assert "ghost" not in out and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with pytest.raises(LoadMismatchError, match="not a strict-handling mode"):
        ckptd.load(req, d, strict="sometimes")
    # A request that matches the checkpoint passes raise_unexpected silently.
    ok = {"q": ShardedTensor.from_rank_offsets("layers.0.q", torch.zeros(NQ * D, H))}
    assert torch.equal(ckptd.load(ok, d, strict="raise_unexpected")["q"], ref["layers.0.q"])
