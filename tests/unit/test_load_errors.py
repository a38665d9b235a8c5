"""Damaged, foreign or mismatched checkpoints at load: a ckptd error naming the file / key and the
fix, and no code from the checkpoint runs unless the caller allows unsafe pickles."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LoadMismatchError,
    ShardedObject,
    ShardedTensor,
    UnsafePickleError,
    UnsupportedFormatError,
)
from tests.unit.test_save_errors import snapshot

ST = ShardedTensor
X = torch.arange(24, dtype=torch.float32).reshape(4, 6)


class Opaque:
    """An arbitrary class: outside torch's weights-only allow-list."""

    def __init__(self, value: int) -> None:
        self.value = value


class Hostile:
    """Unpickling it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def request(**overrides) -> dict:
    return {"x": ST.from_rank_offsets("x", torch.empty(4, 6)), **overrides}


@pytest.fixture
def ckpt(tmp_path: Path):
    """A checkpoint; after the test, any file the test did not damage on purpose is unchanged."""
    path = tmp_path / "c"
    ckptd.save(
        {"x": ST.from_rank_offsets("x", X.clone()), "o": ShardedObject("o", {"a": 1}, (1,), (0,)), "step": 3}, path
    )
    yield path


def _data_file(path: Path) -> Path:
    return path / "__0_0.distcp"


def test_intact_checkpoint_loads(ckpt: Path):
    before = snapshot(ckpt)
    out = ckptd.load(request(o=ShardedObject("o", None, (1,), (0,))), ckpt)
    assert torch.equal(out["x"], X) and out["o"] == {"a": 1} and out["step"] == 3
    assert snapshot(ckpt) == before  # loading never writes


def test_missing_data_file(ckpt: Path):
    _data_file(ckpt).unlink()
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp is missing.*earlier checkpoint"):
        ckptd.load(request(), ckpt)


def test_truncated_data_file(ckpt: Path):
    data = _data_file(ckpt).read_bytes()
    _data_file(ckpt).write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp is truncated.*'x'"):
        ckptd.load(request(), ckpt)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        ckptd.load_plain_tensors(ckpt)


def test_missing_dcp_metadata(ckpt: Path):
    (ckpt / ".metadata").unlink()
    for fn in (lambda: ckptd.load(request(), ckpt), lambda: ckptd.load_tensors_metadata(ckpt)):
        with pytest.raises(CorruptCheckpointError, match=r"\.metadata is missing.*metadata\.json"):
            fn()


def test_missing_common_pt(ckpt: Path):
    (ckpt / "common.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"common\.pt is missing"):
        ckptd.load_common_state_dict(ckpt)


def test_a_committed_checkpoint_that_lost_its_metadata_json_is_not_read_as_plain_dcp(ckpt: Path):
    """A commit of a Checkpointer (it has a commit record) missing metadata.json and common.pt:
    read as a plain DCP checkpoint it would load without its common state ("step" here)."""
    from tests.checkpoints import stamp_commits

    root = ckpt.parent
    ckpt.rename(root / "iter_0000003")
    stamp_commits(root, [3])
    for name in ("metadata.json", "common.pt"):
        (root / "iter_0000003" / name).unlink()
    with pytest.raises(CorruptCheckpointError, match=r"ckptd_commit\.json.*metadata\.json is gone.*common\.pt"):
        ckptd.load(request(), root / "iter_0000003")


@pytest.mark.parametrize(
    "meta",
    [
        {"sharded_backend": "zarr", "sharded_backend_version": 1},
        {"sharded_backend": "torch_dist", "sharded_backend_version": 99},
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "yaml"},
    ],
)
def test_unknown_backend(ckpt: Path, meta: dict):
    (ckpt / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(UnsupportedFormatError, match="metadata.json.*not supported"):
        ckptd.load(request(), ckpt)


def test_metadata_json_not_json(ckpt: Path):
    (ckpt / "metadata.json").write_text("{not json")
    with pytest.raises(UnsupportedFormatError, match="not valid JSON"):
        ckptd.load_common_state_dict(ckpt)


def test_keys_that_do_not_exist(ckpt: Path):
    with pytest.raises(LoadMismatchError, match=r"'x_' is not in the checkpoint.*\['x'\].*key_mapping"):
        ckptd.load({"x": ST.from_rank_offsets("x_", torch.empty(4, 6))}, ckpt)
    with pytest.raises(LoadMismatchError, match=r"ShardedObject 'o/shard_1_2' is not in the checkpoint"):
        ckptd.load(request(o=ShardedObject("o", None, (2,), (1,))), ckpt)


def test_dtype_and_shape_mismatch(ckpt: Path):
    with pytest.raises(LoadMismatchError, match=r"'x'.*stores torch.float32 but torch.bfloat16.*allow_dtype_cast"):
        req = {"x": ST.from_rank_offsets("x", torch.empty(4, 6, dtype=torch.bfloat16))}
        ckptd.load(req, ckpt, allow_dtype_cast=False)
    with pytest.raises(LoadMismatchError, match=r"'x'.*global shape \(4, 6\).*\(4, 8\).*allow_shape_mismatch"):
        ckptd.load({"x": ST.from_rank_offsets("x", torch.empty(4, 4), (1, 0, 2))}, ckpt)
    with pytest.raises(LoadMismatchError, match=r"'x'.*\(4, 6\).*\(24,\)"):
        ckptd.load({"x": ST.from_rank_offsets("x", torch.empty(24))}, ckpt)


def test_directories_that_are_not_checkpoints(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "iter_0000010.tmp").mkdir()
    (tmp_path / "file").write_text("x")
    cases = {
        "empty": "metadata.json is missing.*Pass the directory of one checkpoint",
        "iter_0000010.tmp": "uncommitted",
        "file": "not a directory",
        "absent": "not a directory",
    }
    for name, pattern in cases.items():
        for fn in (
            ckptd.load_common_state_dict,
            ckptd.load_tensors_metadata,
            ckptd.load_sharded_metadata,
            ckptd.load_plain_tensors,
            lambda p: ckptd.load(request(), p),
        ):
            with pytest.raises(CheckpointNotFoundError, match=pattern):
                fn(tmp_path / name)


def test_common_state_with_arbitrary_objects_needs_allow_unsafe_pickle(tmp_path: Path):
    path = tmp_path / "c"
    ckptd.save(
        {"x": ST.from_rank_offsets("x", X.clone()), "args": Opaque(7), "o": ShardedObject("o", Opaque(8), (1,), (0,))},
        path,
    )
    with pytest.raises(
        UnsafePickleError, match=r"common.pt contains tests.unit.test_load_errors.Opaque.*allow_unsafe_pickle=True"
    ):
        ckptd.load_common_state_dict(path)
    with pytest.raises(UnsafePickleError, match="allow_unsafe_pickle=True"):
        ckptd.load(request(), path)
    assert ckptd.load_common_state_dict(path, allow_unsafe_pickle=True)["args"].value == 7
    out = ckptd.load(request(o=ShardedObject("o", None, (1,), (0,))), path, allow_unsafe_pickle=True)
    assert out["args"].value == 7 and out["o"].value == 8 and torch.equal(out["x"], X)


def test_sharded_object_with_arbitrary_object_needs_allow_unsafe_pickle(tmp_path: Path):
    path = tmp_path / "c"
    ckptd.save({"o": ShardedObject("o", Opaque(8), (1,), (0,))}, path)
    with pytest.raises(UnsafePickleError, match="o/shard_0_1.*allow_unsafe_pickle=True"):
        ckptd.load({"o": ShardedObject("o", None, (1,), (0,))}, path)


def test_hostile_dcp_metadata_is_refused(ckpt: Path, tmp_path: Path):
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    for fn in (
        lambda: ckptd.load(request(), ckpt),
        lambda: ckptd.load_tensors_metadata(ckpt),
        lambda: ckptd.load_sharded_metadata(ckpt),
        lambda: ckptd.load_plain_tensors(ckpt),
    ):
        with pytest.raises(UnsafePickleError, match=r"\.metadata references posix\.system.*refusing"):
            fn()
    assert not marker.exists()


def test_garbage_dcp_metadata(ckpt: Path):
    (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata cannot be decoded"):
        ckptd.load(request(), ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CorruptCheckpointError, match="does not hold a DCP Metadata"):
        ckptd.load(request(), ckpt)


def test_a_plain_tensor_kept_in_common_state_with_another_shape_is_a_mismatch(tmp_path: Path):
    """A DCP-style request of a plain tensor that the checkpoint keeps in ``common.pt`` with
    another shape was reported as "not in the checkpoint", naming no shape."""
    ckptd.save(
        {"w": ckptd.ShardedTensor.from_rank_offsets("w", torch.ones(4)), "scale": torch.ones(3)}, tmp_path / "ck"
    )
    with pytest.raises(LoadMismatchError, match=r"'scale': .*common state .* shape \(3,\) .* shape \(5,\)"):
        ckptd.load({"w": torch.zeros(4), "scale": torch.zeros(5)}, tmp_path / "ck")
    assert torch.equal(
        ckptd.load({"w": torch.zeros(4), "scale": torch.zeros(3)}, tmp_path / "ck")["scale"], torch.ones(3)
    )


def test_a_key_stored_as_another_kind_is_named_as_such(tmp_path: Path):
    """A tensor requested where a value was saved (or the reverse) was "not in the checkpoint"."""
    d = tmp_path / "c"
    ckptd.save({"a": torch.arange(6.0).reshape(2, 3), "step": 5}, d)
    with pytest.raises(LoadMismatchError, match="tensor 'step' was requested, but the checkpoint stores a value"):
        ckptd.load({"step": torch.zeros(1)}, d)
    with pytest.raises(LoadMismatchError, match="value 'a' was requested, but the checkpoint stores a tensor"):
        ckptd.load({"a": 3}, d)


def test_a_data_file_that_ends_early_while_it_is_read_names_the_item_and_file(tmp_path: Path, monkeypatch):
    """A file truncated after the load checked its size (a flaky network mount): the error said
    "short read at offset N" and named neither the file nor the item."""
    import ckptd.loading.execute as execute

    d = tmp_path / "c"
    ckptd.save({"a": torch.arange(1 << 16, dtype=torch.float32)}, d)
    real = os.pread

    class Shrinking:
        @staticmethod
        def pread(fd: int, n: int, offset: int) -> bytes:
            return real(fd, n, offset)[: n // 2]

        def __getattr__(self, name: str):
            return getattr(os, name)

    monkeypatch.setattr(execute, "os", Shrinking())
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'a' chunk .*__0_0\.distcp\): the file ended early"):
        ckptd.load({"a": torch.zeros(1 << 16)}, d)


def test_a_factory_whose_piece_a_lenient_strict_mode_skipped_is_left_out(tmp_path: Path, caplog):
    """strict='log_unexpected' and a ShardedTensorFactory one of whose pieces the checkpoint lacks:
    its merge_fn got the unfilled template for that piece (a TypeError naming nothing, or a
    template object in the result from a tolerant merge_fn)."""
    from ckptd import ShardedTensorFactory

    d = tmp_path / "c"
    ckptd.save(
        {"a": ST.from_rank_offsets("a", torch.ones(2)), "b": ST.from_rank_offsets("b", torch.full((3,), 2.0))}, d
    )

    def factory(second: str) -> ShardedTensorFactory:
        def build(key, t, replica_id, flattened_range):
            return {"x": ST.from_rank_offsets("a", torch.zeros(2)), "y": ST.from_rank_offsets(second, torch.zeros(3))}

        return ShardedTensorFactory("f", torch.zeros(5), build, lambda sub: torch.cat([sub["x"], sub["y"]]))

    assert torch.equal(ckptd.load({"f": factory("b")}, d)["f"], torch.tensor([1.0, 1, 2, 2, 2]))
    with caplog.at_level("WARNING", logger="ckptd"):
        out = ckptd.load({"f": factory("zz")}, d, strict="log_unexpected")
    assert "f" not in out
    assert "the factory 'f' was not loaded: the checkpoint lacks its piece(s) ['zz']" in caplog.text
