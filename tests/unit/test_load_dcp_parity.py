"""Loads behave as ``dcp.load`` where users switching from DCP expect it (issue 26 item 10): an empty
request, a dtype different from the stored one (cast, as dcp.load and Megatron-Core's load do,
unless ``allow_dtype_cast=False``), the README's key-mapping call, and what a DCP-style request
is told to do about a shape mismatch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptd
from ckptd import LoadMismatchError, ShardedTensor

ST = ShardedTensor
REPO = Path(__file__).resolve().parents[2]


def test_an_empty_request_loads_nothing_as_dcp_load_does(tmp_path):
    """torch's broadcast_from_rank0 full-state loads give every rank but 0 an empty state dict."""
    sd = {"model": {"w": torch.randn(3)}, "optim": {"state": {}, "param_groups": [{"lr": 0.1}]}, "step": 4}
    ckptd.save(sd, tmp_path / "c")
    for empty in ({}, {"model": {}, "optim": {"state": {}}}):
        want = dict(empty)
        dcp.load(want, checkpoint_id=str(tmp_path / "c"), no_dist=True)
        assert ckptd.load(empty, tmp_path / "c") == want  # before: LoadMismatchError
    # A Megatron-style request of only local objects still gets the common state.
    out = ckptd.load({"x": ckptd.LocalNonPersistentObject(5)}, tmp_path / "c")
    assert out["x"] == 5


def test_a_dtype_mismatch_is_cast_as_dcp_load_casts(tmp_path):
    w = torch.randn(8, 6)
    ckptd.save({"w": w, "common_t": torch.randn(3)}, tmp_path / "dcp_style")
    mine, theirs = {"w": torch.zeros(8, 6, dtype=torch.bfloat16)}, {"w": torch.zeros(8, 6, dtype=torch.bfloat16)}
    ckptd.load(mine, tmp_path / "dcp_style")  # before: LoadMismatchError
    dcp.load(theirs, checkpoint_id=str(tmp_path / "dcp_style"), no_dist=True)
    assert mine["w"].dtype == torch.bfloat16 and torch.equal(mine["w"], theirs["w"])
    assert torch.equal(mine["w"], w.to(torch.bfloat16))
    with pytest.raises(LoadMismatchError, match=r"stores torch.float32 but torch.bfloat16.*allow_dtype_cast"):
        ckptd.load({"w": torch.zeros(8, 6, dtype=torch.bfloat16)}, tmp_path / "dcp_style", allow_dtype_cast=False)

    # Megatron-style: into the given data, into a template without data, and a flattened range.
    ckptd.save({"w": ST.from_rank_offsets("w", w), "t": torch.arange(4.0)}, tmp_path / "megatron_style")
    out = ckptd.load(
        {
            "a": ST.from_rank_offsets("w", torch.zeros(4, 6, dtype=torch.float16), (0, 1, 2)),
            "b": ST.from_rank_offsets("w", torch.zeros(8, 6, dtype=torch.float64)).without_data(),
            "c": ST.from_rank_offsets_flat(
                "w", torch.zeros(5, dtype=torch.bfloat16), (8, 6), flattened_range=slice(3, 8)
            ),
        },
        tmp_path / "megatron_style",
    )
    assert torch.equal(out["a"], w[4:].to(torch.float16)) and out["a"].dtype == torch.float16
    assert torch.equal(out["b"], w.to(torch.float64))
    assert torch.equal(out["c"], w.reshape(-1)[3:8].to(torch.bfloat16))
    # A DCP-style request of a tensor the checkpoint keeps in common.pt (saved Megatron-style).
    req = {"t": torch.zeros(4, dtype=torch.int64)}
    ckptd.load(req, tmp_path / "megatron_style")
    assert torch.equal(req["t"], torch.arange(4)) and req["t"].dtype == torch.int64


def test_the_readmes_key_mapping_config_call_works(tmp_path):
    """The README showed ckptd.load.keymap.rules_from_config(...), an AttributeError (ckptd.load
    is the function)."""
    text = (REPO / "README.md").read_text()
    (call,) = set(re.findall(r"`(ckptd\.[\w.]*rules_from_config)\(", text))
    fn = ckptd
    for name in call.split(".")[1:]:
        fn = getattr(fn, name)
    w = torch.randn(4, 2)
    ckptd.save({"model.w": ST.from_rank_offsets("model.w", w)}, tmp_path / "c")
    out = ckptd.load(
        {"w": ST.from_rank_offsets("w", torch.empty(4, 2))},
        tmp_path / "c",
        key_mapping=fn([{"rename": ["model.*", "*"]}]),
    )
    assert torch.equal(out["w"], w)


def test_a_dcp_style_shape_mismatch_says_what_such_a_request_can_do(tmp_path):
    ckptd.save({"w": torch.randn(6)}, tmp_path / "c")
    with pytest.raises(LoadMismatchError) as err:
        ckptd.load({"w": torch.empty(5)}, tmp_path / "c")
    msg = str(err.value)
    # Before: "set allow_shape_mismatch=True", which a plain tensor or DTensor cannot.
    assert "plain tensors and DTensors cannot say allow_shape_mismatch" in msg
    assert "ckptd.load_plain_tensors" in msg and "stored shape is (6,)" in msg
    with pytest.raises(LoadMismatchError, match="or set allow_shape_mismatch=True"):
        ckptd.load({"w": ST.from_rank_offsets("w", torch.empty(5))}, tmp_path / "c")


def test_a_meta_tensor_to_load_into_is_refused(tmp_path):
    """copy_() into a meta tensor does nothing: the load returned the request without its values."""
    ckptd.save({"w": torch.arange(3.0), "v": torch.ones(2)}, tmp_path / "c")
    for req in (
        {"w": torch.empty(3, device="meta")},
        {"w": ShardedTensor.from_rank_offsets("w", torch.empty(3, device="meta"))},
    ):
        with pytest.raises(LoadMismatchError, match="tensor 'w' at 'w' is a meta tensor.*to_empty"):
            ckptd.load(req, tmp_path / "c")


def _saved_by_torch_2_3(state_dict: dict, directory: Path) -> None:
    """dcp.save as torch <= 2.3 flattened: torch itself switches its flattening with this flag
    (DefaultLoadPlanner sets it to re-flatten a request for such a checkpoint)."""
    from torch.distributed.checkpoint import _version

    _version._derived_version = "2_3"
    try:
        dcp.save(state_dict, checkpoint_id=str(directory), no_dist=True)
    finally:
        _version._derived_version = None


def _same(a: object, b: object, where: str = "") -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}.{i}")
    else:
        assert a == b, where


def test_a_checkpoint_of_torch_2_3_loads_its_containers_of_values_as_dcp_load_does(tmp_path):
    """torch <= 2.3 stored a dict or list holding no tensor as one bytes item (``train``, not
    ``train.step``); dcp.load re-flattens the request that way. ckptd raised LoadMismatchError for
    ``train.step``, and a non-raising strict mode left the step counter and the lr as they were."""

    def state(n: int) -> dict:
        return {
            "model": {
                "w": torch.full((2, 3), float(n)),
                "blocks": [{"b": torch.full((2,), n + 0.5), "cfg": {"act": f"gelu{n}", "sizes": [n, n + 1]}}],
            },
            "train": {"step": n, "epoch": n, "history": [n, n + 1], "ratio": n / 3},
            "optim": {
                "state": {"0": {"step": torch.tensor(float(n)), "exp_avg": torch.full((2, 3), 2.0 * n)}},
                "param_groups": [{"lr": 0.1 * n, "betas": (0.9, 0.99), "params": ["0"]}],
            },
            "mixed": [torch.full((1,), float(n)), {"k": n}, [n, "x"]],
            "step": n,
        }

    _saved_by_torch_2_3(state(7), tmp_path / "c")
    stored = set(dcp.FileSystemReader(str(tmp_path / "c")).read_metadata().state_dict_metadata)
    assert {"train", "optim.param_groups", "model.blocks.0.cfg", "mixed.1"} <= stored  # what 2.3 did
    theirs = state(0)
    dcp.load(theirs, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    _same(theirs, state(7))  # the simulation is torch's: dcp.load reads it whole
    for strict in ("assume_ok_unexpected", "log_unexpected", "raise_all"):
        mine = state(0)
        w = mine["model"]["w"]
        assert ckptd.load(mine, tmp_path / "c", strict=strict) is mine  # before: LoadMismatchError / left as 0
        _same(mine, theirs)
        assert mine["model"]["w"] is w  # tensors in place, containers of values replaced, as dcp.load
    # Part of it, as dcp.load allows: still read the 2.3 way.
    part = {"train": {"step": 0, "epoch": 0, "history": [], "ratio": 0.0}, "model": {"w": torch.zeros(2, 3)}}
    ckptd.load(part, tmp_path / "c")
    _same(part["train"], state(7)["train"])
    # A checkpoint of today's flattening is not read the 2.3 way.
    ckptd.save(state(5), tmp_path / "now")
    mine = state(0)
    ckptd.load(mine, tmp_path / "now")
    _same(mine, state(5))


def test_a_tensor_whose_elements_share_memory_is_refused_before_anything_is_written(tmp_path):
    """Into ``torch.zeros(1, 8).expand(6, 8)``: torch's copy_ raised a RuntimeError naming no key,
    after the tensors before it were filled; an as_strided() overlap loaded silently, later values
    over earlier ones."""
    w = torch.randn(6, 8)
    ckptd.save({"a": torch.arange(4.0), "w": w}, tmp_path / "c")
    for shared in (torch.zeros(1, 8).expand(6, 8), torch.zeros(20).as_strided((6, 8), (1, 1))):
        a = torch.zeros(4)
        with pytest.raises(LoadMismatchError, match=r"tensor 'w' at 'w'.*share memory.*owns its memory"):
            ckptd.load({"a": a, "w": shared}, tmp_path / "c")
        assert not a.any() and not shared.any()  # nothing written
        with pytest.raises(LoadMismatchError, match="tensor 'w' at 'w'.*share memory"):
            ckptd.load({"w": ShardedTensor.from_rank_offsets("w", shared)}, tmp_path / "c")
    # Views that do not overlap still load in place: permuted, stepped, channels-last, an odd
    # as_strided() layout whose offsets are all distinct.
    base = torch.zeros(8, 6)
    out = ckptd.load({"w": base.t()}, tmp_path / "c")
    assert torch.equal(base.t(), w) and out["w"].data_ptr() == base.data_ptr()
    wide = torch.zeros(6, 16)
    ckptd.load({"w": wide[:, ::2]}, tmp_path / "c")
    assert torch.equal(wide[:, ::2], w) and not wide[:, 1::2].any()
    odd = torch.zeros(64).as_strided((3, 2), (2, 3))  # offsets 0 3 2 5 4 7: distinct, not dense
    ckptd.save({"o": torch.arange(6.0).reshape(3, 2)}, tmp_path / "o")
    ckptd.load({"o": odd}, tmp_path / "o")
    assert torch.equal(odd, torch.arange(6.0).reshape(3, 2))
