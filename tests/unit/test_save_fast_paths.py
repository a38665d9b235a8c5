"""The save path's fast paths (for many small tensors) produce exactly what the straightforward code did.

- control messages and item records: msgspec's encoding, the same msgpack bytes as asdict();
- staging: small CPU tensors staged by one memmove, every other tensor by copy_: the same bytes;
- data files: early writeback (sync_file_range while writing) changes no byte of the file;
- Checkpointer.save pauses the cyclic GC and restores it, also when the save raises.
"""

from __future__ import annotations

import gc
import secrets
from dataclasses import asdict

import msgpack
import pytest
import torch

from ckptd.control.codec import Codec
from ckptd.control.protocol import PROTOCOL_VERSION, SaveItem, StatusReply
from ckptd.format import items as items_mod
from ckptd.format.records import TENSOR, ItemRecord
from ckptd.gcpause import gc_paused
from ckptd.staging.devcopy import copy_inline
from ckptd.staging.rankside import StagingRing, bytes_view, place
from ckptd.staging.ring import HEADER_NBYTES
from ckptd.staging.segment import unlink_segments
from tests.messages import a_save


def test_records_and_messages_encode_to_the_same_bytes_as_before():
    rec = ItemRecord(
        fqn="w",
        kind=TENSOR,
        rank=1,
        dtype="bfloat16",
        global_shape=(4, 6),
        offsets=(2, 0),
        sizes=(2, 6),
        relative_path="__1_0.distcp",
        file_offset=128,
        length=96,
        crc=7,
    )
    assert rec.nbytes == 2 * 6 * 2
    codec = Codec("job")
    for msg in (
        a_save(
            step=3,
            rank=1,
            world_size=2,
            items=[SaveItem(record=rec, offset=0, nbytes=24)],
            common=b"common",
            layout="l",
        ),
        StatusReply(info={"nested": [rec, {"t": (1, 2)}]}),
    ):  # a dataclass inside a field, too
        old = msgpack.packb(
            {"v": PROTOCOL_VERSION, "t": int(msg.TYPE), "job": "job", "f": asdict(msg)}, use_bin_type=True
        )
        assert codec.encode(msg)[0] == old
    save = a_save(step=3, rank=1, world_size=2, items=[SaveItem(record=rec, offset=0, nbytes=24)], layout="l")
    assert codec.decode(codec.encode(save)) == save  # back into the typed items


def test_staging_copies_exactly_the_values_of_every_kind_of_tensor():
    gen = torch.Generator().manual_seed(0)
    big = torch.randn((1 << 18) + 5, generator=gen)
    base = torch.randn(64, 64, generator=gen)
    c = torch.randn(8, dtype=torch.complex64, generator=gen)
    payloads = [
        torch.randn(7, 3, generator=gen),  # small, contiguous: memmove
        base[3:9],  # a view with a storage offset: memmove
        base.t()[:5],  # not contiguous: copy_
        c.conj(),  # conjugate bit: copy_ resolves it
        -torch.randn(4, dtype=torch.complex64, generator=gen).conj().imag,  # negative bit view
        torch.randn(10, generator=gen).to(torch.bfloat16),
        torch.empty(0),
        big,  # large: copy_
        torch.nn.Parameter(torch.randn(3, generator=gen)),
    ]
    items = [items_mod.PlannedItem(None, p) for p in payloads]  # type: ignore[arg-type]
    placements, nbytes = place(items)
    prefix = f"ckptd-unit{secrets.token_hex(3)}-n0-"
    ring = StagingRing.create(prefix, 0, -(-nbytes // 4096) * 4096, timeout_s=10)
    try:
        block, start = ring.claim(placements)
        copy_inline(ring, start, block, items, placements, b"s" * 16)
        base_t = ring.segment.base
        for p, pl in zip(payloads, placements):
            raw = memoryview(base_t.numpy()).cast("B")[HEADER_NBYTES + start + pl.offset :][: pl.nbytes]
            got = bytes_view(raw, p.dtype, p.shape)
            assert torch.equal(got, p.detach().resolve_conj().resolve_neg())
    finally:
        ring.close(unlink=True)
        assert not unlink_segments(prefix)


def test_early_writeback_writes_the_same_file(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    recs_items = []
    for i in range(5):
        t = torch.randn(1000 + i, generator=gen)
        rec = ItemRecord(
            fqn=f"t{i}",
            kind=TENSOR,
            rank=0,
            dtype="float32",
            global_shape=(t.numel(),),
            offsets=(0,),
            sizes=(t.numel(),),
        )
        recs_items.append(items_mod.PlannedItem(rec, t))
    plain = items_mod.write_data_file(tmp_path, "plain", recs_items, fsync=False)
    calls = []
    real = items_mod._SYNC_FILE_RANGE
    if real is None:
        pytest.skip("no sync_file_range on this system")

    def spy(fd, off, n, flags):
        calls.append((off, n))
        return real(fd, off, n, flags)

    monkeypatch.setattr(items_mod, "_SYNC_FILE_RANGE", spy)
    monkeypatch.setattr(items_mod, "WRITEBACK_NBYTES", 1)  # after every item
    synced = items_mod.write_data_file(tmp_path, "synced", recs_items, fsync=True)
    assert len(calls) == 5 and calls[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(calls, calls[1:]))
    assert (tmp_path / "plain").read_bytes() == (tmp_path / "synced").read_bytes()
    assert [(r.file_offset, r.length, r.crc) for r in plain] == [(r.file_offset, r.length, r.crc) for r in synced]


def test_gc_paused_restores_the_collector():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("a failed save")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # the caller's choice stays
    finally:
        gc.enable()


def test_plan_cache_reuses_checked_records_only_for_unchanged_shards():
    from ckptd.errors import ShardingError
    from ckptd.format.saveplan import PlanCache, plan_save
    from ckptd.mapping import ShardedObject, ShardedTensor
    from ckptd.statedict.split import split_state_dict

    def sd(w, flat, obj="a"):
        return {
            "w": ShardedTensor.from_rank_offsets("w", w, (0, 1, 2)),
            "opt": ShardedTensor.from_rank_offsets_flat(
                "opt", flat, (4, 6), (0, 0, 1), flattened_range=slice(5, 5 + flat.numel())
            ),
            "o": ShardedObject("o", obj, (1,), (0,)),
        }

    cache = PlanCache()
    first = plan_save(split_state_dict(sd(torch.randn(3, 4), torch.randn(11))), 0, cache)
    w, flat = torch.randn(3, 4), torch.randn(11)
    second = plan_save(split_state_dict(sd(w, flat, "b")), 0, cache)
    plain = plan_save(split_state_dict(sd(w, flat, "b")), 0)  # no cache: the reference
    assert [i.record for i in second] == [i.record for i in plain]
    tensors = [(a.payload, b.payload) for a, b in zip(second, plain) if isinstance(a.payload, torch.Tensor)]
    assert len(tensors) == len(first) - 1 >= 3  # a flattened shard stores several pieces
    assert all(torch.equal(a, b) and a.data_ptr() == b.data_ptr() for a, b in tensors)  # views, no copy
    assert all(a.record is b.record for a, b in zip(first, second) if a.record.kind == TENSOR)  # reused
    assert second[-1].payload != first[-1].payload  # objects are serialized again every time

    # A record list equal to the last checked one skips the duplicate check; any other is checked.
    again = plan_save(split_state_dict(sd(w, flat, "b")), 0, cache)
    assert tuple(i.record for i in again) == cache.checked
    twice = sd(w, flat) | {"w_again": ShardedTensor.from_rank_offsets("w", w, (0, 1, 2))}
    with pytest.raises(ShardingError, match="stores 'w' chunk at offsets .* twice"):
        plan_save(split_state_dict(twice), 0, cache)

    # A shard whose metadata changed is planned and checked again.
    changed = plan_save(split_state_dict(sd(torch.randn(5, 4), flat)), 0, cache)
    assert changed[0].record.global_shape == (10, 4) and changed[0].record is not second[0].record
    with pytest.raises(ShardingError, match="meta"):
        plan_save(split_state_dict(sd(torch.empty(5, 4, device="meta"), flat)), 0, cache)


def test_unchanged_plain_values_reuse_their_serialized_bytes():
    """A DCP-style state dict's plain values (step, param_groups...) become bytes items pickled
    with torch.save, ~0.5 ms each; with a PlanCache an equal value reuses the last save's bytes
    (the same object), a changed one, also changed in place, is pickled again, and the bytes
    always equal a plan without the cache. Before, every save pickled every value again."""
    from ckptd.format.saveplan import PlanCache, plan_save
    from ckptd.statedict.split import split_state_dict

    groups = [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1], "fused": None}]

    def sd(step, lr=0.1):
        groups[0]["lr"] = lr
        return {"model": {"w": torch.ones(4)}, "optim": {"param_groups": groups}, "step": step, "tag": "x"}

    def byte_items(items):
        return {i.record.fqn: i.payload for i in items if i.record.kind != TENSOR}

    cache = PlanCache()
    first = byte_items(plan_save(split_state_dict(sd(1)), 0, cache))
    second = byte_items(plan_save(split_state_dict(sd(2)), 0, cache))
    params, lr = "optim.param_groups.0.params", "optim.param_groups.0.lr"
    assert len(first) == 6
    assert all(second[k] is first[k] for k in first if k != "step")  # reused
    assert second["step"] != first["step"]  # changed: pickled again
    groups[0]["params"].append(2)  # changed in place
    third = byte_items(plan_save(split_state_dict(sd(2, lr=0.1)), 0, cache))
    assert third[params] is not second[params] and third["step"] is second["step"]
    fresh = byte_items(plan_save(split_state_dict(sd(2, lr=0.1)), 0))
    assert third == fresh  # the same bytes as without the cache
    assert byte_items(plan_save(split_state_dict(sd(2, lr=0.2)), 0, cache))[lr] != fresh[lr]


def test_a_plain_tensor_of_a_dcp_style_state_dict_is_planned_as_the_checked_way_plans_it():
    """Plain tensors (ShardedTensor.whole, made by the split) skip the checks of what holds by
    construction: their records and payloads are those of the checked way, for every shape, dtype,
    view and device; what the checked way refuses is still refused."""
    from ckptd import ShardedTensor
    from ckptd.errors import ShardingError
    from ckptd.format.items import plan_tensor_items
    from ckptd.format.saveplan import PlanCache, plan_rank
    from ckptd.statedict.split import split_state_dict

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 5),
        "row": base[1],
        "transposed": base.t(),
        "strided": base[:, ::2],
        "bf16": torch.ones(3, 2, dtype=torch.bfloat16),
        "int8": torch.arange(7, dtype=torch.int8),
        "bool": torch.tensor([True, False]),
        "param": torch.nn.Parameter(torch.ones(2, 2)),  # a subclass: the checked way
        "deep": torch.zeros(1, 1, 1, 1, 1),
    }
    sd = {"m": dict(tensors), "opt": [{"x": torch.ones(2)}], "step": 3}
    split = split_state_dict(sd)
    for rank in (0, 3):
        for cache in (None, PlanCache()):  # a cache is one rank's
            got = plan_rank(split, rank, cache).items
            want = []
            for sh in split.sharded.values():
                if isinstance(sh, ShardedTensor):
                    checked = ShardedTensor.from_rank_offsets(sh.key, sh.data)
                    want += plan_tensor_items(checked, rank, split.dcp_paths[sh.key])
            got_tensors = [i for i in got if isinstance(i.payload, torch.Tensor)]
            assert [i.record for i in got_tensors] == [i.record for i in want]
            for a, b in zip(got_tensors, want):
                assert a.payload is b.payload or (a.payload.data_ptr(), a.payload.shape, a.payload.stride()) == (
                    b.payload.data_ptr(),
                    b.payload.shape,
                    b.payload.stride(),
                )
    for bad, match in (
        (torch.zeros(2, device="meta"), "meta tensor"),
        (torch.zeros(2, 2).to_sparse(), "sparse"),
        (torch.zeros(2, dtype=torch.uint8).view(torch.bits8), "tensor 'm.bad' has dtype torch.bits8"),
    ):
        with pytest.raises(ShardingError, match=match):
            plan_rank(split_state_dict({"m": {"bad": bad}}), 0, PlanCache())


def test_the_plan_cache_never_reuses_a_record_of_another_dcp_path():
    """{"a": [t, 5]} and {"a": {0: t, 1: 5}} have the same state-dict paths and keys but not the
    same DCP paths (planner_data: ("a", 0) against ("a", "0")): the cached records of the first
    were reused for the second, and .metadata gave its values back as a list."""
    from ckptd.format.saveplan import PlanCache, plan_rank
    from ckptd.statedict.split import split_state_dict

    t = torch.ones(2)
    for first, second in (({"a": [t, 5]}, {"a": {0: t, 1: 5}}), ({"a": {0: t, 1: 5}}, {"a": [t, 5]})):
        cache = PlanCache()
        plan_rank(split_state_dict(first), 0, cache)
        cached = plan_rank(split_state_dict(second), 0, cache)
        fresh = plan_rank(split_state_dict(second), 0, PlanCache())
        assert [i.record for i in cached.items] == [i.record for i in fresh.items]
