"""Bad input to ``ckptd.save``: a clear ckptd error on every rank, and nothing lost or left behind.

Every case saves next to (or into) an existing good checkpoint, which must stay byte-identical,
and the failed target must not appear (no partial files). The multi-rank cases run on two real
ranks in one spawned run; each rank returns what it raised.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch

import ckptd
from ckptd import CheckpointExistsError, ShardedObject, ShardedTensor, ShardingError
from ckptd.errors import SaveFailedError
from tools.harness.ranks import run_ranks

ST = ShardedTensor


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def chunk(key: str, data: torch.Tensor, offset: int, global_len: int) -> ShardedTensor:
    """A 1-D chunk ``[offset, offset + len(data))`` of a tensor of ``global_len`` elements."""
    return ST(key, data, data.dtype, tuple(data.shape), (global_len,), (offset,), None)


def good_state(rank: int = 0, world: int = 1) -> dict[str, Any]:
    x = torch.arange(8 * world, dtype=torch.float32)
    return {"w": ST.from_rank_offsets("w", x[8 * rank : 8 * rank + 8].clone(), (0, rank, world)), "step": 1}


def _unpicklable() -> Callable[[], int]:
    return lambda: 1


class _FailingOpener:
    """Fails the data file of one rank mid-write, as a full disk would (real files, real writes)."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def __call__(self, path: str, mode: str) -> BinaryIO:
        f = open(path, mode)  # noqa: SIM115 - returned to the caller
        if self.fail and path.endswith(".distcp"):
            real_write = f.write

            def write(data: Any) -> int:
                real_write(data)
                raise OSError(28, "No space left on device (injected)")

            f.write = write  # type: ignore[method-assign]
        return f


def bad_states(rank: int) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """case -> (state dict of this rank, extra save kwargs). Two ranks."""
    ones = torch.ones(4)
    objs = {"o": ShardedObject("o", _unpicklable() if rank == 1 else 1, (2,), (rank,))}
    non_tensor = chunk("nt", ones, 4 * rank, 8)
    if rank == 1:
        non_tensor.data = [1.0, 2.0, 3.0, 4.0]  # replaced after construction
    return {
        # rank 1's chunk starts at 3, inside rank 0's [0, 4)
        "overlap": ({"t": chunk("t", ones, 3 * rank, 8)}, {}),
        # rank 1's chunk starts at 5: element 4 is stored by nobody
        "gap": ({"t": chunk("t", ones, 5 * rank, 9)}, {}),
        "shape": ({"t": chunk("t", ones, 4 * rank, 8 + rank)}, {}),
        "dtype": ({"t": chunk("t", ones.to(torch.float16 if rank else torch.float32), 4 * rank, 8)}, {}),
        "non_tensor": ({"nt": non_tensor}, {}),
        "object_pickle": (objs, {}),
        "common_pickle": ({**good_state(rank, 2), "hook": _unpicklable() if rank == 0 else None}, {}),
        "write_fails": (good_state(rank, 2), {"opener": _FailingOpener(fail=rank == 1)}),
        # a ShardedObject of 3 shards, of which ranks 0 and 1 hold 2: the save used to succeed
        "object_missing": ({**good_state(rank, 2), "o": ShardedObject("o", rank, (3,), (rank,))}, {}),
        "object_shapes": ({**good_state(rank, 2), "o": ShardedObject("o", rank, (2 + rank,), (rank,))}, {}),
        # rank 1's state dict holds a ShardedTensor, rank 0's none: rank 0's values were lost
        # (a rank with only plain values takes the others' style: test_a_rank_of_plain_values_...)
        "dialects": ({"step": 5, "t": torch.ones(2), **({"w": chunk("w", ones, 0, 4)} if rank else {})}, {}),
    }


EXPECTED: dict[str, tuple[type, list[str]]] = {
    "overlap": (ShardingError, ["'t'", "rank 0", "rank 1", "overlaps", "replica"]),
    "gap": (ShardingError, ["'t'", "cover 8 of 9", "element (4,) is stored by no rank", "replica_id"]),
    "shape": (ShardingError, ["'t'", "rank 0", "rank 1", "(8,)", "(9,)", "agree"]),
    "dtype": (ShardingError, ["'t'", "float32", "float16", "one dtype"]),
    "non_tensor": (ShardingError, ["'nt'", "rank 1", "list", "ShardedObject"]),
    "object_pickle": (ShardingError, ["'o/shard_1_2'", "rank 1", "pickled"]),
    "common_pickle": (ShardingError, ["common state", "'hook'", "pickled", "LocalNonPersistentObject"]),
    "write_fails": (SaveFailedError, ["rank 1", "could not write", "No space left"]),
    "object_missing": (ShardingError, ["ShardedObject 'o'", "2 of its 3 shards", "shard (2,) by none", "replica_id"]),
    "object_shapes": (ShardingError, ["ShardedObject 'o'", "several global shapes", "(2,)", "(3,)"]),
    "dialects": (ShardingError, ["different styles", "ranks [0] dcp-style", "ranks [1] megatron-style"]),
    "exists": (CheckpointExistsError, ["good", "already holds a checkpoint", "new directory"]),
}


def _bad_saves(rank: int, world: int, root: str) -> list[tuple[str, str, str]]:
    base = Path(root)
    ckptd.save(good_state(rank, world), base / "good")
    raised = []
    cases = {**bad_states(rank), "exists": (good_state(rank, world), {})}
    for case, (state, kwargs) in cases.items():
        target = base / ("good" if case == "exists" else case)
        try:
            ckptd.save(state, target, **kwargs)
            raised.append((case, "", "no error"))
        except ckptd.CkptdError as exc:
            raised.append((case, type(exc).__name__, str(exc)))
        except Exception as exc:  # noqa: BLE001 - a non-ckptd error is a failure, reported
            raised.append((case, f"non-ckptd {type(exc).__name__}", str(exc)))
    return raised


def _assert_raised(case: str, cls_name: str, msg: str, rank: int) -> None:
    cls, needles = EXPECTED[case]
    assert cls_name == cls.__name__, (case, rank, cls_name, msg)
    missing = [n for n in needles if n not in msg]
    assert not missing, (case, rank, missing, msg)


@pytest.mark.timeout(120)
def test_bad_multi_rank_saves_raise_on_every_rank_and_touch_nothing(tmp_path: Path):
    results = run_ranks(_bad_saves, 2, str(tmp_path), timeout_s=90)
    for rank, raised in enumerate(results):
        assert [c for c, *_ in raised] == list(EXPECTED)
        for case, cls_name, msg in raised:
            _assert_raised(case, cls_name, msg, rank)
    # Nothing appeared but the good checkpoint, which still loads (and no rank's file is left).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]
    assert sorted(p.name for p in (tmp_path / "good").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "common.pt",
        "metadata.json",
    ]
    assert torch.equal(ckptd.load_plain_tensors(tmp_path / "good")["w"], torch.arange(16, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# Single process: the same guarantees, and the errors that need no second rank.


@pytest.fixture
def good(tmp_path: Path):
    """An existing checkpoint ``tmp_path/good``; checks after the test that it is unchanged and
    that nothing else appeared under ``tmp_path``."""
    ckptd.save(good_state(), tmp_path / "good")
    before = snapshot(tmp_path)
    yield tmp_path / "good"
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]


@pytest.mark.parametrize("case", ["overlap", "gap", "dtype", "shape"])
def test_inconsistent_chunks_in_one_process(good: Path, case: str):
    # The chunks of bad_states' two ranks, here both in one process (reported as rank 0).
    state = {f"r{r}": bad_states(r)[case][0]["t"] for r in range(2)}
    with pytest.raises(ShardingError, match="'t'"):
        ckptd.save(state, good.parent / "bad")


def test_non_tensor_data_is_refused_at_construction_and_at_save(good: Path):
    with pytest.raises(ShardingError, match="'k'.*must be a torch.Tensor.*ShardedObject"):
        ST.from_rank_offsets("k", [1, 2, 3])
    with pytest.raises(ShardingError, match="'k'.*dtype"):
        ST("k", torch.ones(2), torch.float16, (2,), (2,), (0,), None)
    meta = ST.from_rank_offsets("k", torch.empty(2, device="meta"))
    with pytest.raises(ShardingError, match="'k'.*meta tensor"):
        ckptd.save({"k": meta}, good.parent / "bad")
    with pytest.raises(ShardingError, match="'nt'.*list"):
        ckptd.save({"nt": bad_states(1)["non_tensor"][0]["nt"]}, good.parent / "bad")
    # A sparse tensor is refused when the save is planned, not later by the copy into the ring.
    sparse = torch.eye(4).to_sparse()
    for state in ({"s": ST.from_rank_offsets("s", sparse)}, {"s": sparse}):
        with pytest.raises(ShardingError, match="'s'.*sparse_coo.*to_dense"):
            ckptd.save(state, good.parent / "bad")


def test_sharded_entry_inside_a_tuple_is_refused(good: Path):
    state = {"pair": (ST.from_rank_offsets("k", torch.ones(2)), 1)}
    with pytest.raises(ShardingError, match="pair.0.*tuple.*dict or a list"):
        ckptd.save(state, good.parent / "bad")


def test_saving_into_an_existing_checkpoint_is_refused(good: Path):
    with pytest.raises(CheckpointExistsError, match="already holds a checkpoint.*new directory"):
        ckptd.save(good_state(), good)
    (good.parent / "file").write_text("x")
    with pytest.raises(CheckpointExistsError, match="not a directory"):
        ckptd.save(good_state(), good.parent / "file")
    (good.parent / "file").unlink()


def test_failed_write_leaves_no_partial_checkpoint(good: Path):
    with pytest.raises(SaveFailedError, match="rank 0 could not write .*__0_0.distcp.*injected"):
        ckptd.save(good_state(), good.parent / "bad", opener=_FailingOpener(fail=True))
    # An existing empty target directory stays (empty): it was the caller's.
    (good.parent / "empty").mkdir()
    with pytest.raises(SaveFailedError, match="injected"):
        ckptd.save(good_state(), good.parent / "empty", opener=_FailingOpener(fail=True))
    assert list((good.parent / "empty").iterdir()) == []
    (good.parent / "empty").rmdir()


def test_a_plain_value_under_a_sharded_object_key_is_refused(tmp_path: Path):
    """A DCP-style value at the top level keyed like a ShardedObject's shard is read back as one
    (and not found): the save of it used to succeed."""
    with pytest.raises(ShardingError, match=r"'x/shard_0_1' \(rank 0\) has the form of a ShardedObject's key"):
        ckptd.save({"w": torch.ones(2), "x/shard_0_1": 5}, tmp_path / "c")
    ckptd.save({"w": torch.ones(2), "m": {"x/shard_0_1": 5}}, tmp_path / "d")  # nested: a path of its own
    assert ckptd.load_common_state_dict(tmp_path / "d") == {"m": {"x/shard_0_1": 5}}


def _one_rank_of_plain_values(rank: int, world: int, root: str) -> str:
    state = {"iteration": 3}
    if rank == 0:
        state["w"] = ShardedTensor.from_rank_offsets("w", torch.ones(2))
    ckptd.save(state, Path(root) / "c")
    return "saved"


@pytest.mark.timeout(120)
def test_a_rank_of_plain_values_takes_the_other_ranks_style(tmp_path: Path):
    """A rank whose state dict holds no tensor (only plain values, or nothing) is of no style of
    its own: the save is Megatron-style as rank 0's, not refused as mixed."""
    assert run_ranks(_one_rank_of_plain_values, 2, str(tmp_path), timeout_s=90) == ["saved", "saved"]
    out = ckptd.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, tmp_path / "c")
    assert torch.equal(out["w"], torch.ones(2)) and out["iteration"] == 3


def test_a_full_filesystem_says_a_save_needs_room_for_one_checkpoint_more_than_retention_keeps():
    """With keep_last=1 'keep fewer checkpoints' could not be followed: retention removes the
    oldest only once the new one committed, so a save needs room for one more than it keeps."""
    import errno

    err = ckptd.StorageError.from_oserror(OSError(errno.ENOSPC, "No space left on device"), "/r/iter_0000004.tmp/x")
    assert "/r/iter_0000004.tmp/x" in str(err) and "(ENOSPC)" in str(err)
    assert "room for one checkpoint more than it keeps" in str(err)
