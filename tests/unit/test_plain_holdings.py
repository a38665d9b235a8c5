"""Who writes each plain item, and what the coverage check refuses (pure logic, no processes).

The multi-rank cases (FSDP2 full state dicts, per-rank keys, per-rank dataloader state through
ckptd.save and a Checkpointer) are in tests/integration/test_rank_held_state.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd import ShardedObject, ShardedTensor, ShardingError
from ckptd.format.coverage import check_coverage, dedup_plain, settle, uniform_digest
from ckptd.format.records import BYTES, TENSOR, ItemRecord
from ckptd.format.saveplan import plan_rank
from ckptd.format.validate import validate_records
from ckptd.statedict.holdings import VALUE, PlainWriters, assign_writers, plain_digest, spread
from ckptd.statedict.split import split_state_dict


def test_values_go_to_the_lowest_holder_and_single_holders_keep_theirs():
    writers = assign_writers({"step": {2: VALUE, 1: VALUE}, "only": {3: 400}, "dl.dp_rank_1": {1: VALUE}})
    assert writers == {"step": 1, "only": 3, "dl.dp_rank_1": 1}


def test_shared_tensors_largest_first_to_the_least_loaded_holder():
    holdings = {k: dict.fromkeys((0, 1), n) for k, n in {"a": 100, "b": 60, "c": 50, "d": 10}.items()}
    # a -> 0 (100); b -> 1 (60); c -> 1 (110); d -> 0 (110)
    assert assign_writers(holdings) == {"a": 0, "b": 1, "c": 1, "d": 0}
    # A key held by one rank is its own and does not weigh on the others' choices.
    holdings["big_on_1"] = {1: 10_000}
    assert assign_writers(holdings) == {"a": 0, "b": 1, "c": 1, "d": 0, "big_on_1": 1}
    # Only the holders are candidates.
    assert assign_writers({"x": {2: 8, 5: 8}, "y": {2: 8, 5: 8}}) == {"x": 2, "y": 5}


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.dictionaries(st.text("abc.", min_size=1, max_size=4), st.sampled_from([VALUE, 0, 4, 8, 64, 1000])),
    world=st.integers(1, 6),
)
def test_spread_is_the_global_assignment_when_every_rank_holds_every_key(sizes, world):
    uniform = {k: dict.fromkeys(range(world), n) for k, n in sizes.items()}
    assert spread(sizes, world) == assign_writers(uniform)


def _split(sd: dict):
    return split_state_dict(sd)


def test_the_plain_digest_names_keys_dtypes_and_shapes_only():
    base = {"w": torch.zeros(2, 3), "step": 4, "d": {"x": torch.ones(1)}}
    d = plain_digest(_split(base))
    assert d and d == plain_digest(_split({**base, "step": 5, "w": torch.ones(2, 3)}))  # values do not count
    for changed in ({**base, "w": torch.zeros(3, 2)}, {**base, "w": torch.zeros(2, 3, dtype=torch.bfloat16)},
                    {**base, "extra": 1}, {"w": base["w"], "d": base["d"]}):  # fmt: skip
        assert plain_digest(_split(changed)) != d
    assert plain_digest(_split({})) != d  # a rank holding nothing differs from one holding all
    assert plain_digest(_split({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))})) == ""


def test_a_rank_spreads_only_while_a_verdict_confirms_its_digest():
    sd = {"a": torch.zeros(100), "b": torch.zeros(60), "step": 3}
    split = _split(sd)
    digest = plain_digest(split)
    writers = PlainWriters()
    assert writers.skip(digest, split, 1, 2) == frozenset()  # not confirmed: write everything
    writers.sent(1, digest)
    writers.committed(1, "")  # the ranks' digests differed
    assert writers.skip(digest, split, 1, 2) == frozenset()
    writers.sent(2, digest)
    writers.committed(2, digest)
    assert writers.skip(digest, split, 1, 2) == {"a", "step"}  # a -> rank 0, b -> rank 1, values -> rank 0
    assert writers.skip(digest, split, 0, 2) == {"b"}
    other = _split({**sd, "c": torch.zeros(1)})
    assert writers.skip(plain_digest(other), other, 1, 2) == frozenset()  # its keys changed
    writers.sent(3, digest)
    writers.sent(4, digest)
    writers.failed(4)
    assert writers.skip(digest, split, 1, 2) == frozenset()
    writers.committed(3, digest)  # a late verdict of a save older than the failure
    assert writers.confirmed == ""
    writers.sent(5, digest)
    writers.committed(5, digest)
    assert writers.confirmed == digest


def _plain(key: str, rank: int, nbytes: int = 0, crc: int | None = None, shape=(4,)) -> ItemRecord:
    if nbytes == VALUE:
        return ItemRecord(fqn=key, kind=BYTES, rank=rank, path=(key,), crc=crc)
    return ItemRecord(
        fqn=key,
        kind=TENSOR,
        rank=rank,
        dtype="uint8",
        global_shape=shape,
        offsets=(0,) * len(shape),
        sizes=shape,
        path=(key,),
        crc=crc,
    )


def test_dedup_keeps_the_assigned_writers_copy_and_warns_when_copies_differ():
    records = [_plain("w", 0, 4, 7), _plain("w", 1, 4, 7), _plain("step", 0, VALUE, 1), _plain("step", 1, VALUE, 2)]
    records.append(_plain("only1", 1, 4))
    kept, warnings = dedup_plain(records)
    assert sorted((r.fqn, r.rank) for r in kept) == [("only1", 1), ("step", 0), ("w", 0)]
    (warning,) = warnings
    assert "'step'" in warning and "only rank 0's is stored" in warning and "ranks [1] differ" in warning
    # Megatron-style records (no path) are never merged: duplicates reach validate_records.
    obj = ItemRecord(fqn="o/shard_0_1", kind=BYTES, rank=0)
    assert dedup_plain([obj, ItemRecord(fqn="o/shard_0_1", kind=BYTES, rank=1)])[0] == [
        obj,
        ItemRecord(fqn="o/shard_0_1", kind=BYTES, rank=1),
    ]


def _chunk(rank: int, offsets: tuple[int, ...], crc: int | None = 1, path: tuple = ("w",)) -> ItemRecord:
    return ItemRecord(
        fqn="w",
        kind=TENSOR,
        rank=rank,
        dtype="float32",
        global_shape=(4, 2),
        offsets=offsets,
        sizes=(2, 2),
        path=path,
        crc=crc,
    )


def test_dedup_keeps_one_copy_of_a_dtensor_chunk_that_ranks_of_several_submeshes_store():
    # A DTensor on the "tp" submesh of a (dp=2, tp=2) mesh: ranks 0 and 2 store rows 0-1, 1 and 3
    # rows 2-3. The lowest rank's copy is kept; validate_records refused the pair.
    records = [_chunk(2, (0, 0)), _chunk(3, (2, 0)), _chunk(0, (0, 0)), _chunk(1, (2, 0))]
    kept, warnings = dedup_plain(records)
    assert sorted((r.rank, r.offsets) for r in kept) == [(0, (0, 0)), (1, (2, 0))] and warnings == []
    validate_records(kept)
    # Copies that differ are different tensors under one key (two pipeline stages' layers.0), or
    # copies without checksums cannot be told from them: refused, not merged.
    with pytest.raises(ShardingError, match=r"'w': its chunk at offsets \[0, 0\] is stored by several ranks with"):
        dedup_plain([_chunk(0, (0, 0), 1), _chunk(2, (0, 0), 2), _chunk(1, (2, 0))])
    with pytest.raises(ShardingError, match=r"without checksums \(ranks \[2\]\)"):
        dedup_plain([_chunk(0, (0, 0), 1), _chunk(2, (0, 0), None), _chunk(1, (2, 0))])
    # A Megatron-style chunk (no path) is one rank's main replica: two of them stay an error.
    megatron = [_chunk(0, (0, 0), path=()), _chunk(2, (0, 0), path=()), _chunk(1, (2, 0), path=())]
    assert dedup_plain(megatron)[0] == megatron
    with pytest.raises(ShardingError, match=r"ranks 0 and 2 both store the chunk at offsets \(0, 0\)"):
        validate_records(megatron)


def test_dedup_refuses_copies_that_are_not_the_same_item():
    with pytest.raises(ShardingError, match=r"ranks 0 and 1 hold different things under the key 'w'"):
        dedup_plain([_plain("w", 0, 4, shape=(4,)), _plain("w", 1, 8, shape=(8,))])
    with pytest.raises(ShardingError, match="a value and a uint8 tensor"):
        dedup_plain([_plain("w", 0, VALUE), _plain("w", 1, 4)])


def test_coverage_names_each_key_nobody_stores_with_its_holders():
    stored = [ItemRecord(fqn="w", kind=TENSOR, rank=0, dtype="float32", global_shape=(2,), offsets=(0,), sizes=(2,))]
    check_coverage(stored, {0: [], 1: ["w"]})  # rank 1's replica of w is stored by rank 0
    with pytest.raises(ShardingError) as err:
        check_coverage(stored, {0: ["emb", "opt/shard_0_1"], 1: ["emb", "w"], 2: ["emb"]})
    text = str(err.value)
    assert "2 key(s) would not be stored" in text
    assert "'emb' (held by ranks [0, 1, 2])" in text and "'opt/shard_0_1' (held by ranks [0])" in text
    assert "replica_id 0" in text


def test_settle_hints_at_changed_plain_keys_when_the_digests_differ():
    records = {0: [_plain("a", 0, 4)], 1: []}
    with pytest.raises(ShardingError, match="plain keys changed since a save"):
        settle(records, {0: [], 1: ["b"]}, {0: "d1", 1: "d2"})
    with pytest.raises(ShardingError) as err:
        settle(records, {0: [], 1: ["b"]}, {0: "d1", 1: "d1"})
    assert "plain keys changed" not in str(err.value)
    both = {0: [_plain("a", 0, 4)], 1: [_plain("a", 1, 4)]}
    out, _ = settle(both, {0: [], 1: []}, {0: "d", 1: "d"})
    assert out == {0: [_plain("a", 0, 4)], 1: []}
    assert uniform_digest({0: "d", 1: "d"}, 2) == "d"
    assert uniform_digest({0: "d", 1: "e"}, 2) == uniform_digest({0: "d"}, 2) == ""


def test_plan_rank_reports_replicas_and_skipped_plain_items_as_held():
    w = torch.ones(4)
    sd = {
        "a": ShardedTensor.from_rank_offsets("a", w, replica_id=1),
        "b": ShardedTensor.from_rank_offsets("b", w, (0, 1, 2), replica_id=(0, 1)),
        "c": ShardedTensor.from_rank_offsets("c", w),
        "c2": ShardedTensor.from_rank_offsets("c", w, (0, 1, 2), replica_id=1),  # c: written by this rank
        "o": ShardedObject("o", {"x": 1}, (2,), (1,), replica_id=1),
    }
    plan = plan_rank(split_state_dict(sd), 1)
    assert [i.record.fqn for i in plan.items] == ["c"]
    assert plan.held == ["a", "b", "o/shard_1_2"]
    dcp = split_state_dict({"t": torch.ones(2), "u": torch.ones(3), "step": 1})
    plan = plan_rank(dcp, 0, skip=frozenset({"u", "step"}))
    assert [i.record.fqn for i in plan.items] == ["t"] and plan.held == ["u", "step"]
    assert [i.record.fqn for i in plan_rank(dcp, 1).items] == ["t", "u", "step"]  # every plain item


def test_a_save_of_10000_replicas_sends_their_keys_once():
    """A data-parallel rank holding 10,000 replicas sends their keys (not records) with its
    layout, and nothing more while the layout stays the same."""
    from ckptd.client.layout import LayoutCache
    from ckptd.control.codec import Codec
    from ckptd.staging.rankside import place
    from tests.messages import a_save

    sd = {f"layers.{i}.weight": ShardedTensor.from_rank_offsets(f"layers.{i}.weight", torch.ones(2), replica_id=1)
          for i in range(10_000)}  # fmt: skip
    sd["mine"] = ShardedTensor.from_rank_offsets("mine", torch.ones(2), (0, 1, 2))
    codec, cache = Codec("job"), LayoutCache()

    def save_nbytes() -> tuple[int, int]:
        plan = plan_rank(split_state_dict(sd), 1)
        placements, _ = place(plan.items)
        wire, layout, held = cache.items_for("g", plan.items, placements, plan.held)
        msg = a_save(rank=1, world_size=2, items=wire, layout=layout, held=held)
        return sum(len(f) for f in codec.encode(msg)), len(held)

    first, held = save_nbytes()
    assert held == 10_000 and first < 10_000 * 24  # ~19 bytes per key of 17 characters
    again, held = save_nbytes()
    assert held == 0 and again < 512
